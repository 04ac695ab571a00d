"""``raymcn watch`` on experiment directories written the way Tune writes them (no Ray, trial
directories named by ``sweep.names.trial_dirname`` as Tune now names them): the console contract
of ``--once``, refreshes that pick up new trials, plots rewritten only on change, a clean stop on
Ctrl-C."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from types import SimpleNamespace as Plan  # the three figures Progress reads from a run's plan

import pytest
from tune_dirs import curve, write_sweep_yaml, write_trial

from raymcn.results.watch import CLEAR, add_watch_arguments, run_watch
from raymcn.sweep.names import trial_dirname

EPOCHS = 6


@pytest.fixture()
def exp(tmp_path):
    """A sweep half-way: 2 seeds × joint/AV_T done, an AV_T seed-3 trial running (Tune's state says
    so), a VT_A trial errored before its first report."""
    exp = tmp_path / "sweep-live"
    write_sweep_yaml(exp, EPOCHS, stage1_fraction=0.5)
    (exp / "train").mkdir()  # the sweep's Train storage: not a trial
    finals = {("joint", 1): 30.0, ("joint", 2): 34.0, ("AV_T", 1): 27.0, ("AV_T", 2): 30.0}
    for i, ((order, seed), final) in enumerate(finals.items()):
        params = {"schedule.stage_order": order, "optim.lr": 1e-3, "run.seed": seed}
        tid = f"c0ffe_{i:05d}"
        write_trial(exp, trial_dirname(params, tid), tid, params, curve(final, EPOCHS, None if order == "joint" else 3))
    running = {"schedule.stage_order": "AV_T", "optim.lr": 1e-3, "run.seed": 3}
    write_trial(exp, trial_dirname(running, "c0ffe_00004"), "c0ffe_00004", running, curve(40, EPOCHS, 3)[:4],
                partial_line=True)
    errored = {"schedule.stage_order": "VT_A", "optim.lr": 1e-3, "run.seed": 1}
    write_trial(exp, trial_dirname(errored, "c0ffe_00005"), "c0ffe_00005", errored, [], error=True)
    state = {"trial_data": [[json.dumps({"trial_id": "c0ffe_00004", "status": "PENDING"}), "{}"]]}
    (exp / "experiment_state-2026-01-01_00-00-00.json").write_text(json.dumps(state))
    return exp


def watch(argv, **kw) -> tuple[int, str]:
    out = kw.pop("out", io.StringIO())
    args = add_watch_arguments(argparse.ArgumentParser()).parse_args(argv)
    code = run_watch(args, out=out, clock=lambda: "12:00:00", **kw)
    return code, out.getvalue()


def test_once_console_contract(exp):
    code, out = watch([str(exp), "--once"])
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"raymcn watch {exp}  (12:00:00)"
    assert lines[1] == "6 trials: 4 done, 0 stopped, 1 running, 1 error"
    header = [c.strip() for c in lines[3].strip("|").split("|")]
    assert header == ["trial", "status", "epochs", "schedule.stage_order", "optim.lr", "run.seed",
                      "final_text_to_video_R@10", "best_text_to_video_R@10", "best_text_to_video_MedR",
                      "total_loss", "samples_per_s"]
    rows = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[5:11])}
    assert rows["c0ffe_00004"][1:3] == ["running", "4"]  # its half-written last line is skipped
    assert rows["c0ffe_00000"][1:3] == ["done", "6"]
    assert "best_text_to_video_R@10 by schedule.stage_order:" in lines
    stats = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines)
             if r[0] in ("joint", "AV_T", "VT_A")}
    # trials, stopped early, n (full budget); test, pairs
    assert stats["AV_T"][1:4] == ["3", "0", "2"] and stats["AV_T"][8:10] == ["paired t", "2"]
    assert stats["VT_A"][1:4] == ["1", "0", "0"]
    notes = " ".join(out.split())  # the notes are wrapped at 100 columns
    assert "- AV_T: n = 2: interval uses t(0.975, 1) = 12.71, hence wide; 1 running trial not counted" in notes
    assert "- VT_A: no trial with a value at the full budget; 1 errored trial not counted" in out
    assert lines[-3:] == [f"plots rewritten at 12:00:00: learning_curves.png, best_by_stage_order.png in {exp}",
                          "skipped metric_vs_lr.png: optim.lr has a single value",
                          f"TensorBoard: tensorboard --logdir {exp}"]
    assert CLEAR not in out and "Ctrl-C" not in out  # --once prints one plain frame
    for png in ("learning_curves.png", "best_by_stage_order.png"):
        assert (exp / png).stat().st_size > 5000


def test_refreshes_pick_up_new_trials_and_stop_cleanly_on_ctrl_c(exp):
    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 1:  # between refresh 1 and 2 a new trial starts
            params = {"schedule.stage_order": "VT_A", "optim.lr": 1e-3, "run.seed": 2}
            write_trial(exp, trial_dirname(params, "c0ffe_00006"), "c0ffe_00006", params, [1.0])
        elif len(sleeps) == 3:
            raise KeyboardInterrupt  # the person presses Ctrl-C while the view waits

    code, out = watch([str(exp), "--interval", "2.5"], sleep=sleep)
    assert code == 0 and sleeps == [2.5, 2.5, 2.5]
    frames = out.split("raymcn watch ")[1:]
    assert len(frames) == 3
    assert "c0ffe_00006" not in frames[0] and "c0ffe_00006" in frames[1]
    assert "plots rewritten" in frames[0] and "plots rewritten" in frames[1]
    assert "plots unchanged" in frames[2]  # nothing reported since the second refresh
    assert all("refresh every 2.5 s; Ctrl-C to stop" in f for f in frames)
    assert out.endswith(f"\nstopped watching {exp}\n") and "Traceback" not in out
    assert not list(exp.glob(".*.tmp"))


def test_sweep_with_nothing_finished_yet(tmp_path):
    exp = tmp_path / "sweep-young"
    write_sweep_yaml(exp, EPOCHS)
    for i, order in enumerate(("joint", "AV_T")):
        params = {"schedule.stage_order": order, "run.seed": 1}
        write_trial(exp, trial_dirname(params, f"b_{i}"), f"b_{i}", params, curve(30, EPOCHS, 3)[:2])
    state = {"trial_data": [[json.dumps({"trial_id": f"b_{i}", "status": "RUNNING"}), "{}"] for i in range(2)]}
    (exp / "experiment_state-2026-01-01_00-00-00.json").write_text(json.dumps(state))
    code, out = watch([str(exp), "--once", "--no-plots"])
    assert code == 0 and out.splitlines()[1] == "2 trials: 0 done, 0 stopped, 2 running, 0 error"
    assert "best_text_to_video_R@10 by schedule.stage_order:\n\nno trial with a value at the full budget yet" in out


def test_terminal_gets_each_refresh_on_a_cleared_screen(exp):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    def stop(_):
        raise KeyboardInterrupt

    code, out = watch([str(exp), "--no-plots"], sleep=stop, out=Tty())
    assert code == 0 and out.startswith(CLEAR + "raymcn watch ") and "plots" not in out


def test_waits_for_first_trial_and_rejects_bad_input(tmp_path, capsys):
    empty = tmp_path / "sweep-starting"
    empty.mkdir()
    code, out = watch([str(empty), "--once"])
    assert code == 0 and "waiting for the sweep's first trial" in out
    assert watch([str(tmp_path / "nope"), "--once"])[0] == 2
    assert "nope does not exist" in capsys.readouterr().err
    write_trial(empty, "t", "t1", {"optim.lr": 1e-3}, [1.0])
    assert watch([str(empty), "--once", "--group-by", "loss.margin"])[0] == 2
    assert "cannot group by 'loss.margin'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        add_watch_arguments(argparse.ArgumentParser()).parse_args([str(empty), "--interval", "0"])


def test_cli_has_watch(exp):
    code = subprocess.run([sys.executable, "-m", "raymcn.cli", "watch", str(exp), "--once", "--no-plots"],
                          capture_output=True, text=True)
    assert code.returncode == 0, code.stderr
    assert code.stdout.startswith(f"raymcn watch {exp}  (") and "6 trials:" in code.stdout


def test_running_trials_show_where_they_are_inside_the_epoch(exp):
    """A running trial's run writes its progress mark (train/monitor/in_epoch.py, the writer itself); watch
    shows that mark's line under the table, finished trials none, and the mark's age."""
    from raymcn.train.monitor.in_epoch import Progress

    now = [1000.0]
    run_dir = exp / "train" / "train-c0ffe_00004"
    progress = Progress(str(run_dir), Plan(steps_per_epoch=9100, epochs=30, clips_per_step=4096), every_s=0, say=None,
                        clock=lambda: now[0])
    progress.restart_clock(4 * 9100)
    for step in range(4 * 9100 + 1, 4 * 9100 + 4521):
        now[0] += 0.5  # 2 steps/s: 8192 samples/s
        progress.step(step)
    progress.write(4 * 9100 + 4520)
    progress.flush()
    code, out = watch([str(exp), "--once", "--no-plots"])
    inside = out.splitlines()[out.splitlines().index("inside the epoch (running trials):") + 1:]
    assert code == 0 and inside[0].startswith("trial c0ffe_00004: epoch 5/30  step 4520/9100  8192 samples/s  "
                                               "epoch ETA 38m  run ETA 1d08h")
    assert inside[0].endswith(" s ago)") and not any("c0ffe_00000" in line for line in inside)
