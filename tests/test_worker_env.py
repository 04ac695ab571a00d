"""What every rank and read task runs with: its thread count, and no module it does not use.

Each import check runs a fresh interpreter (``sys.modules`` of this test process holds whatever
earlier tests imported). No timing here: the cost of these imports is ``bench/trial_cost.py``'s.
"""

import json
import subprocess
import sys

import pytest

from raymcn.config import load_config

# Modules only the driver's results, the sweep's search or an optional tracker use.
NOT_ON_A_WORKER = ("matplotlib", "raymcn.results", "raymcn.sweep", "mlflow", "wandb", "tensorboardX", "optuna",
                   "hpbandster", "ConfigSpace", "scipy", "statsmodels")


def modules_after(code: str) -> set[str]:
    """``sys.modules`` of a fresh interpreter after running ``code``."""
    proc = subprocess.run([sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(json.loads(proc.stdout.splitlines()[-1]))


def test_the_thread_count_follows_the_reservation_unless_set():
    for cpus, threads in ((0.5, 1), (1.0, 1), (2.5, 2), (8.0, 8)):
        assert load_config(None, [f"scale.cpus_per_worker={cpus}"]).scale.torch_threads == threads
    assert load_config(None, ["scale.cpus_per_worker=0.5", "scale.threads_per_worker=3"]).scale.torch_threads == 3


@pytest.mark.parametrize("module", ["raymcn.train.on_ray.worker", "raymcn.train.on_ray.launch", "raymcn.sweep.tuner"])
def test_the_train_workers_and_trial_drivers_import_nothing_they_do_not_use(module):
    loaded = modules_after(f"import {module}")
    allowed = {"raymcn.sweep"} if module == "raymcn.sweep.tuner" else set()
    assert [m for m in NOT_ON_A_WORKER if m in loaded and m not in allowed] == []


def test_raymcn_adds_no_third_party_module_to_what_ray_train_loads():
    """pandas is on a Train worker's path because Ray Train itself imports it; raymcn's worker
    module adds no package of its own beyond raymcn (Python's standard library aside: nothing to
    install)."""
    ray_only = {m.split(".")[0] for m in modules_after("import ray.train.torch, ray.data, torch")}
    ours = {m.split(".")[0] for m in modules_after("import raymcn.train.on_ray.worker")}
    assert ours - ray_only - set(sys.stdlib_module_names) <= {"raymcn", "isal", "yaml"}


@pytest.mark.parametrize("module", ["raymcn.data.read.stream", "raymcn.train.build"])
def test_the_ray_free_read_and_step_paths_import_neither_pandas_nor_ray(module):
    """The read tasks' module (their bodies run ``stream.read_steps``) loads no torch either; the
    step (``build``) is what the benchmarks run under torchrun, without Ray."""
    loaded = modules_after(f"import {module}")
    banned = ("pandas", "ray", *NOT_ON_A_WORKER) + (("torch",) if module == "raymcn.data.read.stream" else ())
    assert [m for m in banned if m in loaded] == []
