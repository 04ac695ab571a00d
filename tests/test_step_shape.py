"""The shape of the training code: one run object carried through the epoch and the step (no
function of ``raymcn/train/`` takes a long list of parts of it), and a step that reads no
environment variable (what a run needs from its environment is read at the rank's start and
installed as hooks, ``train/faults.py``)."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import linear_mcn, run_of

import raymcn
from raymcn.config import load_config
from raymcn.train.loop import train_one_epoch

TRAIN = Path(raymcn.__file__).parent / "train"
MOST_PARAMETERS = 8


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The names a call may pass (``self``/``cls`` of a method left out), ``*args``/``**kwargs`` included."""
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def too_long(root: Path = TRAIN) -> list[str]:
    """Every function under ``root`` with more than ``MOST_PARAMETERS`` parameters."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(parameters(node)) > MOST_PARAMETERS:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}({', '.join(parameters(node))})")
    return found


def test_no_train_function_takes_more_than_eight_parameters():
    assert too_long() == []


def test_the_parameter_check_sees_a_long_signature(tmp_path):
    (tmp_path / "long.py").write_text("class A:\n    def f(self, a, b, c, d, e, f, g, h, *, i=0):\n        pass\n"
                                      "def g(a, b, c, d, e, f, g, *rest):\n    pass\n")
    assert [line.split(" ")[1].split("(")[0] for line in too_long(tmp_path)] == ["f"]


RAYMCN_DIR = str(Path(raymcn.__file__).parent)
TORCH_DIR = str(Path(torch.__file__).parent)


def reader() -> str | None:
    """Whose read of the environment this is: ``raymcn`` when the innermost raymcn or torch frame of
    the stack (the standard library's skipped, so a read through ``tempfile`` still counts) is
    raymcn's; None when it is torch's (which variables torch reads differs between releases, and is
    torch's own business) or neither's."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(RAYMCN_DIR):
            return "raymcn"
        if name.startswith(TORCH_DIR):
            return None
        frame = frame.f_back
    return None


class RecordedEnviron(dict):
    """``os.environ`` that records every name raymcn's code reads (:func:`reader`)."""

    def __init__(self, base):
        super().__init__(base)
        self.read: list[str] = []

    def _record(self, key):
        if reader() == "raymcn":
            self.read.append(key)

    def __getitem__(self, key):
        self._record(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._record(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._record(key)
        return super().__contains__(key)


def test_the_recorder_tells_raymcns_reads_from_torchs(monkeypatch):
    from raymcn.train.preflight import convspace

    environ = RecordedEnviron({**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"})
    monkeypatch.setattr(os, "environ", environ)
    convspace.conv_path()  # raymcn reads ONEDNN_MAX_CPU_ISA
    torch.cuda.is_available()  # whatever torch reads is its own
    assert "ONEDNN_MAX_CPU_ISA" in environ.read
    assert not any(name.startswith("PYTORCH_") for name in environ.read)


@pytest.mark.parametrize("grad_cache_clips", [0, 4], ids=["plain", "cached"])
def test_a_training_step_reads_no_environment_variable(monkeypatch, grad_cache_clips):
    """Steps of the loop (plain, and with gradient caching) with the fault and trace variables set
    from outside: the step reads none of them, nor any other (they act only when installed at a
    rank's start)."""
    cfg = load_config(None, ["scale.num_workers=0", "data.batch_size=4", "data.clips_per_video=2",
                             "model.embed_dim=8", "loss.num_clusters=4", "optim.warmup_steps=0",
                             f"scale.grad_cache_clips={grad_cache_clips}", "model.recon=true"])
    model = linear_mcn(12, 8)
    run = run_of(cfg, model)
    g = torch.Generator().manual_seed(0)
    batches = [{m: torch.randn(8, 12, generator=g) for m in ("video", "audio", "text")} for _ in range(2)]
    environ = RecordedEnviron({**os.environ, "RAYMCN_FAULT": "nan_at_step=0", "RAYMCN_TRACE": "/nonexistent"})
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(os, "getenv", environ.get)
    metrics = train_one_epoch(run, batches)
    assert environ.read == []
    assert metrics["skipped_steps"] == 0  # the fault, set but not installed, did nothing
