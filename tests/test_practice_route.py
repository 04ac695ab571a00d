"""The lab's guide's practice route on one CPU machine, its commands as the guide prints them (a
toy corpus, its shards, step 7's run and step 12's smoke sweep, both rehearsed on those shards),
each ending as the guide says. The guide's lines are these calls' words: ``tests/test_docs.py``
checks it, in the fast tier, through ``tools/doc_commands.py``. Step 7 is also the suite's
rehearsal of ``sweeps/paper.yaml`` (tests/test_rehearsals.py's ``SHIPPED``): every epoch and step of
its miniature trained.

As a newcomer runs them: ``bash`` in the checkout, ``raymcn`` on the path, a home folder of the
test's own (the corpus under ``$HOME/raymcn-practice``, the results in ``~/raymcn_results``, Ray's
token in ``~/.ray``), no ``RAY_ADDRESS``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raymcn.config import load_config
from raymcn.sweep.rehearsal import shrink

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def newcomer(tmp_path):
    """A shell as a newcomer has it: a home of its own, the venv's commands first on the path, no
    Ray address and no results folder set (the defaults under the home folder)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAYMCN_RESULTS")}
    env.update(HOME=str(home), PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))

    def run(command: str) -> str:
        done = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"{command}\n{out[-4000:]}"
        return out

    return home, run


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_practice_route_runs_as_the_guide_prints_it(newcomer):
    home, run = newcomer
    # step 2: a toy corpus in the lab's layout
    out = run("raymcn synth --out $HOME/raymcn-practice --videos 64")
    assert f"wrote 64 videos in the original layout to {home}/raymcn-practice" in out, out
    # step 3: the dry run ("it prints `64 videos found of 64 listed`"), which writes nothing
    out = run("raymcn shards --features $HOME/raymcn-practice/features --audio-features $HOME/raymcn-practice/audio "
              "--captions $HOME/raymcn-practice/caption.pickle --video-list $HOME/raymcn-practice/videopaths.csv "
              "--word-vectors $HOME/raymcn-practice/word2vec.bin --out $HOME/raymcn-practice/shards --dry-run")
    assert "64 videos found of 64 listed" in out and not (home / "raymcn-practice" / "shards").exists(), out
    # step 4: its shards ("it ends with `64 of 64 listed videos in 1 shard`")
    out = run("raymcn shards --features $HOME/raymcn-practice/features --audio-features $HOME/raymcn-practice/audio "
              "--captions $HOME/raymcn-practice/caption.pickle --video-list $HOME/raymcn-practice/videopaths.csv "
              "--word-vectors $HOME/raymcn-practice/word2vec.bin --out $HOME/raymcn-practice/shards --workers 2")
    assert "64 of 64 listed videos in 1 shard " in out, out
    # step 7: the paper's file rehearsed on those shards ("tiny sizes, 2 epochs of 2 steps, a CPU worker")
    out = run("raymcn train --config sweeps/paper.yaml --rehearse --set data.shards=$HOME/raymcn-practice/shards "
              "--set data.eval_set=youcook:$HOME/raymcn-practice/youcook_val_audio.pkl")
    final = dict(re.findall(r"^  (epochs|global_step|eval_size) +(\d+)$", out, flags=re.M))
    assert final == {"epochs": "2", "global_step": "4", "eval_size": "256"}, out[-3000:]  # the corpus's own eval set
    mini = shrink(load_config(REPO / "sweeps/paper.yaml"))  # the paper file's rehearsal: trained to its end
    assert (mini.schedule.epochs, mini.schedule.epochs * mini.schedule.steps_per_epoch) == (2, 4)
    run_dir = Path(re.search(r"^run (\S+) \(Ray's output", out, flags=re.M).group(1))
    assert run_dir.parent == home / "raymcn_results"
    # step 12: the smoke sweep rehearsed on those shards passes as the cluster's does
    out = run("raymcn sweep --config sweeps/cluster_smoke.yaml --rehearse "
              "--set data.shards=$HOME/raymcn-practice/shards "
              "--set data.eval_set=youcook:$HOME/raymcn-practice/youcook_val_audio.pkl")
    exp = re.search(r"^search: 2 trials \(0 errored\) in (\S+)$", out, flags=re.M)
    assert exp and Path(exp.group(1)).parent == home / "raymcn_results", out[-3000:]
    assert re.search(r"^\| (VT_A|joint) \| 1 \| 1 \|", out, flags=re.M), out[-3000:]  # the two orders' table
    assert run(f'grep -c "skipped bad sample" {exp.group(1)}/raymcn_console.log || true').strip() == "0"
