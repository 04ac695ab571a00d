"""Per-worker memory estimate (raymcn.train.footprint): scaling of each component, the paper
numbers of spec §2.5, the fit check, and the formulas against measured tiny-model runs."""

from __future__ import annotations

import pytest
import torch

from raymcn.config import Config, ModelConfig
from raymcn.train import footprint
from raymcn.train.footprint import GIB, estimate_worker_memory, fits

TINY = {"model.embed_dim": 32, "model.audio_channels": [4, 4, 8, 8, 16], "model.recon_hidden": 16,
        "model.video_dim": 24, "model.word_dim": 12, "data.audio_frames": 160}


def _cfg(**overrides) -> Config:
    return Config().replace(overrides)


@pytest.fixture(scope="module")
def paper_params() -> tuple[int, int]:
    return footprint.parameter_stats(ModelConfig())


@pytest.mark.parametrize("overrides", [
    {"embed_dim": 32, "audio_channels": (4, 4, 8, 8, 16), "recon_hidden": 16},
    {"embed_dim": 24, "audio_channels": (3, 5, 6, 7, 9), "audio_blocks": 3, "video_dim": 20, "word_dim": 7},
    {"embed_dim": 16, "audio_channels": (4, 4, 8, 8, 16), "recon": False, "mel_bins": 10},
])
def test_analytic_parameter_count_equals_the_model(overrides):
    from raymcn.model import MCN

    cfg = ModelConfig(**overrides)
    model = MCN(cfg)
    sizes, buffers = footprint._parameter_tensors(cfg)
    assert sorted(sizes) == sorted(p.numel() for p in model.parameters())
    assert buffers == sum(b.numel() for b in model.buffers() if b.is_floating_point())


# --- scaling ------------------------------------------------------------------------------------------
def test_parameter_terms_do_not_depend_on_the_batch(paper_params):
    small = estimate_worker_memory(_cfg(**{"data.batch_size": 8}), params=paper_params)
    large = estimate_worker_memory(_cfg(**{"data.batch_size": 256}), params=paper_params)
    for key in ("params", "adam_moments", "optimizer_workspace"):
        assert small[key] == large[key] > 0
    for est in (small, large):  # one gradient copy: in DDP's buckets, or plain grads with one worker
        assert est["grads"] + est["ddp_buckets"] == est["params"]
    assert large["activations"] == 32 * small["activations"]  # linear in the clips per worker


@pytest.mark.parametrize("batch,workers", [(8, 1), (16, 2), (64, 4), (128, 4), (128, 2)])
def test_slab_term_is_proportional_to_local_times_global_clips(paper_params, batch, workers):
    cfg = _cfg(**{"data.batch_size": batch, "scale.num_workers": workers})
    b, big_b = cfg.videos_per_worker * cfg.data.clips_per_video, cfg.clips_per_step
    slabs = estimate_worker_memory(cfg, params=paper_params)["loss_slabs"]
    # (2 per pair x 3 pairs + 3 transient) b x B fp32 slabs, whatever the split
    assert slabs == 9 * b * big_b * 4


def test_gathered_embeddings_only_with_several_workers(paper_params):
    one = estimate_worker_memory(_cfg(**{"scale.num_workers": 1}), params=paper_params)
    four = estimate_worker_memory(_cfg(**{"scale.num_workers": 4}), params=paper_params)
    assert one["gathered_embeddings"] == 0 and one["ddp_buckets"] == 0
    assert four["gathered_embeddings"] == 3 * 4096 * 6144 * 4  # detached: no gradient copy
    assert four["ddp_buckets"] == four["params"]


@pytest.mark.parametrize("steps", [1, 5, 20])
def test_queue_term_is_rows_times_dim_times_dtype(paper_params, steps):
    f32 = _cfg(**{"loss.queue_steps": steps})
    bf16 = _cfg(**{"loss.queue_steps": steps, "loss.queue_dtype": "bfloat16"})
    q32 = estimate_worker_memory(f32, params=paper_params)["queue"]
    q16 = estimate_worker_memory(bf16, params=paper_params)["queue"]
    assert q32 == f32.queue_rows * 6144 * 4
    assert q16 * 2 == q32


def test_gpu_estimate_uses_bf16_activations_and_autocast_copies(paper_params):
    cpu = estimate_worker_memory(_cfg(**{"scale.num_workers": 4}), params=paper_params)
    gpu = estimate_worker_memory(_cfg(**{"scale.num_workers": 4, "scale.use_gpu": True}), params=paper_params)
    assert gpu["activations"] * 2 == cpu["activations"]
    assert cpu["autocast_weights"] == 0 and gpu["autocast_weights"] == gpu["params"] // 2


def test_total_is_persistent_plus_the_larger_phase(paper_params):
    est = estimate_worker_memory(_cfg(), params=paper_params)
    persistent = sum(est[k] for k in footprint.PERSISTENT)
    step = sum(est[k] for k in footprint.STEP_PHASE)
    assert est["total"] == persistent + max(step, est["optimizer_workspace"])
    assert set(est) >= set(footprint.PERSISTENT) | set(footprint.STEP_PHASE) | {"optimizer_workspace", "total"}


# --- paper numbers (spec §2.5, §6 "single-GPU estimate", §7) -------------------------------------------
def test_paper_defaults_match_the_spec(paper_params):
    n, largest = paper_params
    bn_stats = 2 * (128 + 5 * (128 + 256 + 512 + 1024))  # running mean/var: conv1's BN + 5 BNs per layer
    assert n - bn_stats == 223_776_768  # "223.8 M"
    assert largest == 6144 * 6144  # GU_text's linear layers
    assert footprint.count_parameters(ModelConfig(recon=False)) < 193.5e6  # "193.4 M without the heads"
    est = estimate_worker_memory(_cfg(**{"scale.num_workers": 1}), params=paper_params)
    assert 3.5e9 < est["params"] + est["grads"] + est["ddp_buckets"] + est["adam_moments"] < 3.7e9  # "≈ 3.6 GB"
    assert est["queue"] == 40960 * 6144 * 4 and abs(est["queue"] / GIB - 0.94) < 0.005  # "0.94 GiB fp32"
    x_bytes = 45056 * 6144 * 4  # X (1.03 GiB), built in place, plus the Lloyd workspace
    assert x_bytes < est["kmeans_input"] < 1.05 * x_bytes
    per_clip = est["activations"] / 4096
    assert 11.0e6 < per_clip < 11.5e6  # "≈ 11.3 MB per clip fp32"
    assert 44e9 < est["activations"] < 48e9  # "≈ 46 GB fp32 for 4096 clips"
    davenet = footprint.activation_elements_per_clip(ModelConfig(), 1000)["audio"] * 4
    assert 0.9 < davenet / per_clip < 0.95  # "DAVEnet ≈ 92 %"
    gpu = estimate_worker_memory(_cfg(**{"scale.num_workers": 1, "scale.use_gpu": True}), params=paper_params)
    assert 22e9 < gpu["activations"] < 30e9  # "≈ 23–30 GB in bf16" (ours: exactly half of fp32)
    # §6: activations 23–30 GB + ≈3.6 GB parameters and Adam + ≈2–3 GB queue and k-means, so "one
    # 80 GB H100 should hold the original batch in bf16".
    assert 29e9 < gpu["total"] < 37e9 and gpu["total"] < 0.9 * 80 * GIB


# --- fits ---------------------------------------------------------------------------------------------
def test_fits_accepts_a_large_device():
    ok, msg, cpv = fits(_cfg(**{"scale.num_workers": 4, "scale.use_gpu": True}), 80 * GIB)
    assert ok and cpv == 32 and msg.startswith("fits")


def test_fits_refuses_and_suggests_a_smaller_clips_per_video_that_fits():
    cfg = _cfg(**{"scale.num_workers": 1, "scale.use_gpu": True})  # the original batch on one GPU
    device = 24 * GIB
    ok, msg, cpv = fits(cfg, device)
    assert not ok
    assert cpv is not None and 1 <= cpv < 32
    assert f"data.clips_per_video={cpv}" in msg and "does not fit" in msg
    smaller = cfg.replace({"data.clips_per_video": cpv})
    assert estimate_worker_memory(smaller)["total"] <= 0.9 * device  # the suggestion fits ...
    bigger = cfg.replace({"data.clips_per_video": cpv + 1})
    assert estimate_worker_memory(bigger)["total"] > 0.9 * device  # ... and is the largest that does
    assert fits(smaller, device)[0]


def test_fits_says_so_when_no_clips_per_video_helps():
    ok, msg, cpv = fits(_cfg(**{"scale.num_workers": 1}), 2 * GIB)  # the parameters alone need 3.6 GB
    assert not ok and cpv is None
    assert "No smaller data.clips_per_video fits" in msg


def test_fits_never_suggests_fewer_clips_than_clusters():
    # batch 16 videos, K = 256: clips_per_video must stay >= 16 for k-means' first refit.
    cfg = _cfg(**{"scale.num_workers": 1, "scale.use_gpu": True, "data.batch_size": 16})
    ok, _, cpv = fits(cfg, 4 * GIB)
    assert not ok and (cpv is None or cpv >= 16)


# --- formulas against measurement (tiny model, fast) -------------------------------------------------------
def _tiny_batch(cfg: Config, clips: int) -> dict:
    g = torch.Generator().manual_seed(0)
    m, d = cfg.model, cfg.data
    return {"video": torch.rand(clips, m.video_dim, generator=g),
            "audio": torch.randn(clips, m.mel_bins, d.audio_frames, generator=g).half(),
            "nframes": torch.full((clips,), d.audio_frames, dtype=torch.int32),
            "text": torch.randn(clips, d.max_words, m.word_dim, generator=g)}


@pytest.mark.parametrize("active", [("video",), ("audio",), ("text",), ("video", "audio", "text")])
def test_activation_formula_equals_the_saved_tensors(active):
    from raymcn.model import MCN

    cfg = _cfg(**TINY)
    torch.manual_seed(0)
    model = MCN(cfg.model)
    clips = 6
    batch = _tiny_batch(cfg, clips)
    inputs = tuple(v for v in batch.values() if isinstance(v, torch.Tensor))
    state = tuple(model.parameters()) + tuple(model.buffers())
    out, saved = footprint.saved_tensor_bytes(lambda: model(batch, active), exclude=state + inputs)
    del out
    formula = footprint.activation_elements_per_clip(cfg.model, cfg.data.audio_frames, active,
                                                     cfg.data.max_words)
    # BatchNorm also saves its batch mean and inverse std: per channel, not per clip.
    bn = sum(2 * m.num_features * 4 for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert saved == sum(formula.values()) * 4 * clips + (bn if "audio" in active else 0)


def test_peak_meter_sees_temporaries():
    def work() -> torch.Tensor:
        a = torch.ones(1000, 1000)  # 4 MB, kept
        b = torch.ones(1000, 1000) * 2  # 2 x 4 MB while the product is formed, then freed
        del b
        return a

    kept, peak, end = footprint.peak_allocated_bytes(work)
    assert end == kept.nbytes == 4_000_000
    assert peak >= 12_000_000


def test_estimate_bounds_a_measured_tiny_training_step():
    """The whole estimate against torch's allocator on a real (tiny) step, as bench/step.py does at
    paper dims: it must not under-estimate, and stay within 2x here (fixed costs weigh more)."""
    from torch.profiler import ProfilerActivity, profile

    from raymcn.losses import MCNObjective
    from raymcn.model import MCN
    from raymcn.train.loop import LoopState, build_optimizer, build_scheduler, train_one_epoch

    cfg = _cfg(**TINY, **{"data.batch_size": 4, "data.clips_per_video": 8, "loss.num_clusters": 8,
                          "scale.num_workers": 0})
    cpu = torch.device("cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = MCN(cfg.model)
        batch = _tiny_batch(cfg, 32)
        opt = build_optimizer(model, cfg)
        objective = MCNObjective(cfg, cfg.model.embed_dim, cpu)
        state = LoopState()
        for _ in range(2):
            train_one_epoch(model, objective, opt, build_scheduler(opt, cfg, 100), [batch], cfg=cfg, state=state,
                            device=cpu, switch=0)
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    est = estimate_worker_memory(cfg)["total"]
    assert peak <= est <= 2 * peak
