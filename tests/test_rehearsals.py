"""Every shipped config run as the lab runs it, shrunk only in size (``sweep/rehearsal.py``).

The lab's command lines, on the shipped files: ``raymcn sweep --config FILE`` (here with
``--rehearse``, the one shrinking function), storage from ``RAYMCN_RESULTS`` as on their nodes, in
a process of its own with its own Ray. The sweep rehearsals are also the kill-and-resume tests:
the driver and its Ray are SIGKILLed during the search (a reboot of the head) and the sweep is
continued with ``raymcn sweep --resume EXP`` (a rehearsal is never what ``--resume latest``
continues: a real sweep's is), once per search algorithm a shipped file uses
(random and optuna on stand-in trials: tests/test_sweep_restore.py); it must end with its answer,
the trials finished before the kill untouched. The lab's BOHB file, resumed, is killed twice more in
its confirmation, which must keep its finished runs and end with the answer too (the embedded
default, ``make sweep``, is killed the same way in the soak tier). The verdict is
``results/rehearsal.py``'s, the one ``raymcn doctor --rehearse`` gives.

What each algorithm loses on restore (Ray 2.60), and what that changes in the answer. Tune saves
the searcher's state, not the scheduler's: the scheduler comes back as ``tuner.pkl`` holds it,
from before the first trial, and every restored trial is added to it again (``sweep/tuner.py``).
* grid, random: nothing; the variant generator's position is in Tune's state.
* asha: its rung records start empty, so the trials reporting after the kill are compared only
  with each other.
* bohb: HyperBand's brackets are rebuilt: raymcn's ``SweepBOHB`` leaves finished trials out, and
  the unfinished ones restart in new brackets from their Train checkpoints. TuneBOHB's model is
  saved with the searcher state. A trial HyperBand stopped while paused is restored PAUSED (Tune's
  saved status), run and stopped again: raymcn's searcher lets go of it (Ray's TuneBOHB raises
  KeyError, ``tests/test_sweep.py``).
* optuna: the study is saved with the searcher; a trial running at the kill is re-reported
  ("step already reported" is ignored), so its value is told once.
The answer never depends on what a restore loses: the confirmation retrains each group's best at
the full budget over fresh seeds, and a restored search only changes which configuration that is.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_ray_results import best_trial_and_checkpoint_by_rays_api, reported_best_is_the_best_of_every_epoch
from tune_dirs import result_rows, trial_statuses

from raymcn.cli import preset_path
from raymcn.config import load_config
from raymcn.doctor.verdicts import FREE_DISK_CHECKS
from raymcn.sweep.rehearsal import rehearsal_epochs, shrink

REPO = Path(__file__).resolve().parents[1]
# Every shipped file and how the suite runs it; a file under sweeps/ missing here fails the suite.
SHIPPED = {
    "raymcn/presets/default.yaml": "sweep",  # the embedded default: `make sweep`
    "sweeps/smoke.yaml": "sweep",  # also the README's one-minute `raymcn train` (tests/test_train_ray.py)
    "sweeps/cluster_smoke.yaml": "sweep",
    "sweeps/lr_bs_asha.yaml": "sweep",
    "sweeps/stage_order_bohb.yaml": "sweep",
    "sweeps/paper.yaml": "train",  # on the practice shards: tests/test_practice_route.py (step 7)
    # a Ray cluster launcher file, not a raymcn config: checked against Ray's own schema and its
    # commands by tests/test_cluster_yaml.py
    "sweeps/clusters/gcp-a2-highgpu-4g.yaml": "cluster",
}
CONFIGS = [f for f, how in SHIPPED.items() if how != "cluster"]


def test_every_shipped_file_is_rehearsed():
    shipped = {str(p.relative_to(REPO)) for p in (REPO / "sweeps").rglob("*.yaml")} | {"raymcn/presets/default.yaml"}
    assert shipped == set(SHIPPED), "give every file under sweeps/ a rehearsal in SHIPPED"


# --- the shrinking function: what it keeps (no Ray) -----------------------------------------------------------
@pytest.mark.parametrize("name", CONFIGS)
def test_a_rehearsal_keeps_what_the_lab_chose(name):
    lab = load_config(REPO / name)
    mini = shrink(lab)
    for key in ("sweep.algorithm", "sweep.suggest", "sweep.metric", "sweep.grace_epochs", "sweep.reduction_factor",
                "sweep.max_concurrent", "sweep.max_trial_failures", "schedule.stage1_fraction",
                "schedule.stage_order", "optim.lr", "run.storage_path", "run.name", "run.seed", "scale.max_failures"):
        section, field = key.split(".")
        assert getattr(getattr(mini, section), field) == getattr(getattr(lab, section), field), key
    assert list(mini.sweep.space) == list(lab.sweep.space)
    question = lab.sweep.confirm.get("per") or next(iter(lab.sweep.space), None)
    for key, spec in lab.sweep.space.items():
        (domain, values), (mini_domain, mini_values) = next(iter(spec.items())), next(iter(mini.sweep.space[key].items()))
        if lab.sweep.algorithm == "grid" and key != question:  # a grid's other axes: their first value
            values = values[:1]
        assert mini_domain == domain and len(set(mini_values)) == len(set(values)), key
        if key in ("optim.lr", "schedule.stage_order"):
            assert mini_values == values, key
    assert {k: v for k, v in mini.sweep.confirm.items() if k != "repeats"} == {
        k: v for k, v in lab.sweep.confirm.items() if k != "repeats"}
    assert mini.scale.use_gpu is False and mini.data.shards == "" and mini.data.eval_set == "synthetic"
    # the stage-1 share kept, and (early stopping) a rung and the one after it reached
    assert mini.schedule.epochs == rehearsal_epochs(lab) <= lab.schedule.epochs
    assert mini.stage1_epochs == -(-lab.schedule.stage1_fraction * mini.schedule.epochs // 1)
    if lab.sweep.algorithm in ("asha", "bohb"):
        assert mini.budget_epochs >= lab.sweep.grace_epochs * lab.sweep.reduction_factor


def test_the_bohb_rehearsal_draws_one_band_and_one_more_trial():
    """HyperBand's band as Ray builds it (a bracket per s, ⌈s_max/(s+1)·η^s⌉ trials each)."""
    pytest.importorskip("ray")
    from raymcn.sweep.rehearsal import hyperband_band
    from raymcn.sweep.tuner import build_search

    mini = shrink(load_config(REPO / "sweeps/stage_order_bohb.yaml"))
    _, hb = build_search(mini)
    assert hyperband_band(mini) == sum(hb._get_n0(s) for s in range(hb._s_max_1)) == 4
    assert mini.sweep.num_samples == 5


# --- the rehearsals, killed and resumed (Ray) -----------------------------------------------------------------
def lab_env(results: Path) -> dict[str, str]:
    """The lab's environment: storage from RAYMCN_RESULTS, a Ray of the sweep's own (nothing of the
    suite's own instance's pinning inherited)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_API_SERVER_ADDRESS"}
    return dict(env, RAYMCN_RESULTS=str(results), RAY_ADDRESS="local")


def sweep_folder(results: Path) -> Path | None:
    found = sorted(results.glob("*/raymcn_sweep.yaml"))
    return found[0].parent if found else None


EPOCH_LINE = re.compile(r"^(?P<trial>\S+) epoch (?P<epoch>\d+)/(?P<epochs>\d+)  ")


def epoch_lines(lines: list[str]) -> list[tuple[str, int, int]]:
    """(trial, epoch, epochs) of every per-epoch line the sweep printed so far (in real time:
    Tune copies its result files into the sweep's folder only every so often)."""
    return [(m["trial"], int(m["epoch"]), int(m["epochs"])) for m in map(EPOCH_LINE.match, lines) if m]


def rehearse(args: list[str], results: Path, kill_when=None, timeout: float = 900,
             cwd: Path = REPO) -> tuple[int, str, dict]:
    """``raymcn sweep ARGS`` as the lab runs it, from the checkout ``cwd``; once ``kill_when(exp, lines)``
    (the sweep's folder and its terminal lines so far) is true, its process group (the driver and its
    Ray: the head's reboot) is SIGKILLed, and the result rows in its folder then are returned.
    Returns (exit status or -9, stdout, result rows at the kill)."""
    proc = subprocess.Popen([sys.executable, "-m", "raymcn.cli", "sweep", *args], env=lab_env(results), cwd=cwd,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.time() + timeout
        while proc.poll() is None:
            exp = sweep_folder(results)
            ready = exp is not None and any(exp.glob("experiment_state-*.json"))  # a restore needs one
            if kill_when is not None and ready and kill_when(exp, list(lines)):
                rows = result_rows(exp)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                reader.join(timeout=10)
                return -9, "".join(lines), rows
            assert time.time() < deadline, f"raymcn sweep {' '.join(args)} still running after {timeout:.0f} s"
            time.sleep(0.2)
        reader.join(timeout=30)
        return proc.returncode, "".join(lines), {}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def in_the_search(exp: Path, lines: list[str]) -> bool:
    """A search trial has printed its last epoch, and the search has more: mid-search."""
    from raymcn.sweep.tuner import search_trials

    ended = {t for t, e, n in epoch_lines(lines) if e == n}
    return 0 < len(ended) < search_trials(load_config(exp / "raymcn_sweep.yaml"))


def past_stage_1(exp: Path, lines: list[str]) -> bool:
    """A trial has printed an epoch on the schedulers' clock, and none its last: the search is under
    way (trials that run side by side may all end together)."""
    stage1 = load_config(exp / "raymcn_sweep.yaml").stage1_epochs
    seen = epoch_lines(lines)
    return any(e > stage1 for _, e, _ in seen) and not any(e == n for _, e, n in seen)


def resumed_after_a_pause(exp: Path, lines: list[str]) -> bool:
    """BOHB has paused a trial at a rung and resumed it (it printed the next epoch), and the search
    goes on: the kill then leaves the pause and resume in the sweep's record."""
    from raymcn.results.rehearsal import decisions

    printed = {(t.rsplit("-", 1)[-1], e) for t, e, _ in epoch_lines(lines)}
    return "confirmation:" not in "".join(lines) and any(
        d["decision"] == "PAUSE" and (d["trial"], d["epoch"] + 1) in printed for d in decisions(exp))


def paused_and_resumed_or_every_trial_started(exp: Path, lines: list[str]) -> bool:
    """:func:`resumed_after_a_pause`; or, once every search trial has started and before the
    confirmation, where HyperBand (which decides by the order results arrive in, i.e. by the
    machine's speed) has resumed no paused trial yet: the kill still lands in the search."""
    from raymcn.sweep.tuner import search_trials

    started = {t for t, _, _ in epoch_lines(lines)}
    every = len(started) >= search_trials(load_config(exp / "raymcn_sweep.yaml"))
    return resumed_after_a_pause(exp, lines) or (every and "confirmation:" not in "".join(lines))


REHEARSALS = [  # (sweep file, extra settings, when to kill, then its confirmation killed twice too)
    # grid: the fast tier's one real kill-and-resume of a shipped file
    pytest.param("sweeps/smoke.yaml", [], in_the_search, False, id="grid"),
    # asha with Optuna's suggestions, 4 trials side by side; 6 of them, so that two start on what
    # finished or stopped trials freed while the suite's own Ray instance runs beside the sweep's
    pytest.param("sweeps/lr_bs_asha.yaml", ["sweep.num_samples=6"], past_stage_1, False,
                 marks=[pytest.mark.slow, pytest.mark.soak], id="asha"),
    # the lab's own: the slow tier's kills in a confirmation too (the embedded default's, by hand)
    pytest.param("sweeps/stage_order_bohb.yaml", [], paused_and_resumed_or_every_trial_started, True,
                 marks=pytest.mark.slow, id="bohb"),
]  # random and optuna, which no shipped file uses: on stand-in trials (tests/test_sweep_restore.py)


@pytest.mark.ray
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name, settings, kill_when, confirmation_killed", REHEARSALS)
def test_a_shipped_sweep_killed_in_its_search_resumes_to_its_answer(ray_local, tmp_path, name, settings, kill_when,
                                                                  confirmation_killed, capsys, checkout):
    """``ray_local``: a second Ray instance on the machine for the whole test (the sweep starts its
    own), as a colleague's run or a ``make test`` on the lab's head would be; pinned to its own
    instance, the sweep's placement groups are still freed for the trials that wait for them. Tune's
    results report each trial's best so far over the kill (tests/test_ray_results.py); of the grid,
    whose trials all finish, Ray's API finds the best trial by ``sweep.metric`` and its checkpoint,
    which ``raymcn eval`` scores as the trial did. ``confirmation_killed``: the resume is killed
    twice more in the confirmation (:func:`confirmation_killed_twice`), then runs to its end. The
    sweep runs from a git checkout with an uncommitted change (tests/git_checkout.py): its folder
    and every trial's keep what made them."""
    results = tmp_path / "results"
    args = ["--config", str(checkout.root / name), "--rehearse", *[a for s in settings for a in ("--set", s)]]
    status, out, before = rehearse(args, results, kill_when=kill_when, cwd=checkout.root)
    assert status == -9, f"the sweep ended before it could be killed:\n{out[-3000:]}"
    exp = sweep_folder(results)
    finished = {t for t, s in trial_statuses(exp).items() if s == "TERMINATED"}
    # a rehearsal is never what `--resume latest` (or a boot) continues: it is named by its folder
    skipped = subprocess.run([sys.executable, "-m", "raymcn.cli", "sweep", "--resume", "latest"], env=lab_env(results),
                             cwd=checkout.root, capture_output=True, text=True, timeout=120)
    assert skipped.returncode == 2 and f"{exp.name} (a rehearsal: `--resume EXP` continues it)" in skipped.stderr

    if confirmation_killed:
        out = confirmation_killed_twice(results, ["--resume", str(exp)], cwd=checkout.root)[0]
    else:
        status, out, _ = rehearse(["--resume", str(exp)], results, cwd=checkout.root)
        assert status == 0, out[-3000:]
        assert f"resuming sweep {exp}" in out
        recorded_as_set_up_in_every_trial(exp, checkout, out)  # a start and one resume
    after = result_rows(exp)
    for trial in finished:  # a trial finished before the reboot is kept, not trained again
        assert after[trial] == before[trial], trial
    verdict_ok(exp)  # every search trial ended: none waits forever for what finished trials held
    cfg = load_config(exp / "raymcn_sweep.yaml")
    if cfg.sweep.confirm:
        assert "\nAnswer: " in out, out[-3000:]
    mid_epoch_checkpoints_stay_trains(exp)
    reported_best_is_the_best_of_every_epoch(exp)
    if cfg.sweep.algorithm == "grid":
        best_trial_and_checkpoint_by_rays_api(exp, cfg.sweep.metric, capsys)


def recorded_as_set_up_in_every_trial(exp: Path, checkout, out: str) -> None:
    """The sweep's record: its start and its resume, each from the checkout's commit with its change;
    every trial's: the same, its versions, host and data (``test_train_ray.recorded_as_set_up``). The
    sweep's end names the commit once, with its uncommitted changes."""
    from test_train_ray import recorded_as_set_up

    from raymcn.provenance import record

    sweep = record.drivers(record.read(str(exp)))
    assert [e["entry"] for e in sweep] == ["start", "resume"]
    assert {(e["code"]["commit"], e["code"]["dirty"]) for e in sweep} == {(checkout.commit, True)}
    runs = sorted((exp / "train").glob("train-*")) + sorted((exp / "confirm" / "train").glob("train-*"))
    assert runs
    for run in runs:
        recorded_as_set_up(run, checkout, out, trial=run.name.removeprefix("train-"))
    assert out.count(f"commit {checkout.commit[:7]}") == 1 and f"code: commit {checkout.commit[:7]} with uncommitted " \
        "changes" in out


def mid_epoch_checkpoints_stay_trains(exp: Path) -> None:
    """The miniature checkpoints after every step (the file's interval, shrunk): Tune's results
    still hold one report per epoch (what its schedulers count), none of the mid-epoch ones."""
    rows = [json.loads(x) for f in exp.glob("*/result.json") for x in f.read_text().splitlines() if x.strip()]
    assert rows and not any("mid_epoch" in r for r in rows)


def verdict_ok(exp: Path) -> None:
    from raymcn.results.rehearsal import rehearsal_checks
    from raymcn.sweep.tuner import search_trials

    cfg = load_config(exp / "raymcn_sweep.yaml")
    checks = rehearsal_checks(exp, cfg, search_trials(cfg))
    assert all(c.ok is not False for c in checks), "\n".join(f"{c.name}: {c.ok} {c.detail}" for c in checks)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(900)
def test_the_cluster_smoke_sweep_runs_to_its_end_and_its_terminal_reads_well(tmp_path):
    """The lab's smoke sweep, each configuration over 2 seeds, one trial's run crashing once after
    epoch 1 (Ray Train restarts it from its checkpoint). The terminal: a start line per trial, one
    line per trial-epoch, status tables, no line twice, at most 80 lines before the results, none
    wider than 160 characters; Ray's output and the crash's traceback only in the console log.
    The repeats pair: a paired t-test over 2 seeds."""
    results = tmp_path / "results"
    os.environ.update(RAYMCN_FAULT="raise_after_epoch=1", RAYMCN_FAULT_DIR=str(tmp_path / "faults"))
    try:
        status, out, _ = rehearse(["--config", str(REPO / "sweeps/cluster_smoke.yaml"), "--rehearse", "--json",
                                   "--set", "sweep.repeats=2", "--set", "sweep.status_every=30"], results)
    finally:
        del os.environ["RAYMCN_FAULT"], os.environ["RAYMCN_FAULT_DIR"]
    assert status == 0, out[-3000:]
    exp = sweep_folder(results)
    verdict_ok(exp)
    lines = out.splitlines()
    end = next(i for i, line in enumerate(lines) if re.match(r"^search: 4 trials \(0 errored\) in ", line))
    head = [line for line in lines[:end] if line.strip()]
    assert len(head) <= 80 and len(head) == len(set(head)), "\n".join(head)
    # raymcn's own lines fit a terminal (Ray's warnings, relayed as they are, aside; the experiment's
    # folder and the results folder counted as 3 characters: their length is the user's)
    width = {line: len(line.replace(str(exp), "EXP").replace(str(results), "RES")) for line in head}
    wide = [line for line, n in width.items() if n > 160 and not line.startswith("Ray ")]
    assert not wide, wide
    starts = [line for line in head if line.startswith("trial ") and " started: " in line]
    epochs = [(t, e) for t, e, _ in epoch_lines(head)]
    assert len(starts) == 4 and len(epochs) == 8 and sorted(epochs) == sorted({(t, e) for t, _ in epochs for e in (1, 2)})
    assert any(line.startswith("status after ") for line in head)
    log = (exp / "raymcn_console.log").read_text()
    for chatter in ("TrainingReport", "InjectedFault", "Execution plan of Dataset"):
        assert chatter in log and chatter not in out, chatter
    assert (tmp_path / "faults" / "fired-raise_after_epoch").exists()  # the crash did happen
    # the repeats pair across stage orders: same run.seed, nothing else swept
    header = next(line for line in lines[end:] if line.startswith("| schedule.stage_order |"))
    stats = next(line for line in lines[end:] if line.startswith(("| VT_A |", "| joint |")) and "paired t" in line)
    assert stats.split("|")[[c.strip() for c in header.split("|")].index("pairs")].strip() == "2", stats
    # the end reads on one screen: no line wider than the results' limit, the wide tables in CSV files
    tail = lines[end:-1]  # (the experiment's folder counted as 3 characters: its length is the user's)
    assert max(len(line.replace(str(exp), "EXP")) for line in tail) <= 160 and len(tail) <= 40, "\n".join(tail)
    assert (exp / "tables" / "search_trials.csv").exists()


def confirmation_killed_twice(results: Path, args: list[str], cwd: Path = REPO) -> tuple[str, dict, dict]:
    """``raymcn sweep ARGS`` (a rehearsal, or ``--resume EXP`` of one) with its driver and Ray killed
    twice in its confirmation: as it prints its first line (so far always before Tune had saved the
    confirmation's state: Ray's restore of such a folder ran one of the runs and ended as if done),
    then once a confirmation run has finished; then resumed to its end. The resumes keep the search
    and the finished runs, train the rest, and each group's runs train the configuration the search
    chose for it (one of the group's search trials) over the same fresh seeds. Returns the last
    resume's output, and the search's and the confirmation's result rows (trial -> epochs)."""
    from raymcn.results.confirmation import read_plan
    from raymcn.results.experiment import load_experiment

    def confirmation_begins(exp: Path, lines: list[str]) -> bool:
        return "confirmation:" in "".join(lines)

    def a_confirmation_run_ended(exp: Path, lines: list[str]) -> bool:
        # resumed: every run that prints is the confirmation's (its first line is printed again
        # only when the confirmation starts again)
        epochs = load_config(exp / "raymcn_sweep.yaml").schedule.epochs
        confirming = "".join(lines).split("confirmation:", 1)[-1]
        return any(e == epochs for _, e, _ in epoch_lines(confirming.splitlines()))

    status, out, _ = rehearse(args, results, kill_when=confirmation_begins, cwd=cwd)
    assert status == -9, f"the sweep ended before its confirmation could be interrupted:\n{out[-3000:]}"
    exp = sweep_folder(results)
    assert args[0] != "--resume" or f"resuming sweep {exp}" in out, out[-3000:]
    status, out, _ = rehearse(["--resume", str(exp)], results, kill_when=a_confirmation_run_ended, cwd=cwd)
    assert status == -9, f"the resumed sweep ended before its confirmation could be interrupted:\n{out[-3000:]}"
    confirm = exp / "confirm"
    finished = [t for t, s in trial_statuses(confirm).items() if s == "TERMINATED"]
    search_before, confirm_before = result_rows(exp), result_rows(confirm)
    cfg = load_config(exp / "raymcn_sweep.yaml")
    epochs = list(range(1, cfg.schedule.epochs + 1))
    assert set(trial_statuses(exp).values()) == {"TERMINATED"}  # the search had ended

    status, out, _ = rehearse(["--resume", str(exp)], results, cwd=cwd)
    assert status == 0, out[-3000:]
    assert result_rows(exp) == search_before  # the finished search was not touched
    after = result_rows(confirm)
    _, candidates, seeds = read_plan(exp)
    assert set(trial_statuses(confirm).values()) == {"TERMINATED"} and len(after) == len(candidates) * len(seeds)
    for t in finished:
        assert after[t] == confirm_before[t] == epochs  # kept, not rerun
    assert seeds == [cfg.run.seed + 1, cfg.run.seed + 2]  # fresh: the search ran run.seed
    per = cfg.sweep.confirm["per"]
    search, _ = load_experiment(exp)
    runs = [json.loads((d / "params.json").read_text()) for d in confirm.iterdir() if (d / "params.json").exists()]
    for c in candidates:  # each group's runs: one of its search trials' configurations, over the same seeds
        assert set(c.config) == set(cfg.sweep.space) and c.config[per] == c.group
        chosen = search[search[per] == c.group].to_dict("records")
        assert any(all(row[k] == v for k, v in c.config.items()) for row in chosen), (c, chosen)
        mine = [r for r in runs if r[per] == c.group]
        assert sorted(r["run.seed"] for r in mine) == seeds
        assert all(r[k] == v for r in mine for k, v in c.config.items()), (c, mine)
    # the closing heading: its seeds apart from its count of runs ("seeds 2, 3, 8 of 8" read as three seeds)
    n = len(after)
    assert f"by {per}, confirmation over seeds {seeds[0]} and {seeds[1]}: {n} of {n} runs done" in out
    assert "\nAnswer: " in out
    assert (exp / "best_by_stage_order.png").exists() and (exp / "search_best_by_stage_order.png").exists()
    verdict_ok(exp)
    return out, search_before, after


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.soak  # the slow tier kills the lab's BOHB file in its confirmation the same way (REHEARSALS)
@pytest.mark.timeout(1200)
def test_make_sweep_killed_in_its_confirmation_resumes_it(tmp_path):
    """The embedded default (``make sweep``), its driver and Ray killed twice in its confirmation
    (:func:`confirmation_killed_twice`): its grid's 4 search trials, each to its last epoch, and
    its 8 confirmation runs (4 orders over 2 seeds), each the search's learning rate for its order."""
    cfg = shrink(load_config(preset_path()))
    _, search, confirmed = confirmation_killed_twice(tmp_path / "results", ["--rehearse"])
    epochs = list(range(1, cfg.schedule.epochs + 1))
    assert len(search) == 4 and all(rows == epochs for rows in search.values())
    assert len(confirmed) == 8


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.soak  # a sweep and its confirmation: minutes past CI's 90 (test_sweep_metric.py: the fast tier's part)
@pytest.mark.timeout(900)
def test_a_shipped_sweep_by_the_median_rank_answers_by_the_lowest(tmp_path):
    """``raymcn sweep --config sweeps/smoke.yaml --rehearse --set sweep.metric=<the median rank>``,
    confirmed per stage order (the lab's question: the answer line comes from a confirmation, which
    the smoke file has none of). The epoch lines show the median rank; each trial's best is its
    lowest, the search's table runs lowest first, the answer names the order of the lowest mean,
    and the sweep's best run (``--json``) is one with the lowest."""
    from raymcn.results.experiment import load_experiment

    results, medr = tmp_path / "results", "text_to_video_MedR"
    status, out, _ = rehearse(["--config", str(REPO / "sweeps/smoke.yaml"), "--rehearse", "--json",
                               "--set", f"sweep.metric=best_{medr}",
                               "--set", "sweep.confirm={per: schedule.stage_order, repeats: 2}"], results)
    assert status == 0, out[-3000:]
    exp, lines = sweep_folder(results), out.splitlines()
    epochs = [line for line in lines if EPOCH_LINE.match(line)]
    assert len(epochs) == 12 and all("  MedR " in line and "R@10" not in line for line in epochs), epochs
    search, curves = load_experiment(exp)
    assert search.set_index("trial")[f"best_{medr}"].to_dict() == curves.groupby("trial")[medr].min().to_dict()
    assert search[f"best_{medr}"].is_monotonic_increasing
    confirmed, _ = load_experiment(exp / "confirm")
    assert len(confirmed) == 4 and set(confirmed["status"]) == {"done"}
    means = confirmed.groupby("schedule.stage_order")[f"best_{medr}"].mean()
    assert f"best_{medr} by schedule.stage_order, confirmation over seeds 2 and 3: 4 of 4 runs done" in out
    answer = out[out.index("\nAnswer: ") + 1:].split("\n\n")[0]
    order = answer.split()[1]
    assert means[order] == means.min(), (answer, means)
    assert answer.startswith(f"Answer: {order} learns the best joint space by best_{medr}: {means.min():.1f}, ")
    best = json.loads(lines[-1])["best_config"]
    mine = confirmed[(confirmed["schedule.stage_order"] == best["schedule.stage_order"])
                     & (confirmed["run.seed"] == best["run.seed"])]
    assert mine[f"best_{medr}"].tolist() == [confirmed[f"best_{medr}"].min()]


def test_the_default_preset_is_what_make_sweep_runs():
    assert preset_path() == REPO / "raymcn/presets/default.yaml"


# --- raymcn doctor --rehearse ------------------------------------------------------------------------------------
def lab_inputs() -> list[str]:
    """``--set`` arguments that point the lab's file at inputs and devices that exist here: the
    synthetic corpus as shards and as a YouCook2 pickle, CPU workers (the doctor checks the file's
    own inputs and GPUs on every node besides rehearsing it; everything else stays the lab's)."""
    from raymcn.data.synthetic import CorpusPaths, ensure_corpus, ensure_synthetic_shards

    mini = shrink(load_config(REPO / "sweeps/stage_order_bohb.yaml"))
    youcook = CorpusPaths(ensure_corpus(mini)).youcook_eval
    return ["--set", f"data.shards={ensure_synthetic_shards(mini)}", "--set", f"data.eval_set=youcook:{youcook}",
            "--set", "scale.use_gpu=false"]  # this machine has none: the doctor's GPU rows would say so


# what the doctor's rehearsal of the lab's file must show (tests/test_multinode.py runs it on the cluster)
REHEARSAL_ROWS = {"rehearsal ran to its end", "rehearsal: search: every trial ended",
                  "rehearsal: early stopping at the rungs", "rehearsal: BOHB: a paused trial resumed at its next epoch",
                  "rehearsal: a killed trial driver resumed", "rehearsal: confirmation: every run ended",
                  "rehearsal: answer line"}


def rehearsal_rows(report: dict) -> dict[str, dict]:
    (head,) = [c for c in report["rows"] if "(head)" in c] or list(report["rows"])[:1]
    return {r["check"]: r for r in report["rows"][head] if r["check"].startswith("rehearsal")}


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sweep_that_crashes_in_miniature_fails_the_rehearsal_naming_why(ray_local, tmp_path, monkeypatch, capsys):
    """The lab's file with the schedulers' clock as it was (negative in stage 1, which HyperBand
    refuses): the doctor's rehearsal row fails and names the error, instead of the sweep dying on
    the lab's servers after its first epoch. And a scheduler whose first rung lies past the end of
    every trial is refused before anything runs, naming the settings."""
    from raymcn.cli import main
    from raymcn.sweep import tuner

    class OldClock(tuner.SweepBOHB):  # the clock before the fix: epoch - stage-1 epochs, negative in stage 1
        def on_trial_result(self, tune_controller, trial, result):
            return super().on_trial_result(tune_controller, trial, {**result, "budget_epoch": result["epoch"] - 2})

    monkeypatch.setattr(tuner, "SweepBOHB", OldClock)
    monkeypatch.setenv("RAYMCN_RESULTS", str(tmp_path / "results"))
    bohb = str(REPO / "sweeps/stage_order_bohb.yaml")
    assert main(["doctor", "--rehearse", "--json", "--config", bohb, *lab_inputs()]) == 1
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    row = rehearsal_rows(report)["rehearsal ran to its end"]
    # only the rehearsal fails; the free-disk rows are this machine's disk against the lab's file's
    # checkpoints (tens of GB at the paper's size), which a test cannot choose (tests/test_doctor.py tests them)
    others = [r for rows in report["rows"].values() for r in rows
              if not r["check"].startswith("rehearsal") and r["check"] not in FREE_DISK_CHECKS]
    assert all(r["ok"] is not False for r in others), others
    assert row["ok"] is False and "AssertionError" in row["detail"] + row["fix"], row
    assert "✘ rehearsal ran to its end: the sweep file fails in miniature" in out

    assert main(["doctor", "--rehearse", "--config", bohb, *lab_inputs(), "--set", "sweep.grace_epochs=7"]) == 2
    err = capsys.readouterr().err
    assert "sweep.grace_epochs=7: schedule.epochs=12 with schedule.stage1_fraction=0.5 leaves 6 epochs" in err
