"""The Ray-side calls docs/sweeps.md shows ("Ray's, TensorBoard's and MLflow's own tools"), run on a
finished embedded-default sweep (``make sweep``) as a user types them in Python, with what they
print. The console text goes to ``docs/measurements/ray_results.txt``, which ``python -m
tools.docgen`` writes into the page (its paths shortened to the default results folder).

    python -m tools.ray_results                      # runs `make sweep`'s sweep first, in a temporary folder
    python -m tools.ray_results --experiment EXP     # on a finished sweep of the embedded default

``tests/test_ray_results.py`` runs :data:`SESSION` on a sweep of its own (and ``raymcn eval`` of the
checkpoints it gives) and checks that the stored text holds today's :data:`SESSION`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "measurements" / "ray_results.txt"
SHOWN_RESULTS = "~/raymcn_results"  # the default results folder, as the pages show paths
PROMPT = ">>> "

# What the page shows, one statement a line (EXP: the sweep's folder, set first).
SESSION = (
    "from raymcn.sweep.result_grid import result_grid",
    "best = result_grid(EXP).get_best_result()",
    'best.config, best.metrics["best_text_to_video_R@10"], best.checkpoint',
    'len(result_grid(EXP + "/confirm"))',
    "from ray import tune; from raymcn.sweep.tuner import trial_fn",
    "tuned = tune.Tuner.restore(EXP, trainable=trial_fn).get_results()",
    'same = tuned.get_best_result("best_text_to_video_R@10", "max")',
    'same.checkpoint, same.metrics["checkpoint_path"] == best.checkpoint.path',
)


def run_session(experiment_dir: str, statements: tuple[str, ...] = SESSION) -> tuple[str, dict]:
    """Each statement run as Python's interactive prompt runs it (an expression's value printed),
    ``EXP`` set to ``experiment_dir`` first: (the console text, prompts included; the namespace)."""
    namespace: dict = {}
    lines = [f'{PROMPT}EXP = "{experiment_dir}"']
    exec(f"EXP = {experiment_dir!r}", namespace)
    for statement in statements:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(statement, "<session>", "single"), namespace)
        lines += [PROMPT + statement, *out.getvalue().rstrip("\n").splitlines()]
    return "\n".join(lines), namespace


def shown(text: str, results: str) -> str:
    """``text`` with the results folder ``results`` written as the default one."""
    return text.replace(str(results).rstrip("/"), SHOWN_RESULTS)


def transcript(experiment_dir: str) -> str:
    """The session on the sweep in ``experiment_dir``."""
    return run_session(experiment_dir)[0]


def make_sweep(results: Path) -> str:
    """``make sweep``'s sweep (``python sweep.py``) with its results in ``results``; its folder."""
    env = dict(os.environ, RAYMCN_RESULTS=str(results))
    subprocess.run([sys.executable, "sweep.py"], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    (folder,) = sorted(p.parent for p in results.glob("*/raymcn_sweep.yaml"))
    return str(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ray_results", description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", help="a finished sweep of the embedded default (default: run one)")
    parser.add_argument("--out", default=str(OUT),
                        help=f"where the console text goes (default: {OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="raymcn-ray-results-") as tmp:
        exp = str(Path(args.experiment).expanduser().resolve()) if args.experiment else make_sweep(Path(tmp))
        text = shown(transcript(exp), str(Path(exp).parent))
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
