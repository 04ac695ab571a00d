"""Retrieval metrics against a brute-force reference, ties included, and every metric of the table
against its hand-computed value; LR schedule; stage orders."""

import json

import numpy as np
import pytest
import torch

from raymcn.config import metric, metric_names, metric_table
from raymcn.train.evaluate import ranks_of_matches, retrieval_metrics
from raymcn.train.optim import lr_factor
from raymcn.train.stages import active_modalities, first_stage, switch_step


def brute_force_ranks(q, g):
    s = (q.double() @ g.double().T).numpy()
    return np.array([int((s[i] > s[i, i]).sum()) for i in range(len(s))])


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_ranks_match_brute_force(chunk):
    torch.manual_seed(0)
    q, g = torch.randn(50, 8), torch.randn(50, 8)
    assert ranks_of_matches(q, g, chunk=chunk).tolist() == brute_force_ranks(q, g).tolist()


def test_ties_do_not_lower_the_rank():
    # every gallery item scores the same: rank 0 for all (strictly-greater count), R@1 = 100
    q = torch.ones(6, 4)
    g = torch.ones(6, 4)
    ranks = ranks_of_matches(q, g)
    assert ranks.tolist() == [0] * 6
    assert retrieval_metrics(ranks)["text_to_video_R@1"] == 100.0


def test_metric_values():
    ranks = torch.tensor([0, 1, 4, 5, 9, 10, 20, 0])
    m = retrieval_metrics(ranks)
    assert m["text_to_video_R@1"] == pytest.approx(100 * 2 / 8)
    assert m["text_to_video_R@5"] == pytest.approx(100 * 4 / 8)
    assert m["text_to_video_R@10"] == pytest.approx(100 * 6 / 8)
    assert m["text_to_video_MedR"] == float(np.median(ranks.numpy())) + 1
    # MSR-VTT: 968 present of 1000; the absent count as misses for R@K
    m = retrieval_metrics(torch.zeros(968, dtype=torch.long), num_queries_total=1000)
    assert m["text_to_video_R@1"] == pytest.approx(96.8)


# 10 present queries of a protocol that counts 12 (2 absent, as MSR-VTT's clips without audio).
# Sorted ranks: 0 0 1 4 5 9 10 20 49 60; their sum 158.
RANKS, TOTAL = [0, 1, 4, 5, 9, 10, 20, 0, 60, 49], 12
# Each listed metric's value, by hand: a metric added to the table needs its line here.
BY_HAND = {
    "text_to_video_R@1": 100 * 2 / 12,  # ranks 0, 0 of all 12 queries (the 2 absent are misses)
    "text_to_video_R@5": 100 * 4 / 12,  # 0, 0, 1, 4
    "text_to_video_R@10": 100 * 6 / 12,  # 0, 0, 1, 4, 5, 9
    "text_to_video_R@50": 100 * 9 / 12,  # all present but 60
    "text_to_video_MedR": (5 + 9) / 2 + 1,  # the median of the 10 present ranks, 1-based: 8
    "text_to_video_MeanR": 158 / 10 + 1,  # the mean of the 10 present ranks, 1-based: 16.8
}


def test_every_listed_metric_is_computed_as_by_hand():
    """The evaluation computes every metric the table lists, each as computed by hand."""
    assert set(BY_HAND) == set(metric_names()), "give each metric of the table its hand-computed value"
    got = retrieval_metrics(torch.tensor(RANKS), num_queries_total=TOTAL)
    assert list(got) == list(metric_names())  # in the table's order
    assert got == pytest.approx(BY_HAND, abs=1e-12)


def test_each_metric_is_over_the_queries_its_table_row_says():
    """``over_all_queries``: the value changes with the protocol's query count (an absent query is a
    miss), else it is over the present queries only and does not."""
    ranks = np.array(RANKS)
    for m in metric_table():
        changed = m.compute(ranks, len(ranks)) != m.compute(ranks, len(ranks) + 5)
        assert changed == m.over_all_queries, m.name


def test_every_metric_has_a_direction_a_format_and_a_worst_value():
    for m in metric_table():
        assert m.direction in ("max", "min") and m.spec.startswith(".") and m.meaning, m.name
        assert m.sign * m.worst < m.sign * BY_HAND[m.name]  # a mid-epoch checkpoint never ranks above an epoch end
        assert json.loads(json.dumps(m.worst)) == m.worst  # finite: Ray stores reported metrics as JSON
    assert metric("text_to_video_MedR").direction == metric("text_to_video_MeanR").direction == "min"
    assert {metric(f"text_to_video_R@{k}").direction for k in (1, 5, 10, 50)} == {"max"}
    with pytest.raises(KeyError, match="R@100"):
        metric("text_to_video_R@100")


def test_lr_schedule_warmup_then_cosine():
    assert lr_factor(0, 10, 110) == 0.0
    assert lr_factor(5, 10, 110) == 0.5
    assert lr_factor(10, 10, 110) == 1.0
    assert lr_factor(60, 10, 110) == pytest.approx(0.5)
    assert lr_factor(110, 10, 110) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(500, 10, 110) == pytest.approx(0.0, abs=1e-12)  # clamped: never rises again
    assert all(lr_factor(s, 10, 110) >= lr_factor(s + 1, 10, 110) for s in range(10, 120))


@pytest.mark.parametrize("order, first", [("AV_T", {"audio", "video"}), ("VT_A", {"video", "text"}),
                                          ("AT_V", {"audio", "text"}), ("joint", {"audio", "video", "text"})])
def test_stage_orders(order, first):
    assert first_stage(order) == first
    sw = switch_step(order, 0.5, 100)
    assert sw == (0 if order == "joint" else 50)
    assert active_modalities(order, 0, sw) == first
    assert active_modalities(order, max(sw - 1, 0), sw) == first
    assert active_modalities(order, sw, sw) == {"audio", "video", "text"}
    with pytest.raises(ValueError, match="allowed values"):
        first_stage("TV_A")
