"""``raymcn sweep --resume EXP`` with a sweep file: a restored sweep runs the copy it saved
(``EXP/raymcn_sweep.yaml``), so a file that differs from it is named, key by key, instead of being
silently ignored."""

from __future__ import annotations

import pytest

from raymcn.cli import build_parser, main, resume_differences
from raymcn.config import SWEEP_CONFIG_FILE, load_config

SMOKE = "sweeps/smoke.yaml"


def _args(*words: str):
    return build_parser().parse_args(["sweep", "--resume", "EXP", *words])


def test_each_differing_key_is_named_with_both_values():
    saved = load_config(SMOKE)
    note = resume_differences(_args("--config", SMOKE, "--set", "optim.lr=0.5", "--set", "sweep.num_samples=7"),
                              saved, "/x/EXP")
    assert "differ from the sweep's saved copy (/x/EXP/raymcn_sweep.yaml) in 2 key(s)" in note
    assert "optim.lr: 0.5 given, 0.003 saved" in note
    assert f"sweep.num_samples: 7 given, {saved.sweep.num_samples} saved" in note
    assert "runs its saved copy" in note


def test_silent_when_the_file_agrees_or_nothing_was_given():
    saved = load_config(SMOKE)
    assert resume_differences(_args("--config", SMOKE), saved, "EXP") is None
    assert resume_differences(_args(), saved, "EXP") is None  # a plain --resume compares nothing


def test_the_sweep_command_says_it_before_it_restores(tmp_path, monkeypatch, capsys):
    exp = tmp_path / "sweep-x"
    exp.mkdir()
    (exp / SWEEP_CONFIG_FILE).write_text(load_config(SMOKE).dump_text())

    class Stop(Exception):
        pass

    def stop(*_a, **_k):
        raise Stop

    monkeypatch.setattr("raymcn.train.inputs.resolve_inputs", stop)  # the step after the note: no Ray, no data
    with pytest.raises(Stop):
        main(["sweep", "--resume", str(exp), "--config", SMOKE, "--set", "optim.lr=0.5"])
    assert "optim.lr: 0.5 given, 0.003 saved" in capsys.readouterr().err


def test_a_sweep_resumed_on_another_commit_says_so_first_and_records_it_once_it_runs(tmp_path, monkeypatch, capsys,
                                                                                  checkout):
    """The provenance note (``provenance/compare.py``): before Ray starts, the resumed sweep names what
    differs from its record (here the commit, after a `git pull`); its entry is added once the sweep
    runs, not by a resume that never started."""
    from raymcn import cli
    from raymcn.provenance import collect, record
    from raymcn.train import run_record
    from raymcn.train.inputs import resolve_inputs

    exp = tmp_path / "sweep-x"
    cfg = load_config(SMOKE)
    (exp / "train").mkdir(parents=True)
    (exp / SWEEP_CONFIG_FILE).write_text(cfg.dump_text())
    monkeypatch.setattr(collect, "PACKAGE_DIR", checkout.package)
    entry = run_record.driver_entry(cfg, resolve_inputs(cfg))
    record.append(str(exp), {**entry, "code": {**entry["code"], "commit": "a" * 40}})

    class Stop(Exception):
        pass

    def stop(*_a, **_k):
        raise Stop

    monkeypatch.setattr(cli, "ray_session", stop)
    with pytest.raises(Stop):
        main(["sweep", "--resume", str(exp)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("note: this sweep continues with other code") and f"commit: aaaaaaa -> " \
        f"{checkout.commit[:7]}" in [line.strip() for line in lines[:4]]
    assert [e["entry"] for e in record.read(str(exp))] == ["start"]
