"""Every thread and process on its own GPU only, shown on CPU with a recording stand-in for
``torch.cuda`` (``cuda_stand_in.py``): the prefetch thread's first CUDA call makes the rank's
device its own, and the driver's path (config, preflight, trainer, sweep) and the doctor's
per-node probe initialise nothing. The ``gpu`` tests check the same on a real GPU: the driver's
CUDA stays uninitialised after the preflight, and a prefetch thread feeding GPU 1 leaves no
context on GPU 0."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from cuda_stand_in import CudaRecorder, fake_nvml

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


class _Source:
    """Three host batches of the batch contract's kind (tensors and keys)."""

    def __iter__(self):
        for i in range(3):
            yield {"video": torch.full((2, 3), float(i)), "nframes": torch.ones(2), "key": [f"v{i}#0", f"v{i}#1"]}


@pytest.mark.parametrize("rank_device", [1, 3])
def test_the_prefetch_threads_first_cuda_call_makes_the_ranks_gpu_its_own(monkeypatch, rank_device):
    """A rank's training thread is on its GPU (Ray Train set it there); the prefetch thread starts
    on GPU 0, and pinning or a stream switch there would open a context on GPU 0."""
    from raymcn.train.feed import Prefetcher

    cuda = CudaRecorder(monkeypatch)
    torch.cuda.set_device(rank_device)  # what Ray Train does in the training thread
    seen = [int(b["video"][0, 0]) for b in Prefetcher(_Source(), torch.device("cuda", rank_device), depth=2)]
    assert seen == [0, 1, 2]
    thread = cuda.in_thread("raymcn-prefetch")
    assert {c.name for c in thread} >= {"Tensor.pin_memory", "stream", "Tensor.to", "Event"}  # the CUDA path ran
    first = thread[0]
    assert (first.name, first.args) == ("set_device", (torch.device("cuda", rank_device),)), thread[:3]
    assert all(c.device == rank_device for c in thread[1:]), [c for c in thread if c.device != rank_device]
    # nothing anywhere touched another GPU
    assert all(c.device == rank_device for c in cuda.calls if c.name != "set_device"), cuda.calls


def test_a_prefetcher_given_cuda_without_index_works_on_the_constructing_threads_gpu(monkeypatch):
    from raymcn.train.feed import Prefetcher

    cuda = CudaRecorder(monkeypatch)
    torch.cuda.set_device(2)
    feed = Prefetcher(_Source(), "cuda", depth=1)
    assert feed.device == torch.device("cuda", 2)
    list(feed)
    assert cuda.in_thread("raymcn-prefetch")[0].args == (torch.device("cuda", 2),)


HEAD_GPUS = [(70 * GIB, 80 * GIB), (41 * GIB, 80 * GIB), (70 * GIB, 80 * GIB), (70 * GIB, 80 * GIB)]


@pytest.fixture
def gpu_head(monkeypatch, tmp_path):
    """This process as the driver on a 4-GPU head (GPU 1 partly taken by another process), with
    ``torch.cuda`` recorded and Ray not started; the trainer is built but its ``fit`` returns at
    once (a worker's side is not the driver's)."""
    import ray.train.torch

    import raymcn.cli as cli

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(HEAD_GPUS))
    cuda = CudaRecorder(monkeypatch, devices=len(HEAD_GPUS))
    monkeypatch.setattr(cli, "start_ray", lambda address: False)
    monkeypatch.setattr(cli, "_check_cluster", lambda cfg: None)  # ray.cluster_resources(): needs Ray
    fits: list = []

    def fit(trainer):
        fits.append(trainer)
        return types.SimpleNamespace(return_value={"text_to_video_R@10": 1.0}, metrics={}, checkpoint=None)

    monkeypatch.setattr(ray.train.torch.TorchTrainer, "fit", fit)
    monkeypatch.setenv("RAYMCN_RESULTS", str(tmp_path / "results"))
    return types.SimpleNamespace(cuda=cuda, fits=fits, cli=cli)


GPU_RUN = ["--set", "scale.use_gpu=true", "--set", "scale.num_workers=4", "--set", "data.batch_size=8"]


def test_the_driver_of_a_gpu_run_reads_gpu_memory_through_nvml_and_initialises_no_cuda(gpu_head, capsys):
    assert gpu_head.cli.main(["train", *GPU_RUN]) == 0
    assert len(gpu_head.fits) == 1  # the trainer was built and fit() was called
    assert gpu_head.cuda.initialising() == [], gpu_head.cuda.initialising()
    # the preflight read the least free GPU's memory (GPU 1's 41 GiB) through NVML
    out = capsys.readouterr().out
    assert "free memory of GPU 1, the least free of this machine's 4, read through NVML" in out, out


def test_the_driver_of_a_gpu_sweep_and_its_trials_drivers_initialise_no_cuda(gpu_head, monkeypatch, capsys):
    """``raymcn sweep``: config, inputs, preflight, the search; then, as each trial's driver runs
    it, a trial's plan and its trainer (Tune itself, which needs Ray, is left out)."""
    from raymcn.sweep import tuner

    trials: list = []

    def sweep(cfg, experiment_dir=None, console=None, inputs=None):
        from ray.train.v2.api.callback import UserCallback

        tuner.build_search(cfg)
        # what a Tune session would give the trial: its id, and the callback that reports to Tune
        monkeypatch.setattr(tuner.tune, "get_context", lambda: types.SimpleNamespace(get_trial_id=lambda: "t0001"))
        monkeypatch.setattr(tuner, "_epoch_report_callback", lambda: UserCallback)
        tuner.trial_fn({"schedule.stage_order": "AV_T", "optim.lr": 1e-3}, base=cfg.to_dict(),
                       experiment_dir=experiment_dir, inputs=inputs)
        trials.append(experiment_dir)
        raise KeyboardInterrupt  # ends the command here: the sweep's summary needs Tune's results

    monkeypatch.setattr(tuner, "run_sweep", sweep)
    assert gpu_head.cli.main(["sweep", *GPU_RUN]) == 130  # the embedded default's sweep
    assert trials and len(gpu_head.fits) == 1
    assert gpu_head.cuda.initialising() == [], gpu_head.cuda.initialising()
    assert "read through NVML" in capsys.readouterr().out


def test_a_head_without_the_nvidia_driver_leaves_the_check_to_the_workers(monkeypatch, capsys):
    from raymcn.train.preflight import checks
    from raymcn.train.preflight.gpus import visible_gpus

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([]))
    assert visible_gpus() == []
    from raymcn.cli import resolve_config

    import argparse
    args = argparse.Namespace(config=None, overrides=GPU_RUN[1::2], num_workers=None, init_from=None)
    assert checks._device_bytes(resolve_config(args)) == (None, "")


@pytest.mark.parametrize("spec, expected", [(None, [0, 1, 2, 3]), ("2,0", [2, 0]), ("1,7,2", [1]), ("", []),
                                            ("GPU-00000003", [3]), ("GPU-00000003,1", [3, 1])])
def test_cuda_visible_devices_selects_what_nvml_reports(monkeypatch, spec, expected):
    from raymcn.train.preflight import gpus

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(HEAD_GPUS))
    if spec is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", spec)
    assert [g.index for g in gpus.visible_gpus()] == expected


def test_the_doctors_node_probe_initialises_no_cuda(monkeypatch, tmp_path):
    """The probe runs in whatever Ray worker process is free, reserving no GPU: it reads the GPUs
    through nvidia-smi and the build's CUDA and NCCL versions, and must leave no context."""
    from raymcn.doctor.probe import Request, probe

    cuda = CudaRecorder(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build: the NCCL version is read too
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))  # ncclGetVersion: no context
    req = Request(shards_dir=str(tmp_path / "shards"), manifest="", sample=(), eval_file=str(tmp_path / "eval.pkl"),
                  eval_bytes=-1, word_vectors="", storage=str(tmp_path), token=str(tmp_path / "token"),
                  token_text="t", use_gpu=True)
    facts = probe(req)
    assert facts["cuda"] == {"cuda": "12.8", "nccl": "2.27.3"}
    assert cuda.initialising() == [], cuda.initialising()


def test_the_doctors_step_runs_in_a_process_of_its_own(monkeypatch):
    """``--step`` opens a CUDA context (and fills the allocator's cache) on the GPU it ran on; its
    Ray task is declared single-use, so the process ends with the step and no later task of that
    worker process keeps the memory."""
    import ray

    from raymcn import doctor
    from raymcn.doctor.verdicts import Row

    declared: list[dict] = []

    def remote(*fn, **options):  # ray.remote(f) or ray.remote(**options)(f)
        declared.append(options)

        def wrap(fn):
            return types.SimpleNamespace(options=lambda **kw: types.SimpleNamespace(remote=lambda *a: "ref"))
        return wrap(*fn) if fn else wrap

    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(doctor, "_get", lambda ref, timeout: "no answer")
    monkeypatch.setattr(doctor, "step_rows", lambda got, req, column, why="": [Row("one training step", False, why)])
    from raymcn.cli import preset_path
    from raymcn.config import load_config

    cfg = load_config(preset_path(), ["scale.use_gpu=true"])
    inputs = types.SimpleNamespace(eval_set="synthetic", eval_audio_frames=0, word_vectors="", shards_dir="")
    doctor._steps(cfg, None, inputs, {"node": None}, 1.0, {"node": "head"})
    assert declared == [{"max_calls": 1}]
