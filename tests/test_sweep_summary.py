"""The end of `raymcn sweep` on one screen, and the wide tables on demand (files only, no Ray).

A sweep's per-trial table and its mean ± std table are 20 columns wide at the real metrics: the
end of the sweep shows the phases, the answer's table (at most 160 characters) and line, and says
where the plots and the CSV tables are; `raymcn table` prints everything, `--format csv --out`
writes every table.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from raymcn.config import DEFAULT_OBJECTIVE, objective
from raymcn.results.confirmation import ConfirmSettings, plan_text, select_candidates, trial_configs
from raymcn.results.experiment import load_experiment
from raymcn.results.summary import MAX_WIDTH, sweep_summary


def width(lines: list[str], exp: Path) -> int:
    """The widest line, the experiment's folder counted as 3 characters: a line that names the
    folder is as wide as the user's path makes it (pytest's tmp_path varies in length)."""
    return max(len(line.replace(str(exp), "EXP")) for line in lines)

from tune_dirs import write_sweep_yaml, write_trial

ORDER, LR, SEED = "schedule.stage_order", "optim.lr", "run.seed"
ORDERS = {"AV_T": 20.0, "VT_A": 30.0, "AT_V": 8.0, "joint": 28.0}
TIMING = {"samples_per_s": 900.0, "time_forward_s": 0.03, "time_loss_s": 0.02, "time_backward_s": 0.04,
          "time_data_s": 0.001, "time_optimizer_s": 0.01, "time_eval_s": 0.4, "time_epoch_s": 2.0}


@pytest.fixture()
def confirmed(tmp_path):
    """The embedded default's shape: 4 orders x 2 learning rates searched, each order's best over
    seeds 2 and 3, with the step timings a real run reports (what makes the tables wide)."""
    exp, confirm = tmp_path / "exp", tmp_path / "exp" / "confirm"
    write_sweep_yaml(exp, epochs=2)
    i = 0
    for order, base in ORDERS.items():
        for lr, step in ((1e-3, 0.0), (3e-3, 4.0)):
            write_trial(exp, f"{order}-s{i}", f"s{i}", {ORDER: order, LR: lr}, [(base + step) / 2, base + step],
                        extra=TIMING)
            i += 1
    settings = ConfirmSettings(ORDER, 1, 2)
    picked = select_candidates(load_experiment(exp)[0], settings, epochs=2, target=objective(DEFAULT_OBJECTIVE))
    write_sweep_yaml(confirm, epochs=2)
    (confirm / "confirm_plan.yaml").write_text(plan_text(settings, picked, [2, 3]))
    values = {"AV_T": [24.0, 25.5], "VT_A": [43.0, 44.1], "AT_V": [8.0, 7.0], "joint": [40.0, 40.5]}
    for j, cfg in enumerate(trial_configs(picked, [2, 3])):
        write_trial(confirm, f"{cfg[ORDER]}-c{j}", f"c{j}", cfg, [10.0, values[cfg[ORDER]][cfg[SEED] - 2]],
                    extra=TIMING)
    return exp


def test_the_end_of_a_confirmed_sweep_fits_one_screen(confirmed):
    text = sweep_summary(confirmed)
    lines = text.splitlines()
    # each phase is named with its own trials: the search's line no longer carries the confirmation's folder
    assert lines[0] == f"search: 8 trials (0 errored) in {confirmed}"
    assert lines[1] == f"confirmation: 8 trials (0 errored) in {confirmed / 'confirm'}"
    # the seeds and the count of runs apart: "seeds 2, 3, 8 of 8" read as three seeds
    assert "best_text_to_video_R@10 by schedule.stage_order, confirmation over seeds 2 and 3: 8 of 8 runs done" in lines
    assert width(lines, confirmed) <= MAX_WIDTH and len(lines) <= 30, text
    rows = [line for line in lines if line.startswith("| VT_A |") or line.startswith("| joint |")]
    assert len(rows) == 2 and "paired t" in rows[1]
    assert any(line.startswith("Answer: VT_A learns the best joint space") for line in lines)
    # where the rest is: the plots and every table as CSV, written beside the sweep
    for name in ("search_trials.csv", "search_groups.csv", "confirmation_trials.csv", "confirmation_groups.csv"):
        assert (confirmed / "tables" / name).exists() and name in text
    assert (confirmed / "best_by_stage_order.png").exists() and "best_by_stage_order.png" in text
    assert f"raymcn table {confirmed}" in text
    trials = pd.read_csv(confirmed / "tables" / "search_trials.csv")
    assert len(trials) == 8 and "time_forward_s" in trials.columns  # every column, timings included


def test_the_wide_tables_stay_available_on_demand(confirmed, capsys, tmp_path):
    from raymcn.cli import main

    assert main(["table", str(confirmed), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "mean ± std (ddof=1) over the full-budget trials" in out  # the wide tables, in Markdown
    assert max(map(len, out.splitlines())) > MAX_WIDTH
    assert main(["table", str(confirmed), "--format", "csv", "--out", str(tmp_path / "csv"), "--no-plots"]) == 0
    written = sorted(p.name for p in (tmp_path / "csv").iterdir())
    assert written == ["confirmation_groups.csv", "confirmation_trials.csv", "search_groups.csv", "search_trials.csv"]
    groups = pd.read_csv(tmp_path / "csv" / "confirmation_groups.csv")
    assert groups[ORDER].tolist()[0] == "VT_A" and groups["n_finished"].tolist() == [2, 2, 2, 2]


def test_a_search_without_confirmation_shows_its_own_statistics(tmp_path):
    exp = tmp_path / "exp"
    write_sweep_yaml(exp, epochs=2)
    for i, (order, base) in enumerate(ORDERS.items()):
        write_trial(exp, f"{order}-s{i}", f"s{i}", {ORDER: order}, [base / 2, base], extra=TIMING)
    text = sweep_summary(exp, plots=False)
    lines = text.splitlines()
    assert lines[0] == f"search: 4 trials (0 errored) in {exp}" and not any(x.startswith("confirmation") for x in lines)
    assert "best_text_to_video_R@10 by schedule.stage_order, search:" in text and "| VT_A |" in text
    assert width(lines, exp) <= MAX_WIDTH
