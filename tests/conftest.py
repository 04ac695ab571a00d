"""Shared fixtures: a private cache and results folder per session, and one Ray instance per module."""

import os

import pytest

# Tiny synthetic settings shared by the training tests, so the corpus is generated once per session.
TINY = ["data.synthetic_videos=64", "data.synthetic_eval_clips=64", "data.batch_size=16", "schedule.epochs=3"]


@pytest.fixture(scope="session", autouse=True)
def _private_dirs(tmp_path_factory):
    """Point the synthetic-corpus cache and run storage away from the user's home."""
    os.environ.setdefault("RAYMCN_CACHE", str(tmp_path_factory.mktemp("cache")))
    os.environ.setdefault("RAYMCN_RESULTS", str(tmp_path_factory.mktemp("results")))
    yield


@pytest.fixture(scope="module")
def ray_local():
    """One small local Ray instance for a test module; always shut down."""
    ray = pytest.importorskip("ray")
    # Ray workers must import functions defined in test modules (pickled by reference).
    tests_dir = os.path.dirname(__file__)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
    if ray.is_initialized():  # e.g. Ray Data started one on its own in a local-mode test
        ray.shutdown()
    # address="local": a new instance even where a `ray start` cluster or RAY_ADDRESS exists here.
    ctx = ray.init(address="local", num_cpus=2, object_store_memory=150 * 1024**2, include_dashboard=False,
                   log_to_driver=False, configure_logging=False)
    yield ctx
    ray.shutdown()


def event_log_callback(path):
    """A Ray Train callback (it runs in the controller, on this machine) that appends to the
    JSON-lines file ``path`` every reported epoch (with its stage) and every worker-group failure,
    so a test can tell what the run went through: restarts, retries, epochs reported twice."""
    import json

    from ray.train.v2.api.callback import UserCallback

    class EventLog(UserCallback):
        def _write(self, row: dict) -> None:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

        def after_report(self, run_context, metrics, checkpoint):
            self._write({"epoch": int(metrics[0]["epoch"]), "stage": int(metrics[0].get("stage", 1))})

        def after_exception(self, run_context, worker_exceptions):
            self._write({"failure": sorted(int(r) for r in worker_exceptions),
                         "errors": sorted({type(e).__name__ for e in worker_exceptions.values()})})

    return EventLog()


def read_events(path) -> list[dict]:
    import json
    from pathlib import Path

    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def objective_for(cfg, device="cpu", comm=None):
    """The run's objective for ``cfg`` as the run assembly builds it (a one-step plan, no shards)."""
    from raymcn.train.build import build_objective
    from raymcn.train.plan import make_plan

    return build_objective(cfg, make_plan(cfg, videos=cfg.data.batch_size), device, comm)


def linear_mcn(in_dim: int, dim: int, recon: bool = True, dropout: float = 0.0, seed: int = 0):
    """A stand-in for MCN with its forward contract, small enough for many exactness steps: one
    Linear encoder per modality from ``batch[m]`` (b, in_dim) to (b, dim) and, with ``recon``, one
    Linear head per modality reconstructing its input (a fixed target, as MCN's video head).
    ``dropout`` puts a Dropout before each encoder (a forward that draws random numbers).
    Parameter names start with ``layers.<modality>`` or ``layers.recon_<modality>``."""
    import torch

    class LinearMCN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)  # identical replicas on every rank, as DDP guarantees
            mods = ("video", "audio", "text")
            self.layers = torch.nn.ModuleDict({m: torch.nn.Linear(in_dim, dim) for m in mods})
            if recon:
                self.layers.update({f"recon_{m}": torch.nn.Linear(dim, in_dim) for m in mods})
            self.drop = torch.nn.Dropout(dropout)

        def forward(self, batch, active):
            out = {}
            for m in sorted(active):
                out[m] = self.layers[m](self.drop(batch[m]))
                if recon:
                    out[f"recon_{m}"] = (self.layers[f"recon_{m}"](out[m]), batch[m])
            return out

    return LinearMCN()
