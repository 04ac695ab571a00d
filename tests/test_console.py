"""The console contract, without Ray: what reaches the terminal and what goes to the log.

The end-to-end check (a real sweep's terminal: line budget, no line twice, the epoch lines, Ray's
chatter in the log) is ``tests/test_sweep_console.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from raymcn.config import DEFAULT_OBJECTIVE, metric, objective
from raymcn.train.monitor.console import TAG, epoch_line

R10 = objective(DEFAULT_OBJECTIVE).metric  # what the default sweep's lines show

EPOCH_LINE = re.compile(r"^(?:(?P<name>\S+) )?epoch (?P<epoch>\d+)/(?P<epochs>\d+)  R@10 +(?P<r10>[\d.]+)  "
                        r"loss (?P<loss>\S+)  (?P<rate>\d+) samples/s$")


def test_epoch_line_format():
    m = {"text_to_video_R@10": 18.359375, "total_loss": 31.953, "samples_per_s": 205.4, "lr": 1e-3}
    assert epoch_line(3, 6, m, R10, name="AV_T-seed1-x_00001", workers=2) == \
        "AV_T-seed1-x_00001 epoch 3/6  R@10 18.36  loss 31.95  411 samples/s"
    assert EPOCH_LINE.match(epoch_line(3, 6, m, R10, workers=2)).group("rate") == "411"
    assert epoch_line(1, 2, {"samples_per_s": 10.0}, R10) == "epoch 1/2  10 samples/s per worker"  # nothing made up


def test_the_epoch_line_shows_the_sweeps_metric_in_its_format():
    """sweep.metric = the median rank: the line shows MedR with the table's one decimal, not R@10."""
    m = {"text_to_video_R@10": 18.359375, "text_to_video_MedR": 7.5, "total_loss": 31.953}
    assert epoch_line(3, 6, m, metric("text_to_video_MedR")) == "epoch 3/6  MedR   7.5  loss 31.95"


SCRIPT = textwrap.dedent(r"""
    import logging, os, subprocess, sys, time
    from raymcn.train.monitor.console import Console, tagged
    log = sys.argv[1]
    logging.basicConfig()  # a handler writing to stderr, as Ray's loggers have
    print("before the console")
    with Console(log, verbose=sys.argv[2] == "1", show_tagged=True) as c:
        c.say("raymcn line")
        print("(RayTrainWorker pid=1) TrainingReport(metrics={...}) from rank 1")
        os.write(2, b"[core_worker.cc:2465] C-level chatter\n")
        print("(RayTrainWorker pid=7) " + tagged("epoch 1/2  R@10 30.00"), flush=True)
        print("(RayTrainWorker pid=7) " + tagged("epoch 1/2  R@10 30.00"), file=sys.stderr, flush=True)
        subprocess.run(["echo", "a child process"], check=True)
        logging.getLogger("ray.tune").warning("a deprecation warning")
        logging.getLogger("ray.tune").info("an info line")
        logging.getLogger("ray").error("Trial task failed for trial t1")
        time.sleep(0.2)
    print("after the console")
""")


def _run(tmp_path, verbose: bool) -> tuple[str, str, str]:
    log = tmp_path / "sub" / "console.log"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(log), "1" if verbose else "0"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stderr, log.read_text()


def test_terminal_gets_raymcn_lines_tagged_lines_once_and_errors(tmp_path):
    out, err, log = _run(tmp_path, verbose=False)
    assert out.splitlines() == ["before the console", "raymcn line", "epoch 1/2  R@10 30.00", "after the console"]
    assert "Trial task failed for trial t1" in err  # errors are never hidden
    for chatter in ("TrainingReport", "C-level chatter", "a child process", "a deprecation warning"):
        assert chatter not in out + err
        assert chatter in log  # ... but kept in the log
    assert "raymcn line" in log and log.count(TAG) == 2


def test_verbose_shows_everything_and_still_logs(tmp_path):
    out, err, log = _run(tmp_path, verbose=True)
    for text in ("TrainingReport", "C-level chatter", "a child process", "a deprecation warning", "Trial task failed"):
        assert text in out + err and text in log


# A rank's line under Ray Train's print patch, as a worker process has it: stdout is not the process's
# own (Ray wraps it) and the root logger has Train's console handler, writing where stdout goes.
RANK_UNDER_TRAINS_PATCH = """
import builtins, io, logging, sys
from ray.train.v2._internal.logging import patch_print
from raymcn.train.on_ray.worker import Printer

out = io.StringIO()
sys.stdout = out
handler = logging.StreamHandler(out)
logging.getLogger().addHandler(handler)
logging.getLogger().setLevel(logging.INFO)
patch_print.patch_print_function()
assert builtins.print is patch_print.redirected_print  # Ray Train's own, as in its workers
rank0 = Printer(rank=0)
rank0.say("epoch 1/4  R@10 3.91")
rank0.log("epoch 1 step 16/64")
rank0.progress("epoch 1/4  step 2/16")
Printer(rank=1).each("1 torch thread(s)")
Printer(rank=1).alert("STALL")
print("a plain print")
sys.__stdout__.write(out.getvalue())
"""


def test_a_ranks_lines_are_written_once_under_ray_trains_print_patch():
    """Ray Train makes a worker's ``print`` print the line and log it: both copies reach the driver,
    which wrote every worker line twice into raymcn_console.log. A rank's lines go around it, once."""
    pytest.importorskip("ray")
    proc = subprocess.run([sys.executable, "-c", RANK_UNDER_TRAINS_PATCH], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for line in (f"{TAG}epoch 1/4  R@10 3.91", "epoch 1 step 16/64", "[raymcn progress] epoch 1/4  step 2/16",
                 "rank 1: 1 torch thread(s)", "[raymcn alert] STALL"):
        assert lines.count(line) == 1, lines
    assert lines.count("a plain print") == 2, lines  # the patch's doing: what a plain print would have given


# --- the sweep's progress callback, on fake trials ----------------------------------------------------
class FakeConsole:
    def __init__(self):
        self.lines: list[tuple[str, bool]] = []

    def say(self, line: str, err: bool = False) -> None:
        self.lines.append((line, err))


def _trial(tid, order, status="RUNNING"):
    return SimpleNamespace(trial_id=tid, config={"schedule.stage_order": order, "run.seed": 1}, status=status,
                           error_file=None, path="", error_msg="")


@pytest.fixture
def progress(tmp_path):
    pytest.importorskip("ray")
    from raymcn.cli import preset_path
    from raymcn.config import load_config
    from raymcn.sweep.trial_lines import SweepProgress

    console = FakeConsole()
    return SweepProgress(console, load_config(preset_path()), str(tmp_path), status_every=0), console


def test_progress_prints_each_trial_epoch_once(progress):
    p, console = progress
    t = _trial("abc_00000", "AV_T")
    p.on_trial_start(0, [t], t)
    for epoch in (1, 2, 2, 3):  # epoch 2 again, as a restored trial reports it
        p.on_trial_result(0, [t], t, {"epoch": epoch, "text_to_video_R@10": 10.0 * epoch, "total_loss": 3.0,
                                      "samples_per_s": 100.0})
    p.on_trial_result(0, [t], t, {"done": True})  # Tune's bookkeeping rows have no epoch
    p.on_trial_start(0, [t], t)  # BOHB resumes a paused trial
    lines = [line for line, _ in console.lines]
    assert lines[0] == "trial AV_T-seed1-abc_00000 started: run.seed=1, schedule.stage_order=AV_T"
    assert [EPOCH_LINE.match(line).group("epoch") for line in lines[1:4]] == ["1", "2", "3"]
    assert EPOCH_LINE.match(lines[1]).group("epochs") == "4" and lines[1].endswith(" 200 samples/s")  # 2 workers
    assert lines[4].startswith("trial AV_T-seed1-abc_00000 resumed") and len(lines) == 5


def test_progress_status_table_and_errors(progress, tmp_path):
    from raymcn.config import TRIAL_ERRORS_DIR

    p, console = progress
    a, b, c = _trial("x_00000", "AV_T"), _trial("x_00001", "joint", "TERMINATED"), _trial("x_00002", "VT_A", "PENDING")
    for t in (a, b):
        p.on_trial_start(0, [a, b, c], t)
    p.on_trial_result(0, [a, b, c], b, {"epoch": 2, "text_to_video_R@10": 41.5})
    head, columns, *rows = p.status_table([a, b, c], 125.0)
    assert head == "status after 2m05s: 1 running, 1 done, 1 pending; best R@10 41.50 (joint-seed1-x_00001)"
    assert columns.split() == ["trial", "status", "epoch", "R@10", "best", "for"] and len(rows) == 2  # pending: counted
    assert rows[1].split()[:5] == ["joint-seed1-x_00001", "done", "2", "41.50", "41.50"]
    assert p.status_table([a, b, c], 130.0) == []  # nothing changed: no table
    p.on_trial_result(0, [a, b, c], a, {"epoch": 1, "text_to_video_R@10": 5.0})
    head, *rows = p.status_table([a, b, c], 135.0)  # the column names only head the first table
    assert head.startswith("status after 2m15s: ")
    assert [r.split()[:4] for r in rows] == [["AV_T-seed1-x_00000", "running", "1", "5.00"]]  # done: shown once
    # a permanent error ends a trial "normally" in Tune: the progress still says so, on stderr
    (tmp_path / TRIAL_ERRORS_DIR).mkdir()
    (tmp_path / TRIAL_ERRORS_DIR / "x_00000.txt").write_text("NonFiniteLossError: loss non-finite\n")
    p.on_trial_complete(0, [a, b, c], a)
    p.on_trial_complete(0, [a, b, c], b)  # no error file: nothing to say
    a.error_file, a.error_msg = "/exp/x/error.txt", "Traceback ...\nRuntimeError: boom"
    p.on_trial_error(0, [a, b, c], a)
    errors = [line for line, err in console.lines if err]
    assert errors == [f"trial AV_T-seed1-x_00000 ERROR (not retried): NonFiniteLossError: loss non-finite "
                      f"[{tmp_path / TRIAL_ERRORS_DIR / 'x_00000.txt'}]",
                      "trial AV_T-seed1-x_00000 ERROR: RuntimeError: boom (traceback in /exp/x/error.txt)"]


def test_the_status_lines_follow_a_lower_is_better_metric(progress):
    """sweep.metric = the median rank: the epoch lines and the status table show MedR, each trial's
    best is its lowest, and the head names the trial with the lowest."""
    p, console = progress
    p.cfg = p.cfg.replace({"sweep.metric": "best_text_to_video_MedR"})
    a, b = _trial("x_00000", "AV_T"), _trial("x_00001", "joint")
    for t in (a, b):
        p.on_trial_start(0, [a, b], t)
    for t, medrs in ((a, (30.0, 12.0, 18.5)), (b, (25.0, 20.0, 21.0))):
        for epoch, value in enumerate(medrs, start=1):
            p.on_trial_result(0, [a, b], t, {"epoch": epoch, "text_to_video_R@10": 50.0, "text_to_video_MedR": value})
    assert [line for line, _ in console.lines][-1] == "joint-seed1-x_00001 epoch 3/4  MedR  21.0"
    head, columns, *rows = p.status_table([a, b], 60.0)
    assert head == "status after 1m00s: 2 running; best MedR 12.0 (AV_T-seed1-x_00000)"
    assert columns.split() == ["trial", "status", "epoch", "MedR", "best", "for"]
    assert [r.split()[2:5] for r in rows] == [["3", "18.5", "12.0"], ["3", "21.0", "20.0"]]


def test_progress_pickles_without_its_console(progress):
    import pickle

    p, _ = progress
    assert pickle.loads(pickle.dumps(p)).console is None  # Tune pickles its callbacks into the experiment


FAILING_RUN = textwrap.dedent(r"""
    import sys
    from raymcn import cli
    from raymcn.train.on_ray import launch
    from raymcn.train.loop import NonFiniteLossError

    def fail(*args, **kwargs):
        print("chatter inside the run")
        raise NonFiniteLossError("loss non-finite for 1 consecutive steps")

    launch.fit = fail
    sys.exit(cli.main(["train", "--set", "scale.num_workers=0", "--set", f"run.storage_path={sys.argv[1]}"]))
""")


def test_a_failed_train_run_still_says_why_on_the_terminal(tmp_path):
    """The console lets go of the terminal before the failure is printed (a process of its own:
    pytest's capture replaces sys.stdout, which would bypass the file descriptors)."""
    proc = subprocess.run([sys.executable, "-c", FAILING_RUN, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "not retried (a restart cannot cure this): NonFiniteLossError: loss non-finite" in proc.stderr
    assert "chatter inside the run" not in proc.stdout + proc.stderr
    (log,) = tmp_path.glob("*/raymcn_console.log")
    assert "chatter inside the run" in log.read_text()
