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
