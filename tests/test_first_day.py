"""What a newcomer's first day meets, without Ray: each promise of the pages held against the code.

A capped ``schedule.steps_per_epoch`` is named; the shard plan line says what the shards hold; the
dry run refuses what the conversion would; ``--resume latest`` picks what a boot would continue
(neither finished, stopped nor a rehearsal) and says what it skipped, for sweeps and for runs; a
clone named ``raymcn`` in the folder Python starts in is named, not a circular import; and the
sentences of the pages that the code decides (randint's bounds, the boot service's step).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import shards_of

from raymcn.cli import main
from raymcn.config import REHEARSAL_FILE, RUN_CONFIG_FILE, SWEEP_CONFIG_FILE, Config
from raymcn.data import synthetic
from raymcn.servers import sweeps

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = synthetic.SynthSettings(videos=12, eval_clips=2, topics=3, word_dim=8, meaning_words=40, filler_words=10)


# --- a capped steps_per_epoch is named ----------------------------------------------------------------------
def test_steps_per_epoch_above_what_the_corpus_fills_is_named_with_what_the_run_takes():
    from raymcn.train.run_plan import capped_steps_note, make_plan

    cfg = Config().replace({"data.batch_size": 128, "schedule.steps_per_epoch": 200})
    plan = make_plan(cfg, videos=2048)
    assert plan.steps_per_epoch == 16
    assert capped_steps_note(cfg, plan) == ("schedule.steps_per_epoch=200 is more than the corpus fills: 2048 "
                                            "videos // data.batch_size=128 = 16 steps, so each epoch runs 16 (an "
                                            "epoch reads each video at most once)")
    assert capped_steps_note(cfg.replace({"schedule.steps_per_epoch": 10}), make_plan(cfg, videos=2048)) is None
    assert capped_steps_note(Config(), make_plan(Config(), videos=2048)) is None  # 0: the corpus decides, as said


def test_raymcn_train_says_the_cap_before_it_trains(monkeypatch, capsys, tmp_path):
    from raymcn.train.on_ray import launch

    def stop(*args, **kwargs):
        raise KeyboardInterrupt  # the run itself is not this test's

    monkeypatch.setattr(launch, "fit", stop)
    assert main(["train", "--num-workers", "0", "--set", "schedule.steps_per_epoch=200",
                 "--set", f"run.storage_path={tmp_path}"]) == 130
    out = capsys.readouterr().out
    from raymcn.cli import preset_path
    from raymcn.config import load_config

    cfg = load_config(preset_path())  # the embedded default's corpus: data.synthetic_videos at its batch
    steps = cfg.data.synthetic_videos // cfg.data.batch_size
    assert (f"note: schedule.steps_per_epoch=200 is more than the corpus fills: {cfg.data.synthetic_videos} videos "
            f"// data.batch_size={cfg.data.batch_size} = {steps} steps, so each epoch runs {steps}") in out, out


def test_the_settings_page_says_the_corpus_caps_steps_per_epoch():
    row = next(line for line in (ROOT / "docs" / "settings.md").read_text().splitlines()
               if line.startswith("| `schedule.steps_per_epoch` |"))
    assert "at most" in row and "capped" in row, row


# --- the shard plan line ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes, said", [([3], "3 videos"), ([1], "1 video"), ([529, 529], "529 videos each"),
                                         ([529, 529, 471], "529 videos each, the last 471"),
                                         ([4, 6, 5], "4 to 6 videos each")])
def test_the_shard_plan_line_says_what_the_shards_hold(sizes, said):
    from raymcn.data.write.shards import ShardJob, _videos_in

    jobs = [ShardJob(i, f"s{i}", tuple(f"v{j}" for j in range(n)), None) for i, n in enumerate(sizes)]
    assert _videos_in(jobs) == said


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return synthetic.write_corpus(tmp_path_factory.mktemp("corpus"), SETTINGS)


def test_a_small_corpus_is_one_shard_of_its_videos(corpus, tmp_path):
    """A 3-video corpus printed "1 of 1 shards to write (529 videos each, ...)": the size target's
    count, not what the shard holds."""
    lines: list[str] = []
    manifest = shards_of(corpus, tmp_path / "shards", log=lines.append)
    (line,) = [x for x in lines if "to write" in x]
    videos = manifest["counts"]["videos"] + sum(1 for s in manifest["skipped"] if s["shard"])
    assert manifest["counts"]["shards"] == 1
    assert line.startswith(f"shards: 1 of 1 shard to write ({videos} videos, vocabulary of "), line


# --- the dry run refuses what the conversion would ---------------------------------------------------------
def _shards_args(corpus, out: Path, *more: str) -> list[str]:
    return ["shards", "--features", str(corpus.features_root), "--audio-features", str(corpus.audio_root),
            "--captions", str(corpus.captions), "--video-list", str(corpus.video_csv), "--word-vectors",
            str(corpus.word_vectors), "--out", str(out), "--no-progress", "--workers", "1", *more]


def _refused(args: list[str], capsys) -> str:
    assert main(args) == 2
    return capsys.readouterr().err.strip()


def test_the_dry_run_refuses_what_the_conversion_refuses_with_its_words(corpus, tmp_path, monkeypatch, capsys):
    """Each refusal of the conversion, asked of the dry run first: the same status and message, and
    nothing written by either. The guide's step 3 promises an error naming what would not fit."""
    from raymcn.data.write import captions

    written = tmp_path / "written"
    assert main(_shards_args(corpus, written, "--seed", "1")) == 0
    capsys.readouterr()
    cases = {
        "another conversion's shards in --out": (written, ["--seed", "2"], "already holds shards written from other"),
        "a shard size of 0": (tmp_path / "a", ["--shard-size-mb", "0"], "shard size must be positive"),
    }
    for name, (out, more, words) in cases.items():
        before = sorted(p.name for p in out.iterdir()) if out.exists() else None
        dry = _refused(_shards_args(corpus, out, *more, "--dry-run"), capsys)
        real = _refused(_shards_args(corpus, out, *more), capsys)
        assert dry == real and words in dry, (name, dry, real)
        assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before, name
    monkeypatch.setattr(captions, "available_memory", lambda: 1000)  # a caption table that will not fit
    out = tmp_path / "b"
    dry, real = (_refused(_shards_args(corpus, out, *more), capsys) for more in (["--dry-run"], []))
    assert dry == real and "loading the caption table once takes" in dry and not out.exists(), (dry, real)


# --- --resume latest: what a boot would continue, said ------------------------------------------------------
def _folder(root: Path, name: str, marker: str, started: int, *marks: str) -> str:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / marker).write_text("run: {}\n")
    os.utime(folder / marker, (started, started))
    for mark in marks:
        (folder / mark).write_text(f"{mark}\n")
    return str(folder)


def test_resume_latest_continues_the_sweep_a_boot_would_and_names_what_it_skipped(tmp_path, monkeypatch, capsys):
    """After a finished sweep and a rehearsal (``raymcn doctor --rehearse``'s, killed before it could
    mark itself stopped; a ``--rehearse`` of one's own), ``--resume latest`` took the rehearsal; it
    follows the boot's rule and says which it took and which newer ones it left, and why."""
    from raymcn.sweep import tuner

    monkeypatch.setenv("RAYMCN_RESULTS", str(tmp_path))
    wanted = _folder(tmp_path, "sweep-grid-1", SWEEP_CONFIG_FILE, 1000)
    _folder(tmp_path, "sweep-grid-2", SWEEP_CONFIG_FILE, 2000, sweeps.FINISHED_FILE)
    _folder(tmp_path, "sweep-grid-3", SWEEP_CONFIG_FILE, 3000, sweeps.STOPPED_FILE)
    _folder(tmp_path, "sweep-grid-4", SWEEP_CONFIG_FILE, 4000, REHEARSAL_FILE)  # `raymcn sweep --rehearse`
    _folder(tmp_path, "rehearsal-20261201-101010", SWEEP_CONFIG_FILE, 5000)  # the doctor's, never marked
    seen = []
    monkeypatch.setattr(tuner, "sweep_config", lambda exp, option: seen.append(exp) or pytest.fail("stop here"))
    with pytest.raises(pytest.fail.Exception):
        main(["sweep", "--resume", "latest"])
    assert seen == [wanted]
    said = capsys.readouterr().out.splitlines()[0]
    assert said == (f"resuming the latest: {wanted} (the newest raymcn sweep under {tmp_path} that is unfinished, "
                    "not stopped and not a rehearsal); skipped, newer: rehearsal-20261201-101010 (a rehearsal: "
                    "`--resume EXP` continues it), sweep-grid-4 (a rehearsal: `--resume EXP` continues it), "
                    "sweep-grid-3 (stopped on purpose), sweep-grid-2 (finished)"), said
    assert sweeps.unfinished_sweeps(str(tmp_path)) == [wanted]  # the boot's rule is the same one
    sweeps.mark_finished(wanted)
    assert main(["sweep", "--resume", "latest"]) == 2
    err = capsys.readouterr().err
    assert f"--resume latest: no raymcn sweep under {tmp_path} is unfinished, not stopped and not a rehearsal; " \
           "each was skipped: " in err and "sweep-grid-1 (finished)" in err, err


def test_resume_latest_of_a_run_skips_finished_runs_and_rehearsals(tmp_path, monkeypatch, capsys):
    from raymcn.train.on_ray import launch

    monkeypatch.setenv("RAYMCN_RESULTS", str(tmp_path))
    epochs = Config().schedule.epochs
    wanted = _folder(tmp_path, "mcn-joint-1", RUN_CONFIG_FILE, 1000)  # interrupted in epoch 2
    Path(wanted, "metrics.csv").write_text("epoch,total_loss\n1.0,3.0\n")
    done = _folder(tmp_path, "mcn-joint-2", RUN_CONFIG_FILE, 2000)
    Path(done, "metrics.csv").write_text("epoch,total_loss\n" + "".join(f"{e}.0,1.0\n" for e in range(1, epochs + 1)))
    _folder(tmp_path, "mcn-joint-3", RUN_CONFIG_FILE, 3000, REHEARSAL_FILE)
    found, said = launch.latest_run_dir(Config())
    assert found == wanted
    assert said == (f"{wanted} (the newest raymcn run under {tmp_path} that is unfinished and not a rehearsal); "
                    "skipped, newer: mcn-joint-3 (a rehearsal: `--resume RUN_DIR` continues it), mcn-joint-2 "
                    f"(finished: its metrics.csv holds all {epochs} epochs)"), said


def test_a_rehearsed_sweep_and_run_are_marked_as_they_start(tmp_path, monkeypatch):
    """``--rehearse`` writes the mark before anything runs, so a rehearsal killed at any point is one."""
    from raymcn import phases
    from raymcn.train.on_ray import launch

    monkeypatch.setenv("RAYMCN_RESULTS", str(tmp_path))
    marked = []

    def stop(*args, **kwargs):
        marked.extend(str(p.parent) for p in tmp_path.glob(f"*/{REHEARSAL_FILE}"))
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "fit", stop)
    monkeypatch.setattr(phases, "search_then_confirm", stop)
    monkeypatch.setattr("raymcn.cli.ray_session", lambda *a, **k: contextlib.nullcontext(True))  # no Ray here
    monkeypatch.setattr("raymcn.cli._resource_waits_named", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr("raymcn.cli._check_cluster", lambda cfg: None)
    assert main(["train", "--config", "sweeps/smoke.yaml", "--rehearse"]) == 130
    assert main(["sweep", "--config", "sweeps/smoke.yaml", "--rehearse"]) == 130
    assert len(marked) == 1 + 2 and len(set(marked)) == 2  # the run's, then the run's and the sweep's
    assert all(sweeps.is_rehearsal(m) for m in marked)


# --- a clone named raymcn in the folder Python starts in ------------------------------------------------------
def test_a_clone_named_raymcn_beside_python_is_named_not_a_circular_import(tmp_path):
    """Python started in the folder that holds a clone named ``raymcn`` finds the clone before the
    installed package: it imports the installed package, or the error names the folder."""
    (tmp_path / "raymcn").symlink_to(ROOT, target_is_directory=True)  # a clone named raymcn
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a user's shell: not the suite's checkout path
    for statement in ("import raymcn.cli", "import raymcn.train"):
        done = subprocess.run([sys.executable, "-c", f"{statement}; print(raymcn.__file__)"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        if done.returncode == 0:  # an install layout that avoids it: the installed package
            assert not done.stdout.strip().startswith(str(tmp_path)), done.stdout
            continue
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"ImportError: Python imported the folder {tmp_path / 'raymcn'} as the package "
                               "raymcn"), done.stderr[-2000:]
        assert "Start Python from another folder, or rename the clone's folder" in last


# --- what the pages say the code does --------------------------------------------------------------------------
def test_randint_includes_its_upper_bound_as_the_settings_page_says():
    pytest.importorskip("ray")
    from raymcn.reference import reference
    from raymcn.sweep.search_space import to_domain

    domain = to_domain({"randint": [2, 4]})
    assert (domain.lower, domain.upper) == (2, 5)  # Tune's upper bound is exclusive: 2, 3 and 4 drawn
    row = next(line for line in reference().splitlines() if line.startswith("| `randint` |"))
    assert "low <= n <= high" in row, row
    assert row in (ROOT / "docs" / "settings.md").read_text()


def test_the_boot_services_pointer_to_the_guide_names_the_step_that_describes_it():
    unit = (ROOT / "raymcn" / "servers" / "raymcn-boot.service").read_text()
    (step,) = re.findall(r"docs/lab-guide\.md, step (\d+)", unit)
    guide = (ROOT / "docs" / "lab-guide.md").read_text()
    section = guide.split(f"\n### {step}. ", 1)[1].split("\n### ", 1)[0]
    assert "**The boot service**" in section, f"step {step} of the guide does not describe the boot service"


@pytest.mark.parametrize("refused, settings", [
    ("no rung could ever compare trials", {"schedule.stage1_fraction": 0.95}),
    ("its first rung lies past the end of every trial", {"sweep.grace_epochs": 12}),
    ("cannot be swept with", {"sweep.space": {"schedule.epochs": {"choice": [8, 10]}}}),
    ("cannot be swept with", {"sweep.space": {"schedule.stage1_fraction": {"choice": [0.2, 0.5]}}}),
])
@pytest.mark.parametrize("algorithm", ["asha", "bohb"])
def test_what_sweeps_md_says_the_config_refuses_of_an_early_stopping_sweep(algorithm, refused, settings):
    """sweeps.md: "The config refuses an asha or bohb sweep whose clock has no epoch, whose first
    rung lies past every trial's end, or that sweeps schedule.epochs or schedule.stage1_fraction"."""
    from raymcn.cli import preset_path
    from raymcn.config import ConfigError, load_config

    page = " ".join((ROOT / "docs" / "sweeps.md").read_text().split())
    assert ("The config refuses an `asha` or `bohb` sweep whose clock has no epoch, whose first rung lies past every "
            "trial's end, or that sweeps `schedule.epochs` or `schedule.stage1_fraction`") in page
    base = {"schedule.epochs": 10, "schedule.stage1_fraction": 0.1, "sweep.algorithm": algorithm, "sweep.repeats": 1,
            "sweep.space": {"optim.lr": {"loguniform": [1e-4, 1e-2]}}, "sweep.confirm": {}}
    load_config(preset_path(), base)  # the base itself is accepted
    with pytest.raises(ConfigError, match=refused):
        load_config(preset_path(), {**base, **settings})


def test_a_grid_rehearsal_keeps_one_axis_whole_and_the_others_first_value_as_sweeps_md_says():
    from raymcn.sweep.rehearsal import shrink

    page = " ".join((ROOT / "docs" / "sweeps.md").read_text().split())
    assert "(a grid keeps one axis whole, `sweep.confirm`'s `per` or else its first, and the others' first value)" \
        in page
    grid = Config().replace({"sweep.algorithm": "grid", "sweep.confirm": {}, "sweep.space": {
        "schedule.stage_order": {"grid": ["AV_T", "joint"]}, "optim.lr": {"grid": [1e-3, 3e-3]}}})
    assert shrink(grid).sweep.space == {"schedule.stage_order": {"grid": ["AV_T", "joint"]},
                                        "optim.lr": {"grid": [1e-3]}}
    per = grid.replace({"sweep.confirm": {"per": "optim.lr", "repeats": 2}})
    assert shrink(per).sweep.space == {"schedule.stage_order": {"grid": ["AV_T"]}, "optim.lr": {"grid": [1e-3, 3e-3]}}


def test_a_rehearsal_keeps_the_inputs_the_command_line_names(tmp_path, capsys):
    """The practice route's step 7 and 12: the file's own inputs swapped for the synthetic corpus,
    those given with --set kept (Task 1's shards meet Tasks 2 and 3)."""
    import yaml

    assert main(["config", "--config", "sweeps/paper.yaml", "--rehearse"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)["data"]
    assert (data["shards"], data["eval_set"]) == ("", "synthetic")
    assert main(["config", "--config", "sweeps/paper.yaml", "--rehearse", "--set", f"data.shards={tmp_path}/shards",
                 "--set", f"data.eval_set=youcook:{tmp_path}/youcook_val_audio.pkl"]) == 0
    mini = yaml.safe_load(capsys.readouterr().out)
    assert mini["data"]["shards"] == f"{tmp_path}/shards"
    assert mini["data"]["eval_set"] == f"youcook:{tmp_path}/youcook_val_audio.pkl"
    assert mini["scale"]["use_gpu"] is False and mini["data"]["batch_size"] == 8  # still in miniature


def test_the_readmes_sweep_time_is_the_sweep_alone_as_its_benchmark_times_it():
    """The README's figure for `make sweep` comes from bench/sweep_time.py, which times `python
    sweep.py` and nothing of `make`'s install: the README says so."""
    import ast

    tree = ast.parse((ROOT / "bench" / "sweep_time.py").read_text())
    timed = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "run"
             and isinstance(n.args[0], ast.List) and any(isinstance(e, ast.Constant) and e.value == "sweep.py"
                                                          for e in n.args[0].elts)]
    assert timed and "make" not in {e.value for n in timed for e in n.args[0].elts if isinstance(e, ast.Constant)}
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert re.search(r"On 2 CPU cores the sweep took <!-- gen:sweep.wall -->[^<]+<!-- /gen -->, the install before "
                     r"it not counted", readme)
