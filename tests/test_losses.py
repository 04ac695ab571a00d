"""Fast loss tests (no process group): formulas pinned against hand computations, k-means,
queue and the objective's bookkeeping."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import config, objective_for

from raymcn.collectives import Collectives, world_info
from raymcn.losses import (
    FeatureQueue,
    assign_clusters,
    cluster_ce,
    cosine_kmeans,
    mms_loss,
    recon_loss,
)
from raymcn.losses.ring import ring_mms_loss

BASE = {"data.batch_size": 4, "data.clips_per_video": 6, "loss.num_clusters": 3, "loss.queue_steps": 3,
        "loss.queue_clip_fraction": 0.5, "loss.refresh_every": 2, "loss.kmeans_iters": 20,
        "scale.num_workers": 0, "model.embed_dim": 8}


# --- MMS ------------------------------------------------------------------------------------------
def _mms_reference(x: torch.Tensor, y: torch.Tensor, margin: float) -> torch.Tensor:
    """The original loss literally: full S, S − δI, log_softmax over rows and over columns, diagonal NLL."""
    s = x.double() @ y.double().T
    s = s - margin * torch.eye(s.shape[0], dtype=s.dtype)
    rows = -torch.log_softmax(s, dim=1).diagonal().mean()
    cols = -torch.log_softmax(s, dim=0).diagonal().mean()
    return rows + cols


@pytest.mark.parametrize("margin", [0.0, 0.001, 0.7])
def test_mms_matches_direct_formula(margin):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 5, generator=g), torch.randn(7, 5, generator=g)
    got = mms_loss(x, y, x, y, 0, margin)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _mms_reference(x, y, margin), rtol=1e-5, atol=1e-6)


def test_mms_symmetric_in_its_arguments():
    # Row CE of S and column CE of Sᵀ swap: MMS(x, y) == MMS(y, x) — both directions are included.
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    torch.testing.assert_close(mms_loss(x, y, x, y, 0, 0.3), mms_loss(y, x, y, x, 0, 0.3))


def test_mms_shares_give_full_batch_loss_and_gradient():
    # Two "ranks" of 3 rows each in one process. The normaliser exchange is the all-gather of
    # (row logsumexp, column logsumexp) over ranks; here it returns the full-batch values directly.
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 4, generator=g, requires_grad=True), torch.randn(6, 4, generator=g, requires_grad=True)
    s = (x @ y.T - 0.2 * torch.eye(6)).detach()
    everyone = torch.stack([torch.logsumexp(s, 1), torch.logsumexp(s, 0)], dim=1)
    shares, grads = [], []
    for r in range(2):
        xl, yl = x[r * 3:(r + 1) * 3].detach().requires_grad_(), y[r * 3:(r + 1) * 3].detach().requires_grad_()
        share = mms_loss(xl, yl, x, y, r * 3, 0.2, gather=lambda local, r=r: everyone)
        share.backward()
        shares.append(share)
        grads.append((xl.grad, yl.grad))
    assert x.grad is None and y.grad is None  # the gathered rows are constants: nothing flows back to them
    reference = _mms_reference(x, y, 0.2)
    torch.testing.assert_close(torch.stack(shares).mean().double(), reference, rtol=1e-5, atol=1e-6)
    reference.backward()
    # each share's gradient for its own rows is world (2) × the full-batch gradient of those rows
    torch.testing.assert_close(torch.cat([gx for gx, _ in grads]) / 2, x.grad.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([gy for _, gy in grads]) / 2, y.grad.float(), rtol=1e-5, atol=1e-6)


def test_mms_refuses_normalisers_of_another_batch():
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    with pytest.raises(ValueError, match="gathered 2 normalisers for 4 rows"):
        mms_loss(x[:2], y[:2], x, y, 0, 0.1, gather=lambda local: local)


def test_mms_gradient_matches_reference():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, generator=g, requires_grad=True)
    y = torch.randn(5, 3, generator=g, requires_grad=True)
    mms_loss(x, y, x, y, 0, 0.1).backward()
    gx, gy = x.grad.clone(), y.grad.clone()
    x.grad = y.grad = None
    _mms_reference(x, y, 0.1).backward()
    torch.testing.assert_close(gx, x.grad.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gy, y.grad.float(), rtol=1e-5, atol=1e-6)


RING_PAIRS = [("text", "video"), ("audio", "text"), ("audio", "video")]


@pytest.mark.parametrize("margin", [0.0, 0.3])
def test_ring_mms_in_one_process_is_the_sum_of_the_pairs(margin):
    """World 1: the ring holds only this rank's rows; the sum and each pair equal the direct formula,
    the gradient is the sum's, the per-pair values carry none (tests/test_dist_losses.py: N ranks)."""
    g = torch.Generator().manual_seed(4)
    emb = {m: torch.randn(6, 5, generator=g, requires_grad=True) for m in ("text", "video", "audio")}
    total, per_pair = ring_mms_loss(emb, RING_PAIRS, margin, Collectives(), [6])
    assert not per_pair.requires_grad and per_pair.shape == (3,)
    references = [_mms_reference(emb[x], emb[y], margin) for x, y in RING_PAIRS]
    torch.testing.assert_close(per_pair.double(), torch.stack(references), rtol=1e-5, atol=1e-6)
    total.backward()
    got = {m: e.grad.clone() for m, e in emb.items()}
    for e in emb.values():
        e.grad = None
    sum(references).backward()
    for m, e in emb.items():
        torch.testing.assert_close(got[m], e.grad.float(), rtol=1e-5, atol=1e-6, msg=m)


def test_ring_mms_without_gradient_computes_none_and_refuses_ragged_rows():
    emb = {m: torch.randn(4, 3) for m in ("text", "video")}
    total, _ = ring_mms_loss(emb, [("text", "video")], 0.1, Collectives(), [4])
    assert not total.requires_grad
    with pytest.raises(ValueError, match=r"rank 0's rows .*'video': \(3, 3\).* b = 4"):
        ring_mms_loss({"text": emb["text"], "video": emb["video"][:3]}, [("text", "video")], 0.1, Collectives(), [4])
    with pytest.raises(ValueError, match="rank 0 passes 4 rows around the ring, its size says 5"):
        next(Collectives().ring((emb["text"],), [5]))


def test_objective_with_ring_equals_gathered_in_one_process():
    """``scale.ring_contrastive`` changes how the negatives travel, not the loss: every term and the
    embeddings' gradients as the gathered objective's."""
    g = torch.Generator().manual_seed(5)
    rows = {m: torch.randn(24, 8, generator=g) for m in ("video", "audio", "text")}
    results = []
    for ring in (False, True):
        objective = objective_for(config(BASE, **{"scale.ring_contrastive": ring}))
        assert objective.layout.ring is ring
        out = {m: r.clone().requires_grad_() for m, r in rows.items()}
        terms = objective(out, frozenset(rows), step=0)
        terms["total_loss"].backward()
        results.append(({k: v.detach() for k, v in terms.items()}, {m: e.grad for m, e in out.items()}))
    (terms, grads), (ring_terms, ring_grads) = results
    assert set(terms) == set(ring_terms)
    for name, value in terms.items():
        torch.testing.assert_close(ring_terms[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for m, grad in grads.items():
        torch.testing.assert_close(ring_grads[m], grad, rtol=1e-5, atol=1e-6, msg=m)


# --- cluster CE -----------------------------------------------------------------------------------
def test_cluster_ce_with_margin_by_hand():
    e = torch.tensor([[1.0, 0.0], [0.5, 2.0]])
    c = torch.tensor([[1.0, 1.0], [0.0, 1.0], [-1.0, 0.0]])
    labels = torch.tensor([2, 1])
    margin = 0.25
    expected = 0.0
    for i in range(2):
        logits = [float(e[i] @ c[k]) for k in range(3)]
        logits[int(labels[i])] -= margin
        expected += -(logits[int(labels[i])] - math.log(sum(math.exp(v) for v in logits)))
    expected /= 2
    got = cluster_ce(e, c, labels, margin)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(expected, rel=1e-5)


def test_cluster_ce_gives_no_gradient_to_centroids():
    e = torch.randn(4, 3, requires_grad=True)
    c = torch.randn(2, 3, requires_grad=True)
    cluster_ce(e, c, torch.tensor([0, 1, 1, 0]), 0.001).backward()
    assert e.grad is not None and c.grad is None


# --- reconstruction -------------------------------------------------------------------------------
def test_recon_by_hand_and_target_detach():
    pv, tv = torch.tensor([[1.0, 2.0], [0.0, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    pa, ta = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]), torch.tensor([[1.0, 1.0, 4.0], [2.0, 2.0, 2.0]])
    # per clip: video (1+4)/2, (1+1)/2 = 2.5, 1.0; audio 9/3, 0 = 3.0, 0.0 -> sums 5.5, 1.0 -> mean 3.25
    ta = ta.clone().requires_grad_(True)
    loss = recon_loss({"video": (pv, tv), "audio": (pa, ta)}, detach_targets=False)
    assert loss.item() == pytest.approx(3.25)
    loss.backward()
    assert ta.grad is not None and ta.grad.abs().sum() > 0
    ta.grad = None
    pa2 = pa.clone().requires_grad_(True)
    recon_loss({"audio": (pa2, ta)}, detach_targets=True).backward()
    assert ta.grad is None and pa2.grad is not None


# --- k-means --------------------------------------------------------------------------------------
def _blobs(seed: int = 0, per: int = 20):
    g = torch.Generator().manual_seed(seed)
    centers = torch.tensor([[5.0, 0.0, 0.0, 0.0], [0.0, 5.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    x = torch.cat([c + 0.3 * torch.randn(per, 4, generator=g) for c in centers])
    truth = torch.arange(3).repeat_interleave(per)
    perm = torch.randperm(x.shape[0], generator=g)
    return x[perm], truth[perm]


def _same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a[:, None] == a[None]) == (b[:, None] == b[None])).all())


def test_kmeans_deterministic_with_seed_and_recovers_blobs():
    x, truth = _blobs()
    c1, l1 = cosine_kmeans(x, 3, 50, 1e-6, generator=torch.Generator().manual_seed(7))
    c2, l2 = cosine_kmeans(x, 3, 50, 1e-6, generator=torch.Generator().manual_seed(7))
    assert torch.equal(c1, c2) and torch.equal(l1, l2)
    assert c1.dtype == torch.float32 and l1.dtype == torch.long and c1.shape == (3, 4)
    assert _same_partition(l1, truth)
    # centroids are plain means of the un-normalised members (original semantics)
    for k in range(3):
        torch.testing.assert_close(c1[k], x[l1 == k].mean(0))


def test_kmeans_labels_consistent_with_final_centroids_and_chunking():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, 6, generator=g)
    c, labels = cosine_kmeans(x, 4, 3, 0.0, generator=torch.Generator().manual_seed(0), chunk_rows=7)
    assert torch.equal(labels, assign_clusters(x, c))
    expected = (F.normalize(x, dim=1) @ F.normalize(c, dim=1).T).argmax(1)
    assert torch.equal(labels, expected)


def test_kmeans_reseeds_an_empty_cluster():
    x, truth = _blobs(seed=1)
    # Centroid 2 points away from every point: it is empty after the first assignment. The original
    # zeroed it; here it is re-seeded with the worst-fit point and the third blob is recovered.
    init = torch.tensor([[5.0, 0.0, 0.0, 0.0], [0.0, 5.0, 0.0, 0.0], [0.0, 0.0, 0.0, -1.0]])
    c, labels = cosine_kmeans(x, 3, 50, 1e-8, init=init)
    assert torch.bincount(labels, minlength=3).min() > 0
    assert c.norm(dim=1).min() > 1.0
    assert _same_partition(labels, truth)


def test_kmeans_one_iteration_reseed_is_deterministic_and_distinct():
    x, _ = _blobs(seed=2)
    init = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, -2.0]])
    c1, _ = cosine_kmeans(x, 3, 1, 0.0, init=init)
    c2, _ = cosine_kmeans(x, 3, 1, 0.0, init=init)
    assert torch.equal(c1, c2)
    # both empty centroids became (distinct) data points
    for k in (1, 2):
        assert (x == c1[k]).all(1).any()
    assert not torch.equal(c1[1], c1[2])


def test_kmeans_rejects_too_few_points():
    with pytest.raises(ValueError):
        cosine_kmeans(torch.randn(2, 3), 3, 5, 0.0)


# --- queue ----------------------------------------------------------------------------------------
def test_queue_fifo_newest_first_and_capacity():
    q = FeatureQueue(5, 2)
    assert len(q) == 0 and q.contents().shape == (0, 2)
    q.push(torch.tensor([[1.0, 1], [2, 2]]))
    q.push(torch.tensor([[3.0, 3], [4, 4]]))
    assert q.contents()[:, 0].tolist() == [3, 4, 1, 2]
    q.push(torch.tensor([[5.0, 5], [6, 6]]))  # wraps: the oldest row (2) falls off
    assert q.contents()[:, 0].tolist() == [5, 6, 3, 4, 1]
    q.push(torch.tensor([[7.0, 7], [8, 8], [9, 9]]))
    assert q.contents()[:, 0].tolist() == [7, 8, 9, 5, 6]
    q.push(torch.arange(14.0).view(7, 2))  # more than capacity: keep the first 5 of the push
    assert q.contents()[:, 0].tolist() == [0, 2, 4, 6, 8]
    assert len(q) == 5


def test_queue_bf16_storage_and_state_round_trip():
    q = FeatureQueue(6, 3, dtype=torch.bfloat16)
    rows = torch.randn(4, 3)
    q.push(rows)
    q.push(rows[:3] * 2)
    assert q._buf.dtype == torch.bfloat16
    out = q.contents()
    assert out.dtype == torch.float32 and out.shape == (6, 3)
    torch.testing.assert_close(out[:3], (rows[:3] * 2).bfloat16().float())
    q2 = FeatureQueue(6, 3, dtype=torch.bfloat16)
    q2.load_state_dict(q.state_dict())
    assert torch.equal(q2.contents(), q.contents())
    q2.push(rows[:1])
    q.push(rows[:1])
    assert torch.equal(q2.contents(), q.contents())


# --- objective ------------------------------------------------------------------------------------
def _out(b: int, d: int, seed: int, modalities=("video", "audio", "text"), recon=True):
    g = torch.Generator().manual_seed(seed)
    out = {m: torch.randn(b, d, generator=g).requires_grad_(True) for m in modalities}
    if recon:
        for m in modalities:
            out[f"recon_{m}"] = (out[m][:, :3] * 2, torch.randn(b, 3, generator=g))
    return out


def test_world_info_without_process_group():
    assert world_info() == (0, 1)


def test_objective_terms_inactive_modality_and_weighted_total():
    cfg = config(BASE, **{"loss.cluster_weight": 0.5, "loss.recon_weight": 3.0})
    obj = objective_for(cfg)
    out = _out(24, 8, 0)
    terms = obj(out, frozenset({"video", "audio"}), step=0)
    assert set(terms) == {"av_contrastive_loss", "contrastive_loss", "cluster_loss", "recon_loss", "total_loss"}
    assert all(t.ndim == 0 and t.dtype == torch.float32 for t in terms.values())
    torch.testing.assert_close(terms["contrastive_loss"], terms["av_contrastive_loss"])
    torch.testing.assert_close(terms["total_loss"], terms["contrastive_loss"] + 0.5 * terms["cluster_loss"]
                               + 3.0 * terms["recon_loss"])
    # recon covers only the active modalities
    expected_recon = recon_loss({m: out[f"recon_{m}"] for m in ("video", "audio")}, False)
    torch.testing.assert_close(terms["recon_loss"], expected_recon)
    # contrastive = MMS(a·vᵀ)
    torch.testing.assert_close(terms["av_contrastive_loss"], mms_loss(out["audio"], out["video"], out["audio"],
                                                                      out["video"], 0, cfg.loss.margin))
    terms["total_loss"].backward()
    assert out["text"].grad is None
    assert out["video"].grad is not None and out["audio"].grad is not None


def test_objective_all_pairs_and_cluster_variants():
    out = _out(24, 8, 1, recon=False)
    cfg = config(BASE)
    terms = objective_for(cfg)(out, frozenset({"video", "audio", "text"}), 0)
    assert set(terms) == {"tv_contrastive_loss", "at_contrastive_loss", "av_contrastive_loss", "contrastive_loss",
                          "cluster_loss", "total_loss"}
    torch.testing.assert_close(terms["contrastive_loss"], terms["tv_contrastive_loss"] + terms["at_contrastive_loss"]
                               + terms["av_contrastive_loss"])
    torch.testing.assert_close(terms["tv_contrastive_loss"],
                               mms_loss(out["text"], out["video"], out["text"], out["video"], 0, cfg.loss.margin))
    # cluster CE: labels from the fused vector, mean over the active modalities (not ÷3 of a subset)
    obj = objective_for(cfg)
    terms = obj(out, frozenset({"video", "text"}), 0)
    fused = (out["video"] + out["text"]) / 2
    labels = assign_clusters(fused, obj.cluster.centroids)
    expected = (cluster_ce(out["video"], obj.cluster.centroids, labels, cfg.loss.margin)
                + cluster_ce(out["text"], obj.cluster.centroids, labels, cfg.loss.margin)) / 2
    torch.testing.assert_close(terms["cluster_loss"], expected)
    cfg_f = config(BASE, **{"loss.cluster_on": "fused"})
    obj = objective_for(cfg_f)
    terms = obj(out, frozenset({"video", "text"}), 0)
    torch.testing.assert_close(terms["cluster_loss"], cluster_ce(fused, obj.cluster.centroids, labels, cfg.loss.margin))


def test_objective_queue_slice_from_config_refresh_and_stage_switch():
    cfg = config(BASE)  # 4 videos × 6 clips, fraction 0.5 -> 3 clips per video -> 12 rows per step
    assert cfg.queue_clips_per_video == 3 and cfg.queue_rows == 3 * 4 * 3
    obj = objective_for(cfg)
    active = frozenset({"video", "audio"})
    out0 = _out(24, 8, 0, recon=False)
    obj(out0, active, 0)
    assert len(obj.cluster.queue) == 12
    fused = ((out0["video"] + out0["audio"]) / 2).detach()
    expected_rows = fused.view(4, 6, 8)[:, :3].reshape(12, 8)
    torch.testing.assert_close(obj.cluster.queue.contents(), expected_rows)
    c0 = obj.cluster.centroids.clone()
    obj(_out(24, 8, 1, recon=False), active, 1)  # not a refresh step: centroids fixed
    assert torch.equal(obj.cluster.centroids, c0) and len(obj.cluster.queue) == 24
    obj(_out(24, 8, 2, recon=False), active, 2)  # refresh (warm start) on 24 queued + 24 current rows
    assert not torch.equal(obj.cluster.centroids, c0) and len(obj.cluster.queue) == 36
    obj(_out(24, 8, 3, recon=False), active, 3)
    assert len(obj.cluster.queue) == 36  # at capacity
    state = obj.cluster.state_dict()
    assert state["active"] == ["audio", "video"] and state["centroids"].shape == (3, 8)
    # stage switch: queue and centroids start over; the new active set is remembered
    obj(_out(24, 8, 4), frozenset({"video", "audio", "text"}), 5)
    assert len(obj.cluster.queue) == 12 and obj.cluster.active == frozenset({"video", "audio", "text"})
    # state round trip into a fresh objective
    obj2 = objective_for(cfg)
    obj2.cluster.load_state_dict(obj.cluster.state_dict())
    assert torch.equal(obj2.cluster.queue.contents(), obj.cluster.queue.contents())
    assert torch.equal(obj2.cluster.centroids, obj.cluster.centroids) and obj2.cluster.active == obj.cluster.active
    out = _out(24, 8, 9)
    t1 = obj(out, obj.cluster.active, 7)
    t2 = obj2(out, obj2.cluster.active, 7)
    torch.testing.assert_close(t1["total_loss"], t2["total_loss"])


def test_objective_bf16_queue_and_other_batch_shape():
    cfg = config(BASE, **{"loss.queue_dtype": "bfloat16", "data.clips_per_video": 4, "loss.queue_clip_fraction": 0.25})
    obj = objective_for(cfg)
    obj(_out(16, 8, 0, recon=False), frozenset({"audio", "text"}), 0)
    assert obj.cluster.queue._buf.dtype == torch.bfloat16 and len(obj.cluster.queue) == 4  # 4 videos × 1 clip


def test_objective_rejects_missing_modality_and_partial_videos():
    obj = objective_for(config(BASE))
    with pytest.raises(KeyError):
        obj(_out(24, 8, 0, modalities=("video",)), frozenset({"video", "audio"}), 0)
    with pytest.raises(ValueError):
        obj(_out(20, 8, 0), frozenset({"video", "audio"}), 0)  # 20 clips are not whole videos of 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queue_copy_into_equals_contents(dtype):
    from raymcn.losses.cluster import FeatureQueue

    q = FeatureQueue(10, 3, dtype=dtype, device=torch.device("cpu"))
    for i in range(4):  # 4 pushes of 3 rows into 10 slots: wraps around
        q.push(torch.arange(9, dtype=torch.float32).view(3, 3) + 10 * i)
        out = torch.full((len(q) + 2, 3), -1.0)
        assert q.copy_into(out, chunk_rows=4) == len(q)
        assert torch.equal(out[:len(q)], q.contents())
        assert (out[len(q):] == -1).all()
