"""The reason travels: what the user sees when something fails names its cause (the exception's
class and the first line of its message, the address that does not answer), never a guess.

Each path below is fed a failure and its output read: the doctor's step task, nvidia-smi, NVML,
NCCL's version, the resource-wait watch, the drain's registration, a Ray that does not start, a
Ray instance that does not answer. One static check keeps every broad ``except`` in raymcn/ honest.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
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


def _fake_nvidia_smi(tmp_path, monkeypatch, csv: str) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat <<'EOF'\n{csv}\nEOF\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_memory_nvidia_smi_reports_as_n_a_is_unknown_not_a_crash(monkeypatch, tmp_path):
    """Under MIG (and on some drivers) nvidia-smi prints "[N/A]" for the memory: the probe, which
    never raises, keeps the GPU with its memory unknown, and the doctor judges no memory row by it."""
    from raymcn.doctor.probe import _gpus
    from raymcn.doctor.verdicts import _hardware_rows

    _fake_nvidia_smi(tmp_path, monkeypatch, "NVIDIA A100-SXM4-40GB, 40960, 40000, 550.54\n"
                                            "NVIDIA A100-SXM4-40GB MIG 3g.20gb, [N/A], [N/A], 550.54")
    gpus = _gpus()
    assert gpus == [{"name": "NVIDIA A100-SXM4-40GB", "total": 40960 << 20, "free": 40000 << 20, "driver": "550.54"},
                    {"name": "NVIDIA A100-SXM4-40GB MIG 3g.20gb", "total": None, "free": None, "driver": "550.54"}]
    facts = {"gpus": gpus, "cuda": {"cuda": "12.8", "nccl": "2.27.3", "nccl_error": ""}, "cpus": 16,
             "spill_free": 10**12}
    req = types.SimpleNamespace(use_gpu=True, estimate_bytes=2**30, cpus_per_worker=1.0)
    rows = {r.check: r for r in _hardware_rows(facts, req, "gpu-1", {})}
    assert rows["GPUs"].ok is True
    memory = rows["GPU memory free >= estimate"]
    assert memory.ok is None and "not reported by nvidia-smi for 1 of 2 GPUs" in memory.detail, memory


def test_a_line_of_nvidia_smi_that_is_not_four_fields_is_named(monkeypatch, tmp_path):
    from raymcn.doctor.probe import _gpus

    _fake_nvidia_smi(tmp_path, monkeypatch, "NVIDIA H200, 143771, 143000\nNVIDIA H200, 143771, 143000, 570.1")
    gpus = _gpus()
    assert gpus[0] == {"error": "nvidia-smi printed a line that is not name, memory.total, memory.free, driver: "
                                "'NVIDIA H200, 143771, 143000'"}
    assert gpus[1]["free"] == 143000 << 20


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
    row = next(r for r in _hardware_rows(facts, req, "gpu-1", {}) if r.check == "torch uses the GPUs")
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


def _drain_wait(monkeypatch, registered) -> tuple[list[str], list[tuple]]:
    """What a rank says, and marks, after its drain checkpoint at global step 7 when Ray's
    ``get_all_reported_checkpoints`` is ``registered``."""
    import ray.train

    from raymcn.train.on_ray import worker

    monkeypatch.setattr(ray.train, "get_all_reported_checkpoints", registered)
    marked: list[tuple] = []
    monkeypatch.setattr(worker, "mark_registered", lambda step, rank: marked.append((step, rank)))
    said: list[str] = []
    reports = worker.Reports.__new__(worker.Reports)  # the parts the drain's wait uses: a rank's printer
    reports.out, reports.rank = types.SimpleNamespace(say=said.append), 1
    reports.mark_drain_checkpoint(types.SimpleNamespace(state=types.SimpleNamespace(step=7),
                                                        checkpoints=types.SimpleNamespace()))
    return said, marked


def _reported(*steps: int) -> list:
    return [types.SimpleNamespace(checkpoint=None, metrics={"global_step": float(s)}) for s in steps]


def test_a_drain_checkpoint_whose_registration_cannot_be_asked_is_named_by_its_error(monkeypatch):
    def registered(**kwargs):
        raise ConnectionError("the controller did not answer")

    said, marked = _drain_wait(monkeypatch, registered)
    assert marked == [] and len(said) == 1, said
    assert "could not learn whether the drain's checkpoint is registered (ConnectionError: the controller did " \
           "not answer)" in said[0] and "within" not in said[0], said


def test_a_drain_checkpoint_not_registered_at_the_timeout_is_not_marked(monkeypatch):
    """At its timeout Ray returns the checkpoints registered so far, without an error: only one at
    the drain's step lets the server go before the deadline."""
    said, marked = _drain_wait(monkeypatch, lambda **kwargs: _reported(3, 5))
    assert marked == [], "a checkpoint that was never registered must not let the server go"
    assert said == ["warning: the drain's checkpoint (global step 7) was not registered within 600 s: the drained "
                    "server goes at the deadline"]
    said, marked = _drain_wait(monkeypatch, lambda **kwargs: _reported(5, 7))
    assert marked == [(7, 1)] and said == []


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


ALONE = "no --address or RAY_ADDRESS: a run of its own"


@pytest.mark.parametrize("env, address, running, recorded, expected", [
    ({"RAY_ADDRESS": "10.0.0.1:6379"}, None, [], None, ("10.0.0.1:6379", "given by RAY_ADDRESS")),
    ({"RAY_ADDRESS": "local"}, None, ["10.0.0.9:6379"], None, (None, "RAY_ADDRESS=local: a new local instance")),
    # a run on a shared machine is its own: an instance running here is joined only when named
    ({}, None, ["10.0.0.2:6379"], None,
     (None, ALONE + ", beside 1 other Ray instance on this machine (--address auto would join one)")),
    ({}, None, ["10.0.0.2:6379", "10.0.0.3:6379"], "10.0.0.3:6379",
     (None, ALONE + ", beside 2 other Ray instances on this machine (--address auto would join one)")),
    ({}, None, [], "10.0.0.4:6379", (None, ALONE)),
    # auto (as ~/.raymcn_env sets it on a cluster's servers): the instance running here
    ({"RAY_ADDRESS": "auto"}, None, ["10.0.0.2:6379"], None,
     ("10.0.0.2:6379", "RAY_ADDRESS=auto: the Ray instance running on this machine")),
    ({"RAY_ADDRESS": "auto"}, None, ["10.0.0.2:6379", "10.0.0.3:6379"], "10.0.0.3:6379",
     ("10.0.0.3:6379", "RAY_ADDRESS=auto: the last `ray start` of the 2 Ray instances running on this machine")),
    ({"RAY_ADDRESS": "auto"}, "local", ["10.0.0.2:6379"], None, (None, "--address=local: a new local instance")),
    ({}, "auto", ["10.0.0.2:6379"], None,
     ("10.0.0.2:6379", "--address=auto: the Ray instance running on this machine")),
])
def test_the_instance_a_command_connects_to_and_why(monkeypatch, env, address, running, recorded, expected):
    from raymcn.train.on_ray import cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(cluster, "running_instances", lambda: running)
    monkeypatch.setattr(cluster, "recorded_instance", lambda: recorded)
    assert cluster.chosen_instance(address) == expected


def test_auto_with_no_ray_on_this_machine_says_so_and_how_to_run_alone(monkeypatch):
    """RAY_ADDRESS=auto where no Ray runs (a cluster's server before `ray up`): nothing runs, and the
    error says what asked for it and both ways on, not a new instance in the cluster's place."""
    from raymcn.train.on_ray import cluster

    monkeypatch.setenv("RAY_ADDRESS", "auto")
    monkeypatch.setattr(cluster, "running_instances", lambda: [])
    monkeypatch.setattr(cluster, "recorded_instance", lambda: "10.0.0.4:6379")  # a stale record: no raylet
    with pytest.raises(RayUnavailable) as e:
        cluster.chosen_instance(None)
    assert str(e.value).startswith("RAY_ADDRESS=auto: no Ray instance runs on this machine: ") and \
        "`ray up cluster.yaml`" in str(e.value) and "--address local" in str(e.value), e.value


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


def stop(process: subprocess.Popen) -> None:
    """SIGSTOP ``process`` and return once it has stopped. ``kill`` returns before the target stops:
    on a loaded machine a process still runnable then (state R) went on to answer a gRPC handshake
    for up to 0.2 s, so a check right after the signal saw it answer (5 of 25 tries beside 6 busy
    loops). The kernel shows a stopped process as state T in /proc/PID/stat."""
    import signal

    process.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{process.pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("T", "t"):
        assert time.monotonic() < deadline, f"process {process.pid} did not stop within 30 s of SIGSTOP"
        time.sleep(0.01)


FAKE_RAYLET = """
import sys, time
from concurrent.futures import ThreadPoolExecutor
import grpc
server = grpc.server(ThreadPoolExecutor(max_workers=1))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
time.sleep(120)
"""


def test_a_raylet_started_with_port_0_is_asked_at_the_ports_it_listens_on(tmp_path):
    """`ray start` gives its raylet ``--node_manager_port=0``: the raylet picks its port, so the
    connection asks it at every port the process listens on; one gRPC answer is enough. Stopped
    (SIGSTOP), it answers at none, and the wait names it by its pid."""
    import signal

    from raymcn.train.on_ray import cluster

    gcs = "127.0.0.1:59999"  # the instance it belongs to, by its raylet's command line
    raylet = subprocess.Popen(["bash", "-c", f"exec -a {tmp_path}/raylet {sys.executable} -c '{FAKE_RAYLET}' "
                               f"--node_manager_port=0 --node_ip_address=127.0.0.1 --gcs-address={gcs}"],
                              stdout=subprocess.PIPE, text=True,  # renamed, it finds grpc by this path only
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    try:
        port = int(raylet.stdout.readline())
        found = cluster.local_raylets(gcs)
        assert found == {raylet.pid: [f"127.0.0.1:{port}"]}, found
        assert cluster.local_raylets("127.0.0.1:59998") == {}  # another instance's: not this one's
        said: list[str] = []
        cluster.wait_for_answer(found[raylet.pid], "the raylet", "the raylet", said.append, named_after_s=5,
                                limit_s=10)
        assert said == []
        stop(raylet)
        with pytest.raises(RayUnavailable, match="the raylet did not answer within 1 s"):
            cluster.wait_for_answer(found[raylet.pid], "the raylet", "the raylet", said.append, named_after_s=0.5,
                                    limit_s=1.0)
        assert said == ["Ray: no answer from the raylet for 0.5 s; " + cluster.ADVICE + ". Giving up at 1 s."]
    finally:
        raylet.send_signal(signal.SIGCONT)
        raylet.kill()
        raylet.wait()


def test_a_process_stopped_after_answering_is_asked_again_on_a_connection_of_its_own():
    """grpc shares a process's connections to one address between its channels (its global
    subchannel pool): with an earlier channel still READY, a new one to a process stopped since
    (SIGSTOP) was called ready at once. The check must see the process answer now: it asks on a
    connection of its own, which a stopped process never completes."""
    import signal

    import grpc

    from raymcn.train.on_ray import cluster

    server = subprocess.Popen([sys.executable, "-c", FAKE_RAYLET], stdout=subprocess.PIPE, text=True)
    held = None
    try:
        address = f"127.0.0.1:{int(server.stdout.readline())}"
        held = grpc.insecure_channel(address)  # another caller's connection, ready before the stop
        grpc.channel_ready_future(held).result(timeout=30)
        stop(server)
        with pytest.raises(RayUnavailable, match="the GCS did not answer within 1 s"):
            cluster.wait_for_answer([address], "the GCS", "the GCS", lambda line: None, named_after_s=1.0,
                                    limit_s=1.0)
    finally:
        if held is not None:
            held.close()
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()


def test_several_instances_and_none_recorded_ask_which(monkeypatch):
    from raymcn.train.on_ray import cluster

    monkeypatch.setenv("RAY_ADDRESS", "auto")
    monkeypatch.setattr(cluster, "running_instances", lambda: ["10.0.0.2:6379", "10.0.0.3:6379"])
    monkeypatch.setattr(cluster, "recorded_instance", lambda: None)
    with pytest.raises(ConfigError, match="RAY_ADDRESS=auto: several Ray instances"):
        cluster.chosen_instance(None)
    monkeypatch.delenv("RAY_ADDRESS")
    assert cluster.chosen_instance(None)[0] is None  # named by nothing: a run of its own beside them


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
    assert len(said) == 1 and f"no answer from {silent_gcs}" in said[0] and cluster.ADVICE in said[0], said
    assert "ray stop" not in said[0]  # it may be a colleague's: never advise stopping every Ray of the account


def test_a_gcs_that_answers_is_waited_for_no_longer():
    from concurrent.futures import ThreadPoolExecutor

    import grpc

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


def test_drain_at_an_address_that_does_not_answer_says_so(silent_gcs, monkeypatch, capsys):
    """`raymcn drain --address X` where nothing answers: the address first, the silence named, then
    that it did not answer, status 1 and no reboot; not "no running Ray cluster"."""
    import argparse

    from raymcn.servers import drain
    from raymcn.train.on_ray import cluster

    monkeypatch.setattr(cluster, "CONNECT_NAMED_AFTER_S", 0.5)
    monkeypatch.setattr(cluster, "CONNECT_LIMIT_S", 1.0)
    monkeypatch.setattr(drain.subprocess, "run", pytest.fail)  # neither `ray drain-node` nor a reboot
    args = argparse.Namespace(deadline=60, reboot=True, address=silent_gcs, node_id=None)
    assert drain.run(args) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == f"Ray: connecting to the instance at {silent_gcs} (given by --address)", out
    assert f"Ray: no answer from {silent_gcs} (given by --address) for 0.5 s" in out, out
    assert err.startswith(f"raymcn drain: the Ray instance at {silent_gcs} (given by --address) did not answer "
                          f"within 1 s; {drain.DRAIN_ADVICE}; not rebooting"), err
    assert "ray stop" not in out + err
    assert "no running Ray cluster" not in out + err


def _self_signed(tmp_path: Path) -> dict[str, str]:
    """Ray's TLS variables for a self-signed certificate of 127.0.0.1, as a cluster's would be set."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ray-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (tmp_path / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": str(tmp_path / "tls.crt"),
            "RAY_TLS_SERVER_KEY": str(tmp_path / "tls.key"), "RAY_TLS_CA_CERT": str(tmp_path / "tls.crt")}


def test_a_gcs_with_tls_on_is_asked_over_tls(tmp_path, monkeypatch):
    """A cluster with RAY_USE_TLS on: its GCS (here a gRPC server set up as Ray sets its own, mutual
    TLS) answers the check over TLS; a plain channel would never complete its handshake, and a healthy
    GCS would be reported as not answering."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from raymcn.train.on_ray import cluster

    tls = _self_signed(tmp_path)
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    key, cert = Path(tls["RAY_TLS_SERVER_KEY"]).read_bytes(), Path(tls["RAY_TLS_SERVER_CERT"]).read_bytes()
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=cert, require_client_auth=True))
    server.start()
    try:
        said: list[str] = []
        with pytest.raises(RayUnavailable, match="did not answer within 1 s"):  # TLS off here: no handshake
            cluster.wait_for_gcs(f"127.0.0.1:{port}", "given by --address", said.append, named_after_s=0.5,
                                 limit_s=1.0)
        for k, v in tls.items():
            monkeypatch.setenv(k, v)
        said.clear()
        cluster.wait_for_gcs(f"127.0.0.1:{port}", "given by --address", said.append, named_after_s=5, limit_s=10)
        assert said == []
        monkeypatch.delenv("RAY_TLS_CA_CERT")
        with pytest.raises(RayUnavailable, match="RAY_USE_TLS is on but RAY_TLS_CA_CERT is not set"):
            cluster.wait_for_gcs(f"127.0.0.1:{port}", "given by --address", said.append)
    finally:
        server.stop(None)


BOUNDED_START = """
import sys, time
import ray
from raymcn.config import RayUnavailable
from raymcn.train.on_ray import cluster

cluster.LOCAL_START_LIMIT_S, cluster.CONNECT_NAMED_AFTER_S = 3.0, 1.0
stopped = []
def hanging_start(**kwargs):  # a start that never returns: its waits poll, as Ray's do
    while True:
        time.sleep(0.05)
ray.init, ray.shutdown = hanging_start, lambda: stopped.append(True)
started = time.monotonic()
try:
    with cluster.ray_session("local"):
        print("STARTED")
except RayUnavailable as e:
    print(f"ENDED after {time.monotonic() - started:.1f} s: {e}; shut down: {stopped}")
"""


def test_a_local_start_that_hangs_is_named_then_ended_and_its_processes_stopped():
    """A new local instance is said before it starts; a start that does not end is named, and at its
    limit ended by the alarm (in a command's main thread) and ``ray.shutdown``, which stops what it
    had started, with an error that names the start and the limit."""
    done = subprocess.run([sys.executable, "-c", BOUNDED_START], capture_output=True, text=True, timeout=60, cwd=ROOT)
    lines = done.stdout.splitlines()
    assert lines[0] == ("Ray: starting a new local instance (--address=local: a new local instance); it stops when "
                        "this command ends"), done.stdout + done.stderr
    assert lines[1].startswith("Ray: the start of a local Ray instance (--address=local: a new local instance) has "
                               "taken 1 s so far; Ray's own logs are in /tmp/ray/session_latest/logs. Giving up at 3 s")
    ended = re.match(r"ENDED after ([\d.]+) s: the start of a local Ray instance .* did not end within 3 s; (.*); "
                     r"shut down: \[True\]$", lines[2])
    assert ended and 3.0 <= float(ended.group(1)) < 10, done.stdout
    assert "STARTED" not in done.stdout


@pytest.mark.slow
@pytest.mark.soak  # the slow tier's SIGSTOP test runs `python sweep.py` beside a real instance that does not answer
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
    assert "ray stop" not in text and "--address local" in text and "--address HOST:PORT" in text
    assert proc.returncode == 1, text
    assert lines[-1][0] - connecting <= CONNECT_LIMIT_S + 15, text
    assert f"nothing ran: the Ray instance at {silent_gcs} (given by RAY_ADDRESS) did not answer" in text


@pytest.fixture
def own_ray_instance():
    """A `ray start --head` of this test's own (:func:`ray_instance_of_our_own`)."""
    with ray_instance_of_our_own() as instance:
        yield instance


@contextlib.contextmanager
def ray_instance_of_our_own():
    """A `ray start --head` of our own (its port, its temp folder): yields (GCS address, its
    processes by name), and at the end stops only those processes (and what they started; never
    `ray stop`, which would end every Ray instance of the machine), resumed first if stopped."""
    import shutil
    import signal
    import tempfile

    import ray  # noqa: F401 - Ray's own copy of psutil comes on the path with it

    import psutil

    from bench.services import free_port

    port = free_port()
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    ray_cli = str(Path(sys.executable).with_name("ray"))
    dot_ray = Path.home() / ".ray"
    before = sorted(dot_ray.rglob("*")) if dot_ray.exists() else None

    def ours() -> list:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if any(temp in part for part in proc.info["cmdline"] or []):
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    started = subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=1",
                              "--include-dashboard=false", f"--temp-dir={temp}"], env=env, capture_output=True,
                             text=True, timeout=180)
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        by_name = {os.path.basename((p.info["cmdline"] or [""])[0]): p for p in ours()}
        yield f"127.0.0.1:{port}", by_name
    finally:
        family = {p.pid: p for p in ours()}
        for proc in list(family.values()):
            with_children = [proc]
            try:
                with_children += proc.children(recursive=True)
            except psutil.Error:
                pass
            family.update({p.pid: p for p in with_children})
        for proc in family.values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    proc.send_signal(sig)
                except psutil.Error:
                    pass
        psutil.wait_procs(list(family.values()), timeout=30)
        shutil.rmtree(temp, ignore_errors=True)
        if before is None:
            shutil.rmtree(dot_ray, ignore_errors=True)
        elif dot_ray.exists():
            for path in sorted(set(dot_ray.rglob("*")) - set(before), reverse=True):
                path.unlink() if path.is_file() else path.rmdir()


BOOT_WAIT = """
import sys
from raymcn.servers import boot
record = boot.StartRecord("head", ["ray", "start", "--head", "--port=" + sys.argv[1]])  # as `ray up` ran it
try:
    boot.wait_for_nodes(*boot.started_instance(record), 1, 600)
except boot.BootError as e:
    print(f"raymcn boot: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
"""


@contextlib.contextmanager
def _runs_side_by_side(commands: dict[str, list[str]], env: dict[str, str]):
    """Each command started at once beside the others; yields the wait for them, ``ended(timeout_s)``
    (``timeout_s`` from their start): {name: (returncode, [(seconds since the start, line)], seconds
    it took)}, stdout and stderr merged. A command still running on leaving is killed."""
    start = time.monotonic()
    procs = {name: subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for name, argv in commands.items()}
    lines: dict[str, list] = {name: [] for name in commands}
    took: dict[str, float] = {}

    def read(name: str) -> None:  # its lines as they come, then when it exited (not when it was asked)
        for line in procs[name].stdout:
            lines[name].append((time.monotonic() - start, line.rstrip()))
        procs[name].wait()
        took[name] = time.monotonic() - start

    readers = [threading.Thread(target=read, args=(name,), daemon=True) for name in commands]
    for r in readers:
        r.start()

    def ended(timeout_s: float) -> dict[str, tuple]:
        for proc in procs.values():
            try:
                proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for r in readers:
            r.join(timeout=10)
        return {name: (procs[name].returncode, lines[name], took.get(name, time.monotonic() - start))
                for name in commands}

    try:
        yield ended
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _bounded_as_documented(name: str, run: tuple, address: str, silent: str, error: str,
                           why: str = "given by RAY_ADDRESS") -> None:
    """The instance and ``why`` first; within 60 s of it the ``silent`` one named with what to do; a
    non-zero exit within 90 s of it, with ``error``."""
    from raymcn.train.on_ray.cluster import CONNECT_NAMED_AFTER_S

    code, lines, took = run
    text = "\n".join(f"{t:6.1f} {line}" for t, line in lines)
    connecting = [t for t, line in lines if line == f"Ray: connecting to the instance at {address} ({why})"]
    assert connecting, f"{name}: no connection line\n{text}"
    advice = re.compile(rf"Ray: no answer from {re.escape(silent)} for {CONNECT_NAMED_AFTER_S:g} s; \w.+ "
                        rf"Giving up at \d+ s\.$")  # what to do, then when it ends
    named = [t for t, line in lines if advice.match(line)]
    assert named and CONNECT_NAMED_AFTER_S - 1 <= named[0] - connecting[0] <= 60, f"{name}:\n{text}"
    assert code not in (0, None) and took - connecting[0] <= 90, f"{name}: status {code} after {took:.0f} s\n{text}"
    assert error in text, f"{name}:\n{text}"


@pytest.mark.slow
def test_drain_boot_and_the_main_command_beside_a_ray_instance_stopped_with_sigstop(own_ray_instance, tmp_path):
    """A Ray instance on the machine whose processes stop answering (a hung head): with its GCS
    stopped, `raymcn drain`, `raymcn boot`'s wait for the nodes and `python sweep.py` each name the
    instance and why at once, the silence within 60 s with advice, and end non-zero within 90 s; with
    its raylet stopped instead (the GCS answers), each ends non-zero within 90 s naming Ray's error.
    Nothing of them is left running (each is its own process, and it exited). The two cases wait
    side by side, on two instances of the test's own (a second `ray start --head` for the stopped
    raylet): each command's minute of waiting runs once, not twice."""
    import signal

    from raymcn.train.on_ray.cluster import running_instances

    address, processes = own_ray_instance
    port = address.rpartition(":")[2]
    (started,) = [a for a in running_instances() if a.endswith(f":{port}")]  # as its raylet names it
    env = {**os.environ, "RAY_ADDRESS": address, "RAYMCN_RESULTS": str(tmp_path), "RAY_AUTH_MODE": "disabled"}
    commands = {"drain": [sys.executable, "-m", "raymcn.cli", "drain"],
                "boot": [sys.executable, "-c", BOOT_WAIT, port],
                "sweep": [sys.executable, "sweep.py"]}
    gcs = processes["gcs_server"]
    stop(gcs)
    try:
        with _runs_side_by_side(commands, env) as gcs_stopped, ray_instance_of_our_own() as (second, beside):
            raylet = beside["raylet"]  # the second instance: its GCS answers, this machine's raylet does not
            stop(raylet)
            try:
                with _runs_side_by_side({"drain": commands["drain"], "sweep": commands["sweep"]},
                                        {**env, "RAY_ADDRESS": second}) as raylet_stopped:
                    raylet_runs = raylet_stopped(timeout_s=200)
            finally:
                raylet.send_signal(signal.SIGCONT)
            runs = gcs_stopped(timeout_s=200)
    finally:
        gcs.send_signal(signal.SIGCONT)
    gave_up = f"the Ray instance at {address} (given by RAY_ADDRESS) did not answer within 60 s"
    for name, run in runs.items():
        if name == "boot":  # the instance it started, found by its port, whatever RAY_ADDRESS says
            booted = f"started by this boot: this machine's Ray instance at port {port}"
            _bounded_as_documented(name, run, started, f"{started} ({booted})",
                                   f"the Ray instance at {started} ({booted}) did not answer within 60 s", why=booted)
        else:
            _bounded_as_documented(name, run, address, f"{address} (given by RAY_ADDRESS)", gave_up)
    assert f"raymcn drain: {gave_up}" in "\n".join(line for _, line in runs["drain"][1])
    assert f"raymcn sweep: nothing ran: {gave_up}" in "\n".join(line for _, line in runs["sweep"][1])

    for name, run in raylet_runs.items():
        _bounded_as_documented(name, run, second, f"this machine's raylet (pid {raylet.pid}) of the instance at "
                               f"{second}", f"this machine's raylet (pid {raylet.pid}) of the Ray instance at "
                               f"{second} (given by RAY_ADDRESS) did not answer within 60 s")
