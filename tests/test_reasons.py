"""The reason travels: what the user sees when something fails names its cause (the exception's
class and the first line of its message, the address that does not answer), never a guess.

Each path below is fed a failure and its output read: the doctor's step task, nvidia-smi, NVML,
NCCL's version, the resource-wait watch, the drain's registration, a Ray that does not start, a
Ray instance that does not answer. One static check keeps every broad ``except`` in raymcn/ honest.
"""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from cuda_stand_in import fake_nvml

from raymcn.cli import preset_path
from raymcn.config import ConfigError, RayUnavailable, load_config, reason

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "raymcn"
# raymcn's functions that put an exception's class and message into words (``_failed``: a run's end)
NAMING = {"reason", "_cause", "_failed"}
HANDING_ON = {"put", "put_nowait", "set_exception"}  # to the thread that waits on it, which raises it


# --- every broad except ----------------------------------------------------------------------------------------
def _broad(handler: ast.ExceptHandler) -> bool:
    caught = handler.type
    names = caught.elts if isinstance(caught, ast.Tuple) else [caught] if caught is not None else []
    return caught is None or any(isinstance(n, ast.Name) and n.id in ("Exception", "BaseException") for n in names)


def hidden_reasons(source: str, where: str) -> list[str]:
    """The broad handlers of ``source`` that neither re-raise, hand their exception on (stored, for
    the thread that waits on it to raise) nor put it into words (:data:`NAMING`); a handler inside
    another handler (a second failure while the first is being reported or cleaned up) is the
    outer one's business."""
    found = []

    def visit(node: ast.AST, inside_handler: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ExceptHandler):
                if _broad(child) and not inside_handler and not _keeps_reason(child):
                    found.append(f"{where}:{child.lineno}")
                visit(child, True)
            else:
                visit(child, inside_handler)

    visit(ast.parse(source), False)
    return found


def _keeps_reason(handler: ast.ExceptHandler) -> bool:
    for node in ast.walk(handler):
        if isinstance(node, ast.Raise):
            return True
        if not handler.name:
            continue
        if isinstance(node, ast.Call) and any(isinstance(a, ast.Name) and a.id == handler.name for a in node.args):
            called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if called in NAMING or called in HANDING_ON:
                return True
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id == handler.name:
            return True
        if isinstance(node, ast.JoinedStr) and _names_class_and_message(node, handler.name):
            return True
    return False


def _names_class_and_message(text: ast.JoinedStr, name: str) -> bool:
    """An f-string holding ``{type(e).__name__}`` and ``{e}`` (for a module below config, which
    ``reason`` lives in)."""
    shown = [ast.unparse(v.value) for v in text.values if isinstance(v, ast.FormattedValue)]
    return f"type({name}).__name__" in shown and name in shown


def test_every_broad_except_in_raymcn_reraises_or_names_its_exception():
    hidden = [h for path in sorted(PACKAGE.rglob("*.py"))
              for h in hidden_reasons(path.read_text(), str(path.relative_to(ROOT)))]
    assert hidden == [], hidden


def test_the_broad_except_check_can_fail():
    swallowed = "try:\n    f()\nexcept Exception:\n    pass\n"
    class_only = "try:\n    f()\nexcept Exception as e:\n    say(f'{type(e).__name__}')\n"
    assert hidden_reasons(swallowed, "x") == ["x:3"] and hidden_reasons(class_only, "x") == ["x:3"]
    named = "try:\n    f()\nexcept Exception as e:\n    say(reason(e))\n"
    reraised = "try:\n    f()\nexcept BaseException:\n    undo()\n    raise\n"
    handed_on = "try:\n    f()\nexcept BaseException as e:\n    box.error = e\n"
    formatted = "try:\n    f()\nexcept Exception as e:\n    raise_later(f'{type(e).__name__}: {e}')\n"
    assert hidden_reasons(formatted, "x") == []
    assert hidden_reasons(named, "x") == hidden_reasons(reraised, "x") == hidden_reasons(handed_on, "x") == []


def test_a_reason_is_the_class_and_first_line_and_a_ray_task_error_is_named_by_its_cause():
    from ray.exceptions import RayTaskError

    cause = RuntimeError("Invalid device argument : did you call init?\nCUDA call failed lazily")
    wrapped = RayTaskError("step_probe", "Traceback ...", cause).as_instanceof_cause()
    assert type(wrapped).__name__ == "RayTaskError(RuntimeError)"
    assert reason(wrapped) == "RuntimeError: Invalid device argument : did you call init?"
    assert reason(KeyError()) == "KeyError"


# --- the doctor ------------------------------------------------------------------------------------------------
def _step_rows(monkeypatch, get) -> str:
    """The doctor's table for one node whose ``--step`` task answers with ``get(ref, timeout)``."""
    import ray

    from raymcn.doctor import checkup
    from raymcn.doctor.probe import Request

    def remote(*fn, **options):
        wrap = lambda f: types.SimpleNamespace(options=lambda **kw: types.SimpleNamespace(remote=lambda *a: "ref"))  # noqa: E731
        return wrap(*fn) if fn else wrap

    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "cancel", lambda ref, force: None)
    cfg = load_config(preset_path(), ["scale.use_gpu=true"])
    inputs = types.SimpleNamespace(eval_set="synthetic", eval_audio_frames=0, word_vectors="", shards_dir="")
    req = Request(shards_dir="", manifest="", sample=(), eval_file="", eval_bytes=-1, word_vectors="", storage="",
                  token="", token_text="", use_gpu=True, estimate_bytes=1)
    steps = checkup._steps(cfg, req, inputs, {"node": None}, 600.0, {"node": "gpu-1 (head)"})
    report = {"columns": {"node": "gpu-1 (head)"}, "rows": {"node": steps["node"][0]}, "estimate": None}
    return checkup.render(report, use_gpu=True)


def test_a_step_task_that_raised_is_named_by_its_error_in_the_doctors_table(monkeypatch):
    from ray.exceptions import RayTaskError

    def get(ref, timeout):
        raise RayTaskError("step_probe", "tb", RuntimeError("Invalid device argument : did you call init?"),
                           ).as_instanceof_cause()

    table = _step_rows(monkeypatch, get)
    assert "the step failed: RuntimeError: Invalid device argument : did you call init?" in table, table
    assert "no answer" not in table


def test_only_a_step_task_that_did_not_end_is_no_answer(monkeypatch):
    from ray.exceptions import GetTimeoutError

    def get(ref, timeout):
        raise GetTimeoutError("timed out")

    assert "waited for a free GPU and its step; no answer within 600 s" in _step_rows(monkeypatch, get)


def test_a_failing_nvidia_smi_is_named_with_its_own_words(monkeypatch, tmp_path):
    from raymcn.doctor.probe import _gpus
    from raymcn.doctor.verdicts import _hardware_rows

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'Failed to initialize NVML: Driver/library version mismatch'\nexit 18\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    gpus = _gpus()
    assert gpus == [{"error": "nvidia-smi exited with 18: Failed to initialize NVML: Driver/library version mismatch"}]
    facts = {"gpus": gpus, "cuda": {"cuda": "12.8", "nccl": "2.27.3", "nccl_error": ""}, "cpus": 16,
             "spill_free": 10**12}
    req = types.SimpleNamespace(use_gpu=False, estimate_bytes=1, cpus_per_worker=1.0)
    row = _hardware_rows(facts, req, "gpu-1", {})[0]
    assert row.ok is False and "Driver/library version mismatch" in row.fix, row  # also on a CPU run: it is broken


def test_an_unreadable_nccl_version_is_named(monkeypatch):
    from raymcn.doctor.probe import _cuda_build
    from raymcn.doctor.verdicts import _hardware_rows

    monkeypatch.setattr(torch.version, "cuda", "12.8")

    def version():
        raise RuntimeError("NCCL library not found: libnccl.so.2")

    monkeypatch.setattr(torch.cuda.nccl, "version", version)
    cuda = _cuda_build()
    assert cuda == {"cuda": "12.8", "nccl": "", "nccl_error": "RuntimeError: NCCL library not found: libnccl.so.2"}
    facts = {"gpus": [], "cuda": cuda, "cpus": 16, "spill_free": 10**12}
    req = types.SimpleNamespace(use_gpu=True, estimate_bytes=1, cpus_per_worker=1.0)
    row = next(r for r in _hardware_rows(facts, req, "gpu-1", {}) if r.check == "CUDA and NCCL in torch")
    assert row.ok is False and "libnccl.so.2" in row.fix and "libnccl.so.2" in row.detail, row


def test_nvml_that_fails_is_not_no_gpu_and_the_preflight_says_why(monkeypatch):
    from raymcn.train.preflight import checks, gpus

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([(1, 2)], init_error="NVMLError_LibRmVersionMismatch"))
    with pytest.raises(gpus.GpuQueryError, match="NVMLError_LibRmVersionMismatch: RM has detected"):
        gpus.visible_gpus()
    notes: list[str] = []
    cfg = load_config(preset_path(), ["scale.use_gpu=true", "scale.num_workers=1"])
    assert checks._memory_problems(cfg, None, notes) == []  # each worker checks its own GPU at its start
    assert "NVMLError_LibRmVersionMismatch" in notes[0] and "sees no GPU" not in notes[0], notes


def test_the_doctor_from_a_source_checkout_names_its_version(monkeypatch):
    import importlib.metadata

    from raymcn.doctor.probe import versions

    def version(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert versions()["raymcn"] == "0.1.0 (source checkout, not installed)"


# --- on the Ray side -------------------------------------------------------------------------------------------
def test_a_resource_watch_that_cannot_look_says_so_once(monkeypatch):
    from raymcn.train.on_ray import waits

    def look(limit_s, told):
        raise ConnectionError("Failed to connect to the API server at http://127.0.0.1:8265")

    monkeypatch.setattr(waits, "_look", look)
    said: list[str] = []
    with waits.watched(1.0, said.append, every_s=0.05):
        time.sleep(0.5)
    assert len(said) == 1, said
    assert "ConnectionError: Failed to connect to the API server" in said[0]


def test_a_drain_checkpoint_that_was_not_registered_is_named(monkeypatch):
    import ray.train

    from raymcn.train.on_ray.worker import Reports

    def registered(**kwargs):
        raise TimeoutError("the controller did not answer")

    monkeypatch.setattr(ray.train, "get_all_reported_checkpoints", registered)
    said: list[str] = []
    reports = Reports.__new__(Reports)  # the parts the drain's wait uses: a rank's printer, the run's policy
    reports.out, reports.rank = types.SimpleNamespace(say=said.append), 0
    reports.mark_drain_checkpoint(types.SimpleNamespace(state=types.SimpleNamespace(step=7),
                                                        checkpoints=types.SimpleNamespace()))
    assert said and "TimeoutError: the controller did not answer" in said[0], said


def test_ray_that_does_not_start_is_named_as_such_not_as_a_failed_run(monkeypatch, capsys, tmp_path):
    from raymcn.cli import main
    from raymcn.train.on_ray import cluster

    def init(**kwargs):
        raise RuntimeError("Failed to start the GCS: port 6379 is taken")

    monkeypatch.setenv("RAY_ADDRESS", "local")
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.ray, "init", init)
    assert main(["train", "--set", f"run.storage_path={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "nothing ran: a local Ray instance did not start" in err, err
    assert "RuntimeError: Failed to start the GCS: port 6379 is taken" in err and "restarts" not in err, err


@pytest.mark.parametrize("env, running, recorded, expected", [
    ({"RAY_ADDRESS": "10.0.0.1:6379"}, [], None, ("10.0.0.1:6379", "given by RAY_ADDRESS")),
    ({"RAY_ADDRESS": "local"}, ["10.0.0.9:6379"], None, (None, "RAY_ADDRESS=local: a new local instance")),
    ({}, ["10.0.0.2:6379"], None, ("10.0.0.2:6379", "the Ray instance running on this machine")),
    ({}, ["10.0.0.2:6379", "10.0.0.3:6379"], "10.0.0.3:6379",
     ("10.0.0.3:6379", "the last `ray start` of the 2 Ray instances running on this machine")),
    ({}, [], "10.0.0.4:6379", (None, "no Ray instance runs on this machine")),
])
def test_the_instance_a_command_connects_to_and_why(monkeypatch, env, running, recorded, expected):
    from raymcn.train.on_ray import cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(cluster, "running_instances", lambda: running)
    monkeypatch.setattr(cluster, "recorded_instance", lambda: recorded)
    assert cluster.chosen_instance(None) == expected


def test_the_instances_of_this_machine_are_found_by_their_raylets_and_ray_starts_record(tmp_path, monkeypatch):
    from raymcn.train.on_ray import cluster

    raylet = subprocess.Popen(["bash", "-c", f"exec -a {tmp_path}/raylet {sys.executable} -c 'import time; "
                               "time.sleep(60)' --gcs-address=10.9.9.9:6379"])
    try:
        deadline = time.monotonic() + 20
        while "10.9.9.9:6379" not in cluster.running_instances():
            assert time.monotonic() < deadline, cluster.running_instances()
            time.sleep(0.1)
    finally:
        raylet.kill()
        raylet.wait()
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert cluster.recorded_instance() is None
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.5:6379\n")
    assert cluster.recorded_instance() == "10.0.0.5:6379"


def test_several_instances_and_none_recorded_ask_which(monkeypatch):
    from raymcn.train.on_ray import cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "running_instances", lambda: ["10.0.0.2:6379", "10.0.0.3:6379"])
    monkeypatch.setattr(cluster, "recorded_instance", lambda: None)
    with pytest.raises(ConfigError, match="several Ray instances"):
        cluster.chosen_instance(None)


@pytest.fixture
def silent_gcs():
    """host:port of a listener that accepts connections and never answers (a hung GCS)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for c in held:
        c.close()
    server.close()


def test_a_gcs_that_does_not_answer_is_named_then_given_up(silent_gcs):
    from raymcn.train.on_ray import cluster

    said: list[str] = []
    started = time.monotonic()
    with pytest.raises(RayUnavailable, match=f"the Ray instance at {silent_gcs} .* did not answer within 1 s"):
        cluster.wait_for_gcs(silent_gcs, "given by RAY_ADDRESS", said.append, named_after_s=0.5, limit_s=1.0)
    assert 1.0 <= time.monotonic() - started < 10
    assert len(said) == 1 and f"no answer from {silent_gcs}" in said[0] and "ray stop" in said[0], said


def test_a_gcs_that_answers_is_waited_for_no_longer():
    import grpc
    from concurrent.futures import ThreadPoolExecutor

    from raymcn.train.on_ray import cluster

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        said: list[str] = []
        cluster.wait_for_gcs(f"127.0.0.1:{port}", "given by --address", said.append, named_after_s=5, limit_s=10)
        assert said == []
    finally:
        server.stop(None)


@pytest.mark.slow
def test_the_main_command_beside_a_ray_instance_that_does_not_answer(silent_gcs, tmp_path):
    """`python sweep.py` (the README's main command) with RAY_ADDRESS at a GCS that never answers:
    the address and why it was chosen first, within 60 s the advice, and a non-zero exit within the
    documented bound (cluster.CONNECT_LIMIT_S after the connection began), nothing left running."""
    from raymcn.train.on_ray.cluster import CONNECT_LIMIT_S, CONNECT_NAMED_AFTER_S

    env = {**os.environ, "RAY_ADDRESS": silent_gcs, "RAYMCN_RESULTS": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "sweep.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    for line in proc.stdout:
        lines.append((time.monotonic(), line.rstrip()))
    proc.wait(timeout=30)
    text = "\n".join(line for _, line in lines)
    connecting = next(t for t, line in lines if line == f"Ray: connecting to the instance at {silent_gcs} "
                      "(given by RAY_ADDRESS)")
    named = next(t for t, line in lines if line.startswith(f"Ray: no answer from {silent_gcs}"))
    assert CONNECT_NAMED_AFTER_S - 1 <= named - connecting <= 60, text
    assert "`ray stop`" in text and "RAY_ADDRESS=local" in text and "--address" in text
    assert proc.returncode == 1, text
    assert lines[-1][0] - connecting <= CONNECT_LIMIT_S + 15, text
    assert f"nothing ran: the Ray instance at {silent_gcs} (given by RAY_ADDRESS) did not answer" in text
