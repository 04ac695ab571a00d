"""Checkpoint files: atomic writes, strict restore, fallback past a damaged latest checkpoint."""

import json
import os
import re
from pathlib import Path

import pytest
import torch

from raymcn.train.checkpoints import payload as checkpoint
from raymcn.train.checkpoints.payload import CheckpointError
from raymcn.train.run import LoopState


def write(run, name, step):
    state = LoopState(step=step, epoch=step)
    return checkpoint.save(run / name, loop=state, model=torch.nn.Linear(2, 2))


def test_roundtrip_restores_state_and_rng(tmp_path):
    lin = torch.nn.Linear(3, 3)
    torch.manual_seed(5)
    checkpoint.save(tmp_path, model=lin, loop=LoopState(step=7, epoch=2))
    expected = torch.rand(3)
    other, state = torch.nn.Linear(3, 3), LoopState()
    checkpoint.restore(checkpoint.load(tmp_path), model=other, loop=state)
    assert (state.step, state.epoch) == (7, 2)
    assert torch.equal(other.weight, lin.weight)
    assert torch.equal(torch.rand(3), expected)  # RNG continues where the saved run was


def test_failed_write_leaves_previous_file_intact(tmp_path, monkeypatch):
    write(tmp_path, "ck", 1)

    def disk_full(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write(tmp_path, "ck", 2)
    monkeypatch.undo()
    assert checkpoint.load(tmp_path / "ck")["loop"]["step"] == 1  # the old complete file, never the partial one


def test_damaged_latest_falls_back_with_warning(tmp_path):
    for i, name in enumerate(["checkpoint_2026-01-01_00", "checkpoint_2026-01-01_01", "checkpoint_2026-01-01_02"]):
        write(tmp_path, name, i)
    latest = tmp_path / "checkpoint_2026-01-01_02"
    data = (latest / checkpoint.STATE_FILE).read_bytes()
    (latest / checkpoint.STATE_FILE).write_bytes(data[: len(data) // 2])  # truncated
    warnings = []
    payload, path = checkpoint.load_latest_good(latest, warn=warnings.append)
    assert os.path.basename(path) == "checkpoint_2026-01-01_01" and payload["loop"]["step"] == 1
    assert "unreadable" in warnings[0] and str(latest) in warnings[0]


def test_no_readable_checkpoint_is_an_error(tmp_path):
    write(tmp_path, "checkpoint_a", 0)
    (tmp_path / "checkpoint_a" / checkpoint.STATE_FILE).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        checkpoint.load_latest_good(tmp_path / "checkpoint_a", warn=lambda m: None)


def test_restore_is_strict(tmp_path):
    checkpoint.save(tmp_path, model=torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError):
        checkpoint.restore(checkpoint.load(tmp_path), model=torch.nn.Linear(3, 3))
    with pytest.raises(CheckpointError, match="lacks 'optimizer'"):
        checkpoint.restore(checkpoint.load(tmp_path), optimizer=None)


class _FakeGPUs:
    """torch.cuda as a worker that sees ``count`` GPUs and owns ``current`` (no real GPU needed)."""

    def __init__(self, monkeypatch, count: int, current: int = 0):
        self.count, self.current, self.states = count, current, {}
        import torch.cuda.random as cuda_random

        for module in (torch.cuda, cuda_random):
            monkeypatch.setattr(module, "set_rng_state", self.set_rng_state)
            monkeypatch.setattr(module, "get_rng_state", self.get_rng_state)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(cuda_random, "device_count", lambda: count, raising=False)

    def _index(self, device) -> int:
        index = self.current if device in (None, "cuda") else int(getattr(device, "index", device))
        if index >= self.count:
            raise IndexError(f"GPU {index} of a process that sees {self.count}")  # what CUDA says, in short
        return index

    def set_rng_state(self, state, device="cuda"):
        self.states[self._index(device)] = state.clone()

    def get_rng_state(self, device="cuda"):
        return self.states.get(self._index(device), torch.full((4,), self._index(device), dtype=torch.uint8))


def test_a_resume_that_sees_fewer_gpus_restores_its_own_devices_generator(tmp_path, monkeypatch):
    """A checkpoint of a process that saw 4 GPUs (rank 0 of a 4-GPU server), resumed by a worker that
    sees 1 (another placement, or --resume with fewer workers): restoring one state per GPU of the
    saver raised IndexError, which Ray retried as if it were transient."""
    saver = _FakeGPUs(monkeypatch, count=4, current=0)
    saver.states[0] = torch.tensor([9, 9, 9, 9], dtype=torch.uint8)
    checkpoint.save(tmp_path / "new", model=torch.nn.Linear(2, 2), loop=LoopState())
    old_format = checkpoint.load(tmp_path / "new")
    old_format["rng"]["cuda"] = [torch.full((4,), i, dtype=torch.uint8) for i in range(4)]  # get_rng_state_all
    monkeypatch.undo()

    worker = _FakeGPUs(monkeypatch, count=1, current=0)
    checkpoint.restore(checkpoint.load(tmp_path / "new"), model=torch.nn.Linear(2, 2), loop=LoopState())
    assert torch.equal(worker.states[0], torch.tensor([9, 9, 9, 9], dtype=torch.uint8))  # the saver's own device's
    checkpoint.restore(old_format, model=torch.nn.Linear(2, 2), loop=LoopState())
    assert torch.equal(worker.states[0], torch.zeros(4, dtype=torch.uint8))  # device 0's of the old list
    assert set(worker.states) == {0}


# --- loading only what raymcn saves (torch.load with weights_only=True) -----------------------------
CALLS = []


def _record_call(*args):
    """What a tampered checkpoint asks the unpickler to call; a refused load never calls it."""
    CALLS.append(args)
    return {}


class _Payload:
    """An object whose unpickling runs a function of the file's choosing (here a harmless one)."""

    def __reduce__(self):
        return _record_call, ("code from the checkpoint file",)


def tamper(directory, **extra):
    """Rewrite ``directory/state.pt`` as someone with write access to the storage could."""
    path = directory / checkpoint.STATE_FILE
    payload = torch.load(path, weights_only=False)
    payload.update(extra)
    torch.save(payload, path)
    return path


def test_a_whole_run_checkpoint_round_trips_with_weights_only():
    """Everything a run saves (model, Adam, the LR schedule, queue and centroids, loop, numpy's RNG
    state, config, metrics) loads under weights_only=True and restores."""
    import tempfile

    import numpy as np

    from raymcn.config import load_config
    from raymcn.train.build import assemble
    from raymcn.train.run_plan import make_plan

    cfg = load_config(Path(__file__).resolve().parents[1] / "sweeps" / "smoke.yaml")
    run = assemble(cfg, make_plan(cfg, 256))
    for p in run.net.parameters():
        p.grad = torch.ones_like(p)
    run.optimizer.step()
    run.scheduler.step()
    np.random.seed(3)
    with tempfile.TemporaryDirectory() as d:
        checkpoint.save(d, **run.parts(), config=cfg.to_dict(), metrics={"epoch": 1.0})
        expected = np.random.rand(3)
        assert checkpoint.foreign_types(os.path.join(d, checkpoint.STATE_FILE)) == []
        other = assemble(cfg, make_plan(cfg, 256))
        checkpoint.restore(checkpoint.load(d), **other.parts())
    assert np.array_equal(np.random.rand(3), expected)  # numpy's generator continues too
    assert other.scheduler.state_dict() == run.scheduler.state_dict()
    assert torch.equal(other.optimizer.state_dict()["state"][0]["exp_avg"],
                       run.optimizer.state_dict()["state"][0]["exp_avg"])


def test_a_checkpoint_pickles_nothing_beyond_torchs_default_allowlist(tmp_path):
    """Every torch of pyproject's range reads a payload the same way: it names no global that
    torch's weights_only load would need told about (numpy's RNG state is plain values)."""
    import numpy as np

    np.random.seed(11)
    path = write(tmp_path, "ck", 1)
    assert checkpoint.unsafe_globals(path) == set()
    assert not any(name.startswith("numpy") for name in checkpoint.pickled_globals(path))
    expected = np.random.rand(4)
    np.random.seed(0)
    checkpoint.restore(checkpoint.load(tmp_path / "ck"), model=torch.nn.Linear(2, 2), loop=LoopState())
    assert np.array_equal(np.random.rand(4), expected)


def legacy(directory):
    """Rewrite ``directory/state.pt`` as raymcn wrote it before: numpy's RNG state as numpy objects."""
    import numpy as np

    path = directory / checkpoint.STATE_FILE
    payload = torch.load(path, weights_only=True)
    name, keys, *rest = payload["rng"]["numpy"]
    payload["rng"]["numpy"] = (name, keys.numpy().astype(np.uint32), *rest)
    torch.save(payload, path)
    return path


def test_a_checkpoint_an_earlier_raymcn_wrote_loads_with_its_numpy_objects_allowed(tmp_path):
    import numpy as np

    np.random.seed(12)
    write(tmp_path, "ck", 1)
    path = legacy(tmp_path / "ck")
    assert {"numpy.ndarray", "numpy.dtype"} <= checkpoint.unsafe_globals(path)
    assert checkpoint.foreign_types(path) == []
    expected = np.random.rand(4)
    if not hasattr(torch.serialization, "safe_globals"):  # torch < 2.5: no allowlist to give it
        with pytest.raises(CheckpointError, match="holds numpy's RNG state as numpy objects"):
            checkpoint.load(tmp_path / "ck")
        return
    np.random.seed(0)
    checkpoint.restore(checkpoint.load(tmp_path / "ck"), model=torch.nn.Linear(2, 2), loop=LoopState())
    assert np.array_equal(np.random.rand(4), expected)


def test_a_torch_without_an_allowlist_names_why_it_cannot_read_an_earlier_raymcns_checkpoint(tmp_path, monkeypatch):
    write(tmp_path, "ck", 1)
    legacy(tmp_path / "ck")
    monkeypatch.delattr(torch.serialization, "safe_globals", raising=False)
    with pytest.raises(CheckpointError, match=re.escape(f"torch {torch.__version__} cannot allow")) as info:
        checkpoint.load(tmp_path / "ck")
    assert not isinstance(info.value, checkpoint.UnsafeCheckpointError)  # not someone's tampering


def test_the_pickle_scan_finds_what_torchs_own_finds(tmp_path, monkeypatch):
    """Where torch has no ``get_unsafe_globals_in_checkpoint`` (before 2.6), raymcn's own scan of the
    archive names the foreign types; on a torch that has it, both agree."""
    write(tmp_path, "ck", 1)
    legacy(tmp_path / "ck")
    path = tamper(tmp_path / "ck", metrics=_Payload())
    own = checkpoint.pickled_globals(path)
    assert f"{__name__}._record_call" in own and "numpy.ndarray" in own
    if hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint"):
        torchs = checkpoint.unsafe_globals(path)
        monkeypatch.delattr(torch.serialization, "get_unsafe_globals_in_checkpoint")
        assert checkpoint.unsafe_globals(path) == torchs
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="_record_call") as info:
        checkpoint.load(tmp_path / "ck")
    assert "numpy" not in str(info.value)  # what an earlier raymcn saved is not named as foreign
    with pytest.raises(ValueError, match="not a readable torch.save archive"):
        checkpoint.pickled_globals(tmp_path / "ck" / checkpoint.META_FILE)


def test_a_checkpoint_holding_another_pickled_object_is_refused(tmp_path):
    write(tmp_path, "ck", 1)
    path = tamper(tmp_path / "ck", metrics=_Payload())
    with pytest.raises(checkpoint.UnsafeCheckpointError) as info:
        checkpoint.load(tmp_path / "ck")
    message = str(info.value)
    assert f"checkpoint {path} holds pickled objects of types raymcn never saves" in message
    assert "_record_call" in message and "refused" in message
    assert CALLS == []  # the file's function never ran


def test_resume_stops_at_a_tampered_checkpoint_instead_of_going_back(tmp_path):
    """A tampered latest checkpoint is not damage to skip past: the resume fails, naming the file,
    as a permanent error (Ray Train does not retry it)."""
    import argparse

    from raymcn.config import permanent_cause

    for i, name in enumerate(["checkpoint_2026-01-01_00", "checkpoint_2026-01-01_01"]):
        write(tmp_path, name, i)
    latest = tmp_path / "checkpoint_2026-01-01_01"
    tamper(latest, config=argparse.Namespace(lr=1))
    warnings = []
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="argparse.Namespace") as info:
        checkpoint.load_latest_good(latest, warn=warnings.append)
    assert str(latest / checkpoint.STATE_FILE) in str(info.value) and warnings == []
    assert permanent_cause(info.value) is info.value


def test_a_run_that_ended_tells_its_last_metrics_from_its_newest_checkpoint(tmp_path):
    """A sweep restored after its driver's reboot finds a trial whose Train run ended before Tune
    saved that: the trial reports the run's last epoch again from the newest checkpoint's metrics
    (not a Train run that has nothing left to train and reports nothing); a checkpoint inside the
    last epoch, or before it, is not an end."""
    from raymcn.train.on_ray.launch import finished_metrics

    run = tmp_path / "train-abc"
    assert finished_metrics(str(run), 4) is None  # not started
    metrics = {"epoch": 4.0, "text_to_video_R@10": 12.5, "budget_epoch": 2.0}
    for name, epoch, steps in (("checkpoint_2026-01-01_00-00-01.000001", 3, 0),
                               ("checkpoint_2026-01-01_00-00-02.000001", 4, 0)):
        (run / name).mkdir(parents=True)
        (run / name / checkpoint.META_FILE).write_text(json.dumps({"epoch": epoch, "progress": {"steps": steps}}))
        (run / name / checkpoint.METRICS_META_FILE).write_text(json.dumps({**metrics, "epoch": float(epoch)}))
    assert finished_metrics(str(run), 4) == metrics
    assert finished_metrics(str(run), 5) is None  # more to train
    inside = run / "checkpoint_2026-01-01_00-00-03.000001"  # a mid-epoch one of a longer run
    inside.mkdir()
    (inside / checkpoint.META_FILE).write_text(json.dumps({"epoch": 4, "progress": {"steps": 1}}))
    assert finished_metrics(str(run), 4) is None
