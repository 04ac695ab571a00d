"""Exact gradient caching (raymcn.train.gradcache) in one process, on the tiny MCN.

Every stage order (its first-stage set for two steps, then all three modalities: a stage switch),
with and without reconstruction, chunks of one video, uneven chunks and one chunk; steps include
k-means refits and queue-using steps. Compared per step: every loss term, every parameter
gradient, the centroids, the queue, BatchNorm's running statistics. Tolerance 1e-5: relative, and
absolute against each gradient tensor's largest entry (DAVEnet's gradients reach 1e3 here, and
fp32 sums taken chunk by chunk round differently: measured ≤ 4e-7 of a tensor's norm).

What "exact" means under BatchNorm (see gradcache's module doc): with BN in eval mode, or one
chunk, the cached step equals the plain step; in training mode each chunk is normalised with its
own statistics, so the reference is the plain step over the chunk-by-chunk forward (one graph).
The 2-rank DDP version of these equalities is in test_dist_losses.py.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from conftest import TINY_MODEL, config, linear_mcn, objective_for, run_of

from raymcn.config import STAGE_ORDERS, Config, ConfigError
from raymcn.data.formats.batch import random_batch
from raymcn.losses import MCNObjective
from raymcn.model import MCN
from raymcn.train import gradcache
from raymcn.train.gradcache import cached_step, chunk_bounds, slice_batch
from raymcn.train.stages import ALL, first_stage

VIDEOS, CPV = 6, 2
CLIPS = VIDEOS * CPV  # 12 clips: chunks of 2 (one video), 8 (8 + 4) and 12 (one chunk)


BASE = {**TINY_MODEL, "model.recon": True, "data.batch_size": VIDEOS, "data.clips_per_video": CPV,
        "scale.num_workers": 0, "loss.num_clusters": 4, "loss.refresh_every": 2, "loss.queue_steps": 2,
        "loss.kmeans_iters": 30, "loss.kmeans_tol": 1e-8, "loss.recon_weight": 2.0, "run.seed": 3}


def _batch(cfg: Config, step: int) -> dict:
    batch = random_batch(cfg, CLIPS, seed=100 + step)
    # per-clip audio lengths, some beyond T (as an eval set stores them): every chunk pools with its own masks
    frames = cfg.data.audio_frames
    g = torch.Generator().manual_seed(step)
    batch["nframes"] = torch.randint(frames // 4, frames + 40, (CLIPS,), generator=g, dtype=torch.int32)
    return batch


def _linear_batch(cfg: Config, step: int) -> dict:
    """A batch for :func:`conftest.linear_mcn` (12 input features per modality)."""
    g = torch.Generator().manual_seed(step)
    return {m: torch.randn(CLIPS, 12, generator=g) for m in ("video", "audio", "text")}


def _sequence(order: str) -> list[frozenset[str]]:
    return [first_stage(order)] * 2 + [ALL] * 2


# --- the three ways of taking a step ------------------------------------------------------------------
def plain(model, objective, batch, active, step):
    terms = objective(model(batch, active), active, step)
    terms["total_loss"].backward()
    return terms


def cached(chunk: int):
    return lambda model, objective, batch, active, step: cached_step(model, objective, batch, active, step, chunk)


def chunkwise_graph(chunk: int):
    """The reference under training-mode BatchNorm: the plain step over a forward run chunk by
    chunk (each chunk normalised with its own statistics), one autograd graph; running statistics
    updated once, by the mean and unbiased variance of each layer's inputs over the whole share
    (computed from the concatenated inputs, independently of gradcache's pooling)."""
    def step_fn(model, objective, batch, active, step):
        layers = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) and m.training]
        seen: dict = {m: [] for m in layers}
        hooks = [m.register_forward_pre_hook(lambda mod, inp: seen[mod].append(inp[0].detach())) for m in layers]
        for m in layers:
            m.track_running_stats = False
        try:
            parts = [model(slice_batch(batch, s, e), active) for s, e in chunk_bounds(CLIPS, chunk)]
        finally:
            for m in layers:
                m.track_running_stats = True
            for h in hooks:
                h.remove()
        out = {k: (torch.cat([p[k][0] for p in parts]), torch.cat([p[k][1] for p in parts]))
               if isinstance(parts[0][k], tuple) else torch.cat([p[k] for p in parts]) for k in parts[0]}
        terms = plain(lambda b, a: out, objective, batch, active, step)
        with torch.no_grad():
            for m, xs in seen.items():
                if xs:
                    var, mean = torch.var_mean(torch.cat(xs).double(), dim=(0, 2, 3), correction=1)
                    m.num_batches_tracked += 1
                    m.running_mean.mul_(1 - m.momentum).add_(mean.float(), alpha=m.momentum)
                    m.running_var.mul_(1 - m.momentum).add_(var.float(), alpha=m.momentum)
        return terms
    return step_fn


def run(model, cfg: Config, order: str, step_fn, bn_eval: bool = False, seed: int | None = None,
        batch_fn=_batch) -> list[dict]:
    """Steps of ``order``'s sequence; per step what must be equal. ``seed``: reseed the global RNG
    before each step (a model with dropout); ``batch_fn(cfg, step)``: the step's batch."""
    model = copy.deepcopy(model)
    model.train()
    if bn_eval:
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.eval()
    objective = objective_for(cfg)
    records = []
    for step, active in enumerate(_sequence(order)):
        if seed is not None:
            torch.manual_seed(seed + step)
        model.zero_grad(set_to_none=True)
        terms = step_fn(model, objective, batch_fn(cfg, step), active, step)
        records.append({
            "where": f"order={order} step={step} active={sorted(active)}",
            "terms": {k: v.detach().clone() for k, v in terms.items()},
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            "centroids": objective.cluster.centroids.clone(), "queue": objective.cluster.queue.contents(),
            "buffers": {n: b.clone() for n, b in model.named_buffers()}, "rng": torch.get_rng_state()})
    return records


def assert_same(got: list[dict], ref: list[dict], rng: bool = False) -> None:
    tol = {"rtol": 1e-5, "atol": 1e-5}
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        where = r["where"]
        assert set(g["terms"]) == set(r["terms"]), where
        for k, v in r["terms"].items():
            torch.testing.assert_close(g["terms"][k], v, **tol, msg=lambda m: f"{where} {k}: {m}")
        for n, v in r["grads"].items():
            if v is None:
                assert g["grads"][n] is None, f"{where}: {n} got a gradient the plain step does not give"
                continue
            scale = float(v.abs().max().clamp_min(1.0))
            torch.testing.assert_close(g["grads"][n], v, rtol=1e-5, atol=1e-5 * scale,
                                       msg=lambda m: f"{where} grad {n}: {m}")
        torch.testing.assert_close(g["centroids"], r["centroids"], **tol, msg=lambda m: f"{where} centroids: {m}")
        torch.testing.assert_close(g["queue"], r["queue"], **tol, msg=lambda m: f"{where} queue: {m}")
        for n, v in r["buffers"].items():
            torch.testing.assert_close(g["buffers"][n], v, **tol, msg=lambda m: f"{where} buffer {n}: {m}")
        if rng:
            assert torch.equal(g["rng"], r["rng"]), f"{where}: the step left the RNG elsewhere"


def tiny_mcn(cfg: Config) -> MCN:
    torch.manual_seed(0)
    return MCN(cfg.model)


# --- exactness ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [CPV, 8, CLIPS], ids=["one-video", "uneven", "one-chunk"])
@pytest.mark.parametrize("recon", [True, False], ids=["recon", "no-recon"])
@pytest.mark.parametrize("order", STAGE_ORDERS)
def test_cached_step_equals_the_plain_step(order, recon, chunk):
    """BatchNorm in eval mode: a clip's forward does not depend on its chunk, so the cached step
    must equal the plain step itself."""
    cfg = config(BASE, **{"model.recon": recon})
    model = tiny_mcn(cfg)
    ref = run(model, cfg, order, plain, bn_eval=True)
    got = run(model, cfg, order, cached(chunk), bn_eval=True)
    assert_same(got, ref)
    assert ("recon_loss" in ref[0]["terms"]) == recon


@pytest.mark.parametrize("order", ["joint", "AV_T", "VT_A"])
@pytest.mark.parametrize("chunk", [4, 8])
def test_training_batchnorm_equals_the_chunkwise_step(order, chunk):
    """BatchNorm in training mode: equal to the plain step over the chunk-by-chunk forward, and
    the running statistics updated once per step with the whole share's statistics."""
    cfg = config(BASE)
    model = tiny_mcn(cfg)
    got = run(model, cfg, order, cached(chunk))
    assert_same(got, run(model, cfg, order, chunkwise_graph(chunk)))
    tracked = [v for n, v in got[-1]["buffers"].items() if n.endswith("num_batches_tracked")]
    stage1_audio = "audio" in first_stage(order)
    assert tracked and all(int(t) == (4 if stage1_audio else 2) for t in tracked)  # once per step that ran audio


@pytest.mark.parametrize("recon", [True, False], ids=["recon", "no-recon"])
def test_one_chunk_with_training_batchnorm_is_the_plain_step(recon):
    """One chunk: the step and PyTorch's own running-statistics update, exactly."""
    cfg = config(BASE, **{"model.recon": recon})
    model = tiny_mcn(cfg)
    assert_same(run(model, cfg, "joint", cached(CLIPS)), run(model, cfg, "joint", plain))


def test_chunk_statistics_do_change_the_gradient():
    """The reason for the chunkwise reference: with training-mode BN, chunks of two videos are
    not the plain step (if this ever passed, the test above would be vacuous)."""
    cfg = config(BASE)
    model = tiny_mcn(cfg)
    with pytest.raises(AssertionError):
        assert_same(run(model, cfg, "joint", cached(4)), run(model, cfg, "joint", plain))


@pytest.mark.parametrize("chunk", [CPV, 8])
def test_dropout_is_replayed_in_the_reforward(chunk):
    """A forward that draws random numbers: the re-forward sees the masks of the first pass, and
    the step leaves the generator where the chunk-by-chunk forward would."""
    cfg = config(BASE)
    model = linear_mcn(12, 32, dropout=0.3)
    ref = run(model, cfg, "joint", chunkwise_graph(chunk), seed=7, batch_fn=_linear_batch)
    got = run(model, cfg, "joint", cached(chunk), seed=7, batch_fn=_linear_batch)
    assert_same(got, ref, rng=True)


# --- a deliberately broken cache must fail the equality ---------------------------------------------------------


@pytest.mark.parametrize("sabotage", ["no-rng-replay", "recon-weighted-twice", "bn-updated-per-chunk"])
def test_a_broken_cache_fails_the_equality(monkeypatch, sabotage):
    cfg = config(BASE)
    if sabotage == "no-rng-replay":
        model, seed = linear_mcn(12, 32, dropout=0.3), 7
        monkeypatch.setattr(gradcache, "_set_rng_state", lambda state, device: None)
        reference = chunkwise_graph(CPV)
    elif sabotage == "recon-weighted-twice":
        model, seed = linear_mcn(12, 32), None
        real = MCNObjective.recon_term  # a chunk's part (fraction < 1) weighted twice; the whole share's as before
        monkeypatch.setattr(MCNObjective, "recon_term",
                            lambda self, pairs, rows, fraction=1.0: real(self, pairs, rows, fraction) * (
                                2 if fraction < 1 else 1))
        reference = plain
    else:
        model, seed = tiny_mcn(cfg), None
        monkeypatch.setattr(gradcache.ChunkedBatchNorm, "frozen", lambda self: contextlib.nullcontext())
        reference = chunkwise_graph(CPV)
    batch_fn = _batch if sabotage == "bn-updated-per-chunk" else _linear_batch
    ref = run(model, cfg, "joint", reference, seed=seed, batch_fn=batch_fn)
    got = run(model, cfg, "joint", cached(CPV), seed=seed, batch_fn=batch_fn)
    with pytest.raises(AssertionError):
        assert_same(got, ref)


# --- through the training loop ----------------------------------------------------------------------------------
def _loop(cfg: Config, steps: int = 3, fault: str = "") -> tuple[dict, dict]:
    """``steps`` steps of the training loop on the linear stand-in, with ``RAYMCN_FAULT=fault``
    installed as a rank installs it at its start."""
    from raymcn.environment import Environment
    from raymcn.train import faults
    from raymcn.train.loop import train_one_epoch

    model = linear_mcn(12, 32)
    run = run_of(cfg, model)
    faults.install(run, Environment(fault=fault))
    metrics = train_one_epoch(run, [_linear_batch(cfg, s) for s in range(steps)])
    return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_loop_with_caching_trains_as_without():
    base = {"optim.warmup_steps": 0, "optim.lr": 1e-2, "optim.grad_clip": 1.0}
    ref_metrics, ref_params = _loop(config(BASE, base))
    metrics, params = _loop(config(BASE, base, **{"scale.grad_cache_clips": 4}))
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    for key in [k for k in ref_metrics if k.endswith("_loss")]:
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-6), key
    assert metrics["time_reforward_s"] > 0 and ref_metrics["time_reforward_s"] == 0


def test_a_nonfinite_cached_step_is_skipped():
    cfg = config(BASE, **{"scale.grad_cache_clips": 4, "optim.max_nonfinite_steps": 1})
    metrics, _ = _loop(cfg, fault="nan_at_step=1")
    assert metrics["skipped_steps"] == 1


def test_chunks_must_be_whole_videos():
    with pytest.raises(ConfigError, match=r"scale.grad_cache_clips=3 is not a multiple of data.clips_per_video=2"):
        config(BASE, **{"scale.grad_cache_clips": 3})
    with pytest.raises(ConfigError, match=r"scale.grad_cache_clips=-2: must be >= 0"):
        config(BASE, **{"scale.grad_cache_clips": -2})
    cfg = config(BASE)
    with pytest.raises(ValueError, match="whole videos of 2 clips"):
        cached_step(tiny_mcn(cfg), objective_for(cfg), _batch(cfg, 0), ALL, 0, 3)
