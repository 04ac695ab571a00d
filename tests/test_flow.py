"""One flow: configuration -> inputs resolved once (the embedded default generated there) -> the
plan, made once -> preflight, trainer, every trial and every rank, which only read files."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import TINY

import raymcn
from raymcn import cli
from raymcn.config import load_config
from raymcn.data import synthetic
from raymcn.train import inputs as inputs_module
from raymcn.train import run_plan as plan_module

GENERATORS = ("write_corpus", "ensure_corpus", "ensure_synthetic_shards", "ensure_settings")


def count_calls(monkeypatch, module, name: str, counts: Counter, after=None) -> None:
    real = getattr(module, name)

    def counted(*args, **kwargs):
        counts[name] += 1
        out = real(*args, **kwargs)
        if after is not None:
            after()
        return out

    monkeypatch.setattr(module, name, counted)


def forbid_generating(monkeypatch) -> None:
    """From now on, generating the synthetic corpus or its shards fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("data was generated after the inputs were resolved")

    for name in GENERATORS:
        monkeypatch.setattr(synthetic, name, refuse)


def test_only_the_entry_points_resolution_may_generate_the_synthetic_corpus():
    """Of raymcn's modules only ``train/inputs`` (and ``data/commands``, for ``raymcn synth``) import the
    synthetic corpus's module: no plan step, preflight check, trial or rank can write data."""
    root = Path(raymcn.__file__).parent
    importers = set()
    for path in root.rglob("*.py"):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "raymcn.data.synthetic" or n.startswith("raymcn.data.synthetic.") for n in names):
                importers.add(module)
    assert importers == {"raymcn.train.inputs", "raymcn.data.commands"}, importers


@pytest.mark.ray
def test_a_run_resolves_its_inputs_and_plans_once_and_its_rank_only_reads(ray_local, tmp_path, monkeypatch):
    """``raymcn train`` in local mode (the rank runs in this process, so every call is seen):
    the inputs are resolved once and the plan made once (the preflight's is the trainer's), and
    once they are resolved nothing generates data, and the run still trains."""
    counts = Counter()
    count_calls(monkeypatch, inputs_module, "resolve_inputs", counts, after=lambda: forbid_generating(monkeypatch))
    count_calls(monkeypatch, plan_module, "make_plan", counts)
    argv = ["train", *sum((["--set", s] for s in [*TINY, "scale.num_workers=0", "schedule.epochs=1",
                                                  f"run.storage_path={tmp_path}"]), []), "--json"]
    assert cli.main(argv) == 0
    assert counts == {"resolve_inputs": 1, "make_plan": 1}


def test_a_sweep_resolves_its_inputs_once_and_each_trial_plans_from_them(tmp_path, monkeypatch):
    """``run_sweep`` resolves the inputs once and hands them to every trial; a trial makes its own
    plan from them (its configuration differs) and reads nothing to do so. Tune is replaced by a
    recorder and the trial's run by a stub: no Ray."""
    from raymcn.sweep import tuner

    counts = Counter()
    count_calls(monkeypatch, tuner, "resolve_inputs", counts, after=lambda: forbid_generating(monkeypatch))
    handed = {}
    monkeypatch.setattr(tuner, "_trainable", lambda cfg, experiment_dir, inputs, env: handed.update(inputs=inputs))

    class Recorder:
        def __init__(self, trainable, **kwargs):
            pass

        def fit(self):
            return SimpleNamespace(__iter__=lambda self: iter(()), errors=[],
                                   _experiment_analysis=SimpleNamespace(trials=[]))

    monkeypatch.setattr(tuner.tune, "Tuner", Recorder)
    monkeypatch.setattr(tuner, "_summarise", lambda grid, experiment_dir, target, stop: None)
    cfg = load_config(cli.preset_path(), [*TINY, f"run.storage_path={tmp_path}"])
    tuner.run_sweep(cfg, str(tmp_path / "sweep"))
    assert counts["resolve_inputs"] == 1

    trained = {}
    monkeypatch.setattr(tuner.tune, "get_context", lambda: SimpleNamespace(get_trial_id=lambda: "t0001"))
    monkeypatch.setattr(tuner, "fit", lambda cfg, run_dir, plan, **kw: trained.update(cfg=cfg, plan=plan))
    monkeypatch.setattr(tuner, "_epoch_report_callback", lambda: (lambda: None))  # Tune's needs a Tune session
    count_calls(monkeypatch, plan_module, "make_plan", counts)
    tuner.trial_fn({"data.batch_size": 8}, cfg.to_dict(), str(tmp_path / "sweep"), handed["inputs"])
    assert counts == {"resolve_inputs": 1, "make_plan": 1}
    assert trained["plan"].inputs is handed["inputs"] and trained["plan"].batch_videos == 8
