"""Checkpoint files: atomic writes, strict restore, fallback past a damaged latest checkpoint."""

import os

import pytest
import torch

from raymcn.train import checkpoint
from raymcn.train.checkpoint import CheckpointError
from raymcn.train.loop import LoopState


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
