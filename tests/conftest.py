"""Shared fixtures: a private cache and results folder per session, and one Ray instance for the session."""

import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

# What the tests share with the benchmarks lives in the bench package (pytest's pythonpath puts the
# checkout's root on the path: see pyproject.toml); bench never imports the tests.
from bench import services
from bench.harness import read_jsonl as read_events
from bench.services import NODE_STORE, free_port

__all__ = ["NODE_STORE", "free_port", "read_events"]  # for the tests that import them from here

# ---- The tiers (docs/development.md, "Tests"): the one place their marker expressions live.
# `make test` runs the fast tier (`--tier fast`), CI the fast tier then the slow one, adding their
# times; `make test-soak` the rehearsals too long for CI's 90 minutes, `make test-full` all three.
# A test marked `multinode`, `launcher` or `soak` must be `slow` too, and a test that starts Ray
# must say so (`ray` or costlier): both checked below.
TIERS = {"fast": "not slow", "slow": "slow and not soak", "soak": "soak", "full": ""}
STARTS_RAY = ("ray", "slow", "multinode", "launcher", "soak")  # markers of the tests that may start Ray
ALWAYS_SLOW = ("multinode", "launcher", "soak")


def pytest_addoption(parser):
    parser.addoption("--tier", choices=sorted(TIERS), help="the tests of one tier: fast (make test), slow (the "
                     "rest CI runs: rehearsals, multinode, launcher), soak (make test-soak: the chaos soak, elastic "
                     "groups, the longest rehearsals, benchmark smokes) or full (make test-full); tests/conftest.py")
    parser.addoption("--each-test-time", action="store_true", help="a line as each test ends: its seconds and the "
                     "run's so far (CI's slow tier: a run its time limit stops still says where the time went)")


def pytest_configure(config):
    tier = config.getoption("--tier")
    if tier and config.option.markexpr:
        raise pytest.UsageError("give --tier or -m, not both")
    if tier:
        config.option.markexpr = TIERS[tier]
    if config.getoption("--each-test-time"):
        config.pluginmanager.register(EachTestTime(config), "each_test_time")


class EachTestTime:
    """``--each-test-time``: `` [12 min 5 s] 131 s tests/test_x.py::test_y passed`` as each test ends
    (setup, call and teardown together), written at once: JUnit's file exists only once pytest ends."""

    def __init__(self, config):
        self.config, self.start, self.seconds, self.outcome = config, time.time(), {}, {}

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if report.when == "call" or report.skipped:
            self.outcome[report.nodeid] = report.outcome
        if report.failed and report.when != "call":  # set-up or teardown: pytest's "error"
            self.outcome[report.nodeid] = "error"
        if report.when == "teardown":
            run = int(time.time() - self.start)
            self.config.pluginmanager.get_plugin("terminalreporter").write_line(
                f" [{run // 60} min {run % 60} s] {self.seconds.pop(report.nodeid):.0f} s {report.nodeid} "
                f"{self.outcome.pop(report.nodeid, report.outcome)}")


def pytest_collection_modifyitems(config, items):
    unmarked = [i.nodeid for i in items if any(i.get_closest_marker(m) for m in ALWAYS_SLOW)
                and not i.get_closest_marker("slow")]
    if unmarked:
        raise pytest.UsageError(f"marked {' or '.join(ALWAYS_SLOW)} but not slow (the fast tier would run them): "
                                + ", ".join(unmarked))


def ray_sessions_under(root: str) -> list[str]:
    """The Ray sessions started with ``RAY_TMPDIR=root`` (Ray makes ``root/ray/session_<date>_<pid>``)."""
    return sorted(p.name for p in Path(root, "ray").glob("session_2*"))


@pytest.fixture(autouse=True)
def _ray_only_where_marked(request, monkeypatch):
    """A test not marked as starting Ray (:data:`STARTS_RAY`) gets a Ray temp folder of its own
    (``RAY_TMPDIR``, read by every process it starts): a Ray session found there afterwards means
    the test started Ray, in its process or in a child, and it fails, naming the marker it needs.
    Such a test may not ask for the session's instance (``ray_local``) either."""
    if any(request.node.get_closest_marker(m) for m in STARTS_RAY):
        yield
        return
    if "ray_local" in request.fixturenames:
        pytest.fail(f"{request.node.nodeid} uses ray_local: mark it `ray` (or costlier: {', '.join(STARTS_RAY[1:])})")
    private = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live under it
    monkeypatch.setenv("RAY_TMPDIR", private)
    try:
        yield
    finally:
        started = ray_sessions_under(private)
        if started and "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()
        shutil.rmtree(private, ignore_errors=True)
    if started:
        pytest.fail(f"{request.node.nodeid} started Ray ({', '.join(started)}) but is not marked as a test that "
                    f"does: mark it `ray` (or costlier: {', '.join(STARTS_RAY[1:])})")


@pytest.fixture(scope="session", autouse=True)
def _versions_in_the_junit_file(record_testsuite_property):
    """The Python and torch the tier ran on, as properties of its JUnit file (``--junitxml``):
    tools/test_durations.py reads them, so the suite's figures say what each tier ran on."""
    import platform

    import torch

    record_testsuite_property("python", platform.python_version())
    record_testsuite_property("torch", torch.__version__)


# Tiny synthetic settings shared by the training tests, so the corpus is generated once per session.
TINY = ["data.synthetic_videos=64", "data.synthetic_eval_clips=64", "data.batch_size=16", "schedule.epochs=3"]


@pytest.fixture(scope="session", autouse=True)
def _private_dirs(tmp_path_factory):
    """Point the synthetic-corpus cache and run storage away from the user's home, and give the
    processes the tests start (a script run by its path, a Ray worker) the checkout's root on their
    path, as pyproject.toml's ``pythonpath`` gives it to pytest: they import ``bench`` too."""
    os.environ.setdefault("RAYMCN_CACHE", str(tmp_path_factory.mktemp("cache")))
    os.environ.setdefault("RAYMCN_RESULTS", str(tmp_path_factory.mktemp("results")))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    yield


_SHARED_RAY: dict = {}  # the session's one local Ray instance while it runs: {"ctx": ..., "env": ...}


@pytest.fixture(scope="module")
def ray_local():
    """The session's small local Ray instance (started on first use, kept for the next module,
    shut down at the end of the session or by a module that needs a cluster of its own, and then
    started again for the next). Pinned to itself as ``raymcn`` pins the instances it starts (its
    dashboard's address given to its processes and to this one), so a second instance on the
    machine (a rehearsal's, another user's) changes nothing."""
    ray = pytest.importorskip("ray")
    if not (ray.is_initialized() and _SHARED_RAY):
        stop_shared_ray()
        if ray.is_initialized():  # e.g. Ray Data started one on its own in a local-mode test
            ray.shutdown()
        _SHARED_RAY.update(_start_shared_ray(ray))
    yield _SHARED_RAY["ctx"]


def _start_shared_ray(ray) -> dict:
    from raymcn.train.on_ray.cluster import local_instance_env

    # Ray workers must import functions defined in test modules (pickled by reference).
    tests_dir = os.path.dirname(__file__)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
    port = free_port()
    env = local_instance_env(port)
    added = {k: v for k, v in env.items() if k not in os.environ or k == "RAY_API_SERVER_ADDRESS"}
    os.environ.update(added)
    # address="local": a new instance even where a `ray start` cluster or RAY_ADDRESS exists here.
    ctx = ray.init(address="local", num_cpus=2, object_store_memory=150 * 1024**2, include_dashboard=True,
                   dashboard_host="127.0.0.1", dashboard_port=port, runtime_env={"env_vars": env},
                   log_to_driver=False, configure_logging=False)
    return {"ctx": ctx, "env": added}


def stop_shared_ray() -> None:
    """Shut the session's Ray instance down (a module that starts a cluster of its own calls it;
    the next module's ``ray_local`` starts it again)."""
    if not _SHARED_RAY:
        return
    import ray

    ray.shutdown()
    for key in _SHARED_RAY["env"]:
        os.environ.pop(key, None)
    _SHARED_RAY.clear()


@pytest.fixture(scope="session", autouse=True)
def _ray_stopped_at_the_end():
    yield
    stop_shared_ray()


def event_log_callback(path):
    """A Ray Train callback (it runs in the controller, on this machine) that appends to the
    JSON-lines file ``path`` every reported epoch (with its stage), every mid-epoch checkpoint
    (``mid_epoch_step``) and every worker-group failure, so a test can tell what the run went
    through: restarts, retries, epochs reported twice."""
    import json

    from ray.train.v2.api.callback import UserCallback

    class EventLog(UserCallback):
        def _write(self, row: dict) -> None:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

        def after_report(self, run_context, metrics, checkpoint):
            m = metrics[0]  # rank 0's
            if m.get("mid_epoch"):  # a checkpoint inside an epoch: no "epoch" key, so epoch filters skip it
                self._write({"mid_epoch_step": int(m["global_step"]), "time": time.time()})
                return
            self._write({"epoch": int(m["epoch"]), "stage": int(m.get("stage", 1)), "workers": int(m["workers"]),
                         "videos_read": int(m.get("videos_read", -1)), "time": time.time()})

        def after_exception(self, run_context, worker_exceptions):
            self._write({"failure": sorted(int(r) for r in worker_exceptions),
                         "errors": sorted({type(e).__name__ for e in worker_exceptions.values()}),
                         "time": time.time()})

    return EventLog()


def objective_for(cfg, device="cpu", comm=None):
    """The run's objective for ``cfg`` as the run assembly builds it (a one-step plan, no shards)."""
    from raymcn.train.build import build_objective
    from raymcn.train.run_plan import make_plan

    return build_objective(cfg, make_plan(cfg, videos=cfg.data.batch_size), device, comm)


# ---- Multi-node helpers (Ray's multi-node test cluster: tests/test_multinode.py, tests/test_elastic.py)


@contextlib.contextmanager
def multinode_cluster(*nodes: dict):
    """``bench.services.multinode_cluster`` whose Ray workers can import the test modules (the
    session's own instance shut down first)."""
    stop_shared_ray()
    tests_dir = os.path.dirname(__file__)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
    with services.multinode_cluster(*nodes) as c:
        yield c


@pytest.fixture
def no_ray(monkeypatch):
    """A command that would start Ray fails the test: the refusals under test come before Ray."""
    from raymcn import cli
    from raymcn.train.preflight import checks as preflight

    def refuse(*_):
        raise AssertionError("Ray was started before the configuration was checked")

    monkeypatch.setattr(cli, "ray_session", refuse)
    monkeypatch.setattr(preflight, "_device_bytes", lambda cfg: (64 << 30, ""))  # a 64 GiB device


def train_worker_nodes() -> dict[str, str]:
    """actor id -> node id of every live Ray Train worker."""
    from ray.util.state import list_actors

    alive = list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    return {a.actor_id: a.node_id for a in alive}


def wait_for(what: str, predicate, timeout: float = 300.0, every: float = 0.5):
    """The first truthy value of ``predicate()``; an AssertionError naming ``what`` after ``timeout``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def in_background(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    """Run ``fn`` in a daemon thread; the dict gets ``value`` or ``error`` when it ends."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


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


def read_trace(where) -> dict[int, list[dict]]:
    """rank -> the steps it traced (``RAYMCN_TRACE``) in the order it ran them; a replayed step
    appears again."""
    from pathlib import Path

    return {int(p.stem[4:]): read_events(p) for p in Path(where).glob("rank*.jsonl")}


LOSS_TERMS = ("total_loss", "contrastive_loss", "cluster_loss", "recon_loss")


def steps_as_run(where) -> dict[int, dict]:
    """Global step -> what the run's last attempt at it did over all its ranks: ``world``, the
    clips' ``keys`` in rank order, the ``inputs`` sums added up and the loss terms averaged (a
    rank's traced term is its share's part, scaled so that the ranks' mean is the batch's value).
    An attempt of ``world`` ranks is identified by rank 0's row: the data of a step is a function of
    (seed, epoch, step, rank, world), so every attempt of that world read the same clips."""
    ranks = read_trace(where)
    out = {}
    for step, row in {r["step"]: r for r in ranks[0]}.items():
        world = row["world"]
        rows = [row] + [next(x for x in reversed(ranks[r]) if x["step"] == step and x["world"] == world)
                        for r in range(1, world)]
        out[step] = {"world": world, "keys": [k for x in rows for k in x["keys"]],
                     "inputs": {k: sum(x["inputs"][k] for x in rows) for k in row["inputs"]},
                     **{t: sum(x[t] for x in rows) / world for t in LOSS_TERMS}}
    return out


# ---- Configs, runs, corpora and command output shared by the tests

# A tiny MCN: small enough for exactness checks that run many steps.
TINY_MODEL = {"model.embed_dim": 32, "model.audio_channels": [4, 4, 8, 8, 16], "model.recon_hidden": 16,
              "model.video_dim": 24, "model.word_dim": 12, "data.audio_frames": 160}


def config(*bases: dict, **overrides):
    """``Config()`` with the dotted-key settings of ``bases`` (a test's own defaults), then
    ``overrides`` (the case's), applied."""
    from raymcn.config import Config

    merged = {}
    for base in bases:
        merged.update(base)
    return Config().replace({**merged, **overrides})


def preset(*overrides):
    """The embedded default preset with ``overrides``: dotted ``key=value`` strings, or one dict."""
    from raymcn.cli import preset_path
    from raymcn.config import load_config

    return load_config(preset_path(), overrides[0] if len(overrides) == 1 and isinstance(overrides[0], dict)
                       else list(overrides))


def run_of(cfg, model, *, objective=None, state=None, comm=None, hooks=None):
    """A :class:`raymcn.train.run.Run` from a test's own model (a stand-in for MCN, a DDP wrapper),
    as ``raymcn.train.build.assemble`` would hold it: the config's one-step plan (the plan
    :func:`objective_for` builds the objective from), Adam, the LR curve over 100 steps."""
    import torch

    from raymcn.collectives import Collectives
    from raymcn.train.optim import build_optimizer, build_scheduler
    from raymcn.train.run import Hooks, LoopState, Run
    from raymcn.train.run_plan import make_plan

    optimizer = build_optimizer(model, cfg)
    return Run(cfg=cfg, plan=make_plan(cfg, videos=cfg.data.batch_size), comm=comm or Collectives(),
               device=torch.device("cpu"), model=model, net=getattr(model, "module", model), optimizer=optimizer,
               scheduler=build_scheduler(optimizer, cfg, 100), objective=objective or objective_for(cfg, comm=comm),
               state=state or LoopState(), hooks=hooks or Hooks())


@pytest.fixture(scope="module")
def corpus(request, tmp_path_factory):
    """The synthetic corpus of the test module's ``SETTINGS`` (``SynthSettings``), written once per module."""
    from raymcn.data import synthetic

    return synthetic.write_corpus(tmp_path_factory.mktemp("corpus"), request.module.SETTINGS)


def shards_of(corpus, out, **kw) -> dict:
    """Shards of ``corpus`` written to ``out`` (``shards_from_layout``, quiet); returns the manifest."""
    from raymcn.data.write import shards

    kw = {"progress": False, "log": lambda msg: None, **kw}
    return shards.shards_from_layout(corpus.features_root, corpus.audio_root, kw.pop("captions", corpus.captions),
                                     corpus.video_csv, corpus.word_vectors, out, **kw)


def last_json(text: str) -> dict:
    """The JSON object a command printed last (``--json``): its output's last line that starts with ``{``."""
    import json

    return json.loads(next(line for line in reversed(text.strip().splitlines()) if line.startswith("{")))


@pytest.fixture
def checkout(tmp_path):
    """A git checkout of raymcn with an uncommitted change (``tests/git_checkout.py``)."""
    from git_checkout import make_checkout

    return make_checkout(tmp_path / "checkout")
