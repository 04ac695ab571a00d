"""Retrieval metrics against a brute-force reference, ties included; LR schedule; stage orders."""


import numpy as np
import pytest
import torch

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
