"""Search, then confirm: the selection of each group's best configuration, the fresh seeds, the
plan and the tables, on fixed inputs (the sweep on Ray: tests/test_confirm_ray.py)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from tune_dirs import write_sweep_yaml, write_trial

from raymcn.config import ConfigError, load_config, objective
from raymcn.results.confirmation import (
    CANDIDATE,
    ConfirmSettings,
    NothingToConfirm,
    confirmation_seeds,
    label_trials,
    plan_text,
    read_plan,
    select_candidates,
    settings,
    trial_configs,
)
from raymcn.results.experiment import load_experiment
from raymcn.results.table import answer_line, group_table

R10 = "best_text_to_video_R@10"
TARGET = objective(R10)  # the default sweep.metric
ORDER, LR, SEED = "schedule.stage_order", "optim.lr", "run.seed"
PER_ORDER = ConfirmSettings(per=ORDER, top=1, repeats=3)


def search_frame() -> pd.DataFrame:
    """AV_T: lr 1e-3 ran the full 4 epochs twice (seeds 1, 2: mean 30); lr 3e-3 full once (28);
    lr 1e-2 was stopped early at its best value of all (45) and an errored one reported 50.
    joint: every trial stopped early (ASHA), the longest at 3 epochs."""
    rows = [("AV_T", 1e-3, 1, 29.0, "done", 4), ("AV_T", 1e-3, 2, 31.0, "done", 4),
            ("AV_T", 3e-3, 1, 28.0, "done", 4), ("AV_T", 1e-2, 1, 45.0, "stopped", 2),
            ("AV_T", 3e-2, 1, 50.0, "error", 3),
            ("joint", 1e-3, 1, 20.0, "stopped", 3), ("joint", 3e-3, 1, 22.0, "stopped", 2),
            ("joint", 1e-2, 1, 21.0, "stopped", 3)]
    df = pd.DataFrame(rows, columns=[ORDER, LR, SEED, R10, "status", "epochs"])
    return df.assign(trial=[f"t{i}" for i in range(len(df))])


def test_the_full_budget_decides_and_a_stopped_or_errored_trial_never_does():
    picked = {c.group: c for c in select_candidates(search_frame(), PER_ORDER, epochs=4, target=TARGET)}
    av = picked["AV_T"]
    assert av.config == {ORDER: "AV_T", LR: 1e-3} and av.score == pytest.approx(30.0) and av.trials == 2
    assert av.basis == "full budget (4 epochs)"
    joint = picked["joint"]  # nothing at the full budget: the best at the longest budget reached (3)
    assert joint.config[LR] == 1e-2 and joint.basis.startswith("longest budget reached: 3 of 4 epochs")


def test_top_two_are_labelled_and_ranked():
    picked = select_candidates(search_frame(), ConfirmSettings(ORDER, top=2, repeats=2), epochs=4, target=TARGET)
    assert [(c.label, c.config[LR]) for c in picked] == [("AV_T #1", 1e-3), ("AV_T #2", 3e-3),
                                                        ("joint #1", 1e-2), ("joint #2", 1e-3)]


def test_nothing_to_select_says_what_the_search_holds():
    errored = search_frame().assign(status="error")
    with pytest.raises(NothingToConfirm, match="no trial of the search has a best_text_to_video_R@10"):
        select_candidates(errored, PER_ORDER, epochs=4, target=TARGET)


def test_fresh_seeds_are_the_same_for_every_group_and_after_the_searchs():
    cfg = load_config(None, ["run.seed=7", "sweep.algorithm=grid", "sweep.repeats=3",
                             f"sweep.space={{{ORDER}: {{grid: [AV_T, joint]}}}}"])
    assert confirmation_seeds(cfg, 4) == [10, 11, 12, 13]  # the search used 7, 8, 9
    in_space = load_config(None, [f"sweep.space={{{SEED}: {{grid: [1, 40]}}, {ORDER}: {{grid: [AV_T, joint]}}}}"])
    assert confirmation_seeds(in_space, 2) == [41, 42]
    picked = select_candidates(search_frame(), PER_ORDER, epochs=4, target=TARGET)
    configs = trial_configs(picked, [10, 11, 12])
    assert [c[SEED] for c in configs] == [10, 10, 11, 11, 12, 12]  # seed by seed: what ran so far pairs
    for c in picked:
        mine = [x for x in configs if x[ORDER] == c.group]
        assert [x[SEED] for x in mine] == [10, 11, 12] and all(x[LR] == c.config[LR] for x in mine)


def test_settings_and_their_validation():
    space = f"sweep.space={{{ORDER}: {{grid: [AV_T, joint]}}, {LR}: {{grid: [0.001, 0.003]}}}}"
    cfg = load_config(None, [space, f"sweep.confirm={{per: {ORDER}, repeats: 4}}"])
    assert settings(cfg) == ConfirmSettings(ORDER, 1, 4)
    plain = load_config(None, [space])
    assert settings(plain) is None and settings(plain, swept=[ORDER, LR]) == ConfirmSettings(ORDER, 1, 5)
    with pytest.raises(ConfigError) as e:
        load_config(None, [space, "sweep.confirm={per: model.embed_dim, top: 0, seeds: 3}"])
    msg = "\n".join(e.value.problems)
    assert "sweep.confirm.seeds: unknown (allowed: per, top, repeats)" in msg
    assert "sweep.confirm.per='model.embed_dim': not a swept key" in msg
    assert "sweep.confirm.top=0: must be a whole number >= 1" in msg and "needs repeats" in msg


def test_plan_round_trip_and_labels(tmp_path):
    picked = select_candidates(search_frame(), ConfirmSettings(ORDER, top=2, repeats=2), epochs=4, target=TARGET)
    (tmp_path / "confirm").mkdir()
    (tmp_path / "confirm" / "confirm_plan.yaml").write_text(plan_text(ConfirmSettings(ORDER, 2, 2), picked, [5, 6]))
    s, back, seeds = read_plan(tmp_path)
    assert s == ConfirmSettings(ORDER, 2, 2) and back == picked and seeds == [5, 6]
    assert read_plan(tmp_path / "elsewhere") is None
    runs = pd.DataFrame(trial_configs(picked, [5, 6]))
    assert label_trials(runs, picked)[CANDIDATE].tolist() == ["AV_T #1", "AV_T #2", "joint #1", "joint #2"] * 2


def confirmation_frame(av_t, joint, vt_a, seeds=(11, 12, 13, 14, 15)) -> pd.DataFrame:
    rows = []
    for order, lr, values in (("AV_T", 1e-3, av_t), ("joint", 3e-3, joint), ("VT_A", 1e-2, vt_a)):
        rows += [(order, lr, s, v, "done") for s, v in zip(seeds, values)]
    return pd.DataFrame(rows, columns=[ORDER, LR, SEED, R10, "status"]).assign(epochs=4)


def test_confirmation_pairs_on_the_seed_and_the_answer_names_what_it_can_and_cannot_tell():
    df = confirmation_frame(av_t=[30.0, 32, 31, 33, 29], joint=[29.5, 32.5, 30, 33, 29.5], vt_a=[25.0, 26, 24, 27, 25])
    g = group_table(df, ORDER, R10, pair_on=[SEED]).set_index(ORDER)
    assert list(g.index) == ["AV_T", "joint", "VT_A"]
    assert g.loc["joint", "test"] == "paired t" and g.loc["joint", "pairs"] == 5
    assert g.loc["VT_A", "p_holm"] < 0.05 < g.loc["joint", "p_holm"]
    text = " ".join(answer_line(g.reset_index(), ORDER, 15, 15, R10).split())
    assert text.startswith("Answer: AV_T learns the best joint space by best_text_to_video_R@10: 31.00")
    assert "better than VT_A (AV_T ahead by 5.60, p Holm" in text
    mde = g.loc["joint", "mde"]
    assert math.isfinite(mde) and "not told apart from joint (AV_T ahead by 0.10, p Holm" in text
    assert f"detectable Δ {mde:.2f}" in text and "provisional" not in text
    assert answer_line(g.reset_index(), ORDER, 12, 15, R10).startswith(
        "(provisional: 12 of 15 confirmation runs done)")


def test_a_seed_missing_on_one_side_is_left_out_of_the_pairs():
    df = confirmation_frame(av_t=[30.0, 32, 31, 33, 29], joint=[29.5, 32.5, 30, 33, 29.5], vt_a=[25.0, 26, 24, 27, 25])
    df = df[~((df[ORDER] == "VT_A") & (df[SEED] == 15))]
    g = group_table(df, ORDER, R10, pair_on=[SEED]).set_index(ORDER)
    assert g.loc["VT_A", "pairs"] == 4 and "1 unpaired trial(s) left out" in g.loc["VT_A", "note"]
    assert g.loc["VT_A", "vs_best"] == pytest.approx(sum([25.0 - 30, 26 - 32, 24 - 31, 27 - 33]) / 4)


# --- the table and the live view of a confirmed sweep (files only) -------------------------------------
@pytest.fixture()
def confirmed(tmp_path):
    """A finished search (AV_T and joint, 2 lrs each, 2 epochs) and its finished confirmation
    (seeds 2, 3, 4); AV_T's confirmation runs are clearly better."""
    exp, confirm = tmp_path / "exp", tmp_path / "exp" / "confirm"
    write_sweep_yaml(exp, epochs=2)
    for i, (order, lr, r) in enumerate([("AV_T", 1e-3, 20.0), ("AV_T", 3e-3, 24.0), ("joint", 1e-3, 22.0),
                                        ("joint", 3e-3, 19.0)]):
        write_trial(exp, f"{order}-s{i}", f"s{i}", {ORDER: order, LR: lr}, [r / 2, r])
    picked = select_candidates(load_experiment(exp)[0], ConfirmSettings(ORDER, 1, 3), epochs=2, target=TARGET)
    write_sweep_yaml(confirm, epochs=2)
    (confirm / "confirm_plan.yaml").write_text(plan_text(ConfirmSettings(ORDER, 1, 3), picked, [2, 3, 4]))
    values = {"AV_T": [30.0, 33, 31], "joint": [22.0, 24, 25]}
    for i, cfg in enumerate(trial_configs(picked, [2, 3, 4])):
        write_trial(confirm, f"{cfg[ORDER]}-c{i}", f"c{i}", cfg, [10.0, values[cfg[ORDER]][cfg[SEED] - 2]])
    return exp


def test_the_table_of_a_confirmed_sweep_shows_both_phases_and_the_answer(confirmed, capsys):
    from raymcn.cli import main

    assert main(["table", str(confirmed)]) == 0
    out = capsys.readouterr().out
    search = out.index("Search (4 trials; its best per schedule.stage_order is confirmed below)")
    selection = out.index("| schedule.stage_order | optim.lr | search mean | search trials | selected at |")
    stats = out.index("best_text_to_video_R@10 by schedule.stage_order, confirmation:")
    answer = out.index("Answer: AV_T learns the best joint space by best_text_to_video_R@10: 31.33")
    assert search < selection < stats < answer
    assert "3 of 3 runs done" not in out and "6 of 6 runs done" in out
    assert "| AV_T | 0.003 | 24.00 | 1 | full budget (2 epochs) |" in out
    stats_rows = [line for line in out[stats:answer].splitlines() if line.startswith("| joint")]
    assert stats_rows and "| paired t | 3 |" in stats_rows[0]
    for png in ("best_by_stage_order.png", "learning_curves.png", "search_best_by_stage_order.png",
                "search_learning_curves.png"):
        assert (confirmed / png).stat().st_size > 5000
    assert main(["table", str(confirmed), "--format", "csv", "--no-plots"]) == 0
    csv = pd.read_csv(__import__("io").StringIO(capsys.readouterr().out))
    assert csv[ORDER].tolist() == ["AV_T", "joint"] and csv["n_finished"].tolist() == [3, 3]
    assert csv.loc[1, "pairs"] == 3 and csv.loc[1, "mde"] > 0


def test_watch_shows_the_confirmation_below_the_search(confirmed, capsys):
    from raymcn.cli import main

    assert main(["watch", str(confirmed), "--once"]) == 0
    out = capsys.readouterr().out
    assert out.index("Search (4 trials") < out.index("confirmation:") < out.index("Answer: AV_T")
    assert (confirmed / "search_best_by_stage_order.png").exists() and (confirmed / "best_by_stage_order.png").exists()


def test_a_confirmation_killed_before_tune_saved_its_state_starts_again(tmp_path):
    """Tune writes ``tuner.pkl`` before its first experiment state; a confirmation killed between
    the two has trained nothing: ``--resume`` starts it again instead of restoring it (Ray 2.60's
    restore of such a folder ran one run and ended as if done), and resuming that folder itself
    names the sweep's folder to resume instead."""
    from raymcn.config import CONFIRM_PLAN_FILE, SWEEP_CONFIG_FILE
    from raymcn.sweep import tuner

    exp = tmp_path / "sweep"
    confirm = exp / "confirm"
    confirm.mkdir(parents=True)
    write_sweep_yaml(confirm, epochs=2)
    for name in ("tuner.pkl", CONFIRM_PLAN_FILE):
        (confirm / name).write_text("")
    assert (confirm / SWEEP_CONFIG_FILE).exists()
    assert not tuner.confirmation_started(str(exp))
    with pytest.raises(ConfigError, match=f"resume its sweep \\({exp}\\), which starts it again"):
        tuner.resume_sweep(str(confirm))
    (confirm / "experiment_state-2026-11-27_08-05-43.json").write_text("{}")
    assert tuner.confirmation_started(str(exp))


def test_a_search_killed_before_tune_saved_its_state_starts_again(tmp_path, monkeypatch):
    """A search folder holding its config and at most ``tuner.pkl`` (killed in its first second):
    ``--resume`` runs the search again in the same folder, with the config it was started with."""
    from raymcn.sweep import tuner

    exp = tmp_path / "sweep"
    write_sweep_yaml(exp, epochs=3, stage_order="AV_T")
    (exp / "tuner.pkl").write_text("")
    started = []
    monkeypatch.setattr(tuner, "run_sweep", lambda cfg, where, **kw: started.append((cfg, where)) or "fresh")
    assert tuner.resume_sweep(str(exp)) == "fresh"
    ((cfg, where),) = started
    assert where == str(exp) and cfg.schedule.epochs == 3 and cfg.schedule.stage_order == "AV_T"
