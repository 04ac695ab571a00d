"""Per-worker memory estimate (raymcn.train.preflight.footprint): scaling of each component, the paper
numbers of the original's memory accounting, the fit check, the model's terms read from its traced
forward against the real module and torch's allocator (the default parts and a toy part added by
its class and table entry alone)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, config, last_json, objective_for, run_of
from toy_parts import TOY, OneLayerTextEncoder, UnnormalizedTextEncoder, registered

from bench import meters
from raymcn.config import MODALITIES, Config, ModelConfig
from raymcn.data.formats.batch import random_batch
from raymcn.train.preflight import convspace, footprint
from raymcn.train.preflight.footprint import GIB, estimate_worker_memory, fits

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL_WORDS = Config().data.max_words  # the batches' words per caption (TINY_MODEL keeps the default)


def _counters(cfg: Config) -> int:
    """Bytes of the model's non-float buffers (BatchNorm's int64 batch counters): no gradient, no Adam."""
    t = footprint.model_trace(cfg)
    return t.state_bytes - 4 * (t.parameters + t.float_buffers)


def _real(model_cfg: ModelConfig):
    from raymcn.model import MCN

    torch.manual_seed(0)
    return MCN(model_cfg)


@pytest.mark.parametrize("overrides", [
    {"embed_dim": 32, "audio_channels": (4, 4, 8, 8, 16), "recon_hidden": 16},
    {"embed_dim": 24, "audio_channels": (3, 5, 6, 7, 9), "audio_blocks": 3, "video_dim": 20, "word_dim": 7},
    {"embed_dim": 16, "audio_channels": (4, 4, 8, 8, 16), "recon": False, "mel_bins": 10},
])
def test_the_traced_parameters_buffers_and_widths_are_the_modules(overrides):
    """What the trace reads from the model built on the meta device is the real module's."""
    cfg = config(**{f"model.{k}": list(v) if isinstance(v, tuple) else v for k, v in overrides.items()})
    model, t = _real(cfg.model), footprint.model_trace(cfg)
    assert t.parameters == sum(p.numel() for p in model.parameters())
    assert t.float_buffers == sum(b.numel() for b in model.buffers() if b.is_floating_point())
    assert t.state_bytes == sum(x.numel() * x.element_size() for x in [*model.parameters(), *model.buffers()])
    assert t.largest_parameter == max(p.numel() for p in model.parameters())
    out = model(random_batch(cfg, 2), MODALITIES)
    assert t.embed_dim == out["video"].shape[-1] == cfg.model.embed_dim
    targets = [out[f"recon_{m}"][1] for m in MODALITIES if f"recon_{m}" in out]
    assert t.recon_width == sum(x.shape[-1] for x in targets)
    assert t.recon_live_width == sum(x.shape[-1] for x in targets if x.requires_grad)
    assert t.recon_live_width < t.recon_width or not targets  # the video target is the input: no gradient


HAND_KEPT = "b821c85"  # preflight.json's commit when the estimate kept its own copy of the architecture


def test_the_default_models_estimate_is_within_one_percent_of_the_hand_kept_copys():
    """The estimate read from the model itself, against the figures the preflight printed when it
    kept a hand-written copy of the architecture (docs/measurements/preflight.json as it was at
    b821c85): for the paper's batch on one 24 GB and one 40 GB GPU every GiB figure and chunk size
    of the messages within 1 %, the advice the same."""
    from bench.grad_cache import preflight_messages

    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{HAND_KEPT}:docs/measurements/preflight.json"],
                         capture_output=True, text=True, check=False)
    if old.returncode:
        pytest.skip(f"no git history of {HAND_KEPT} in this checkout: {old.stderr.strip()}")
    figures = re.compile(r"(\d+(?:\.\d+)?) (?:GiB|clips)")
    now = preflight_messages()
    for then, today in zip(json.loads(old.stdout)["preflight"], now, strict=True):
        assert today["overrides"] == then["overrides"], (then["device"], today["overrides"])
        for key in ("message", "then"):
            a, b = (list(map(float, figures.findall(row[key]))) for row in (then, today))
            assert len(a) == len(b) > 3 and all(abs(y - x) <= 0.01 * x for x, y in zip(a, b)), (key, a, b)


def test_todays_estimate_holds_the_peaks_the_gpu_measured():
    """The workloads bench.gpu_smoke ran on the H200 (docs/measurements/gpu_smoke.json): today's
    estimate, the model traced here, is still at or above each measured peak, and not far above."""
    from bench.gpu_smoke import todays_estimate_over_peak

    recorded = json.loads((ROOT / "docs/measurements/gpu_smoke.json").read_text())
    ratios = todays_estimate_over_peak(recorded)
    assert set(ratios) == {"plain", "cached", "ring"} and all(1.0 <= r < 1.25 for r in ratios.values()), ratios


def test_the_preflight_reads_the_model_only_through_its_trace():
    """No file of the preflight describes the architecture a second time: none reads a model
    setting's widths or imports a model class other than the whole model and its parts' table."""
    widths = re.compile(r"\.model\.(video_dim|word_dim|embed_dim|audio_channels|audio_blocks|mel_bins|recon_hidden)\b"
                        r"|model_cfg\.|\b(DAVEnet|GatedEmbeddingUnit|SentenceMaxpool|ContextGating)\b")
    found = [f"{p.name}:{n}: {line.strip()}" for p in sorted((ROOT / "raymcn/train/preflight").glob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if widths.search(line)]
    assert found == []
    assert widths.search("cfg.model.audio_channels") and widths.search("import DAVEnet")  # the check can fail


# --- scaling ------------------------------------------------------------------------------------------
def test_parameter_terms_do_not_depend_on_the_batch():
    small = estimate_worker_memory(config(**{"data.batch_size": 8}))
    large = estimate_worker_memory(config(**{"data.batch_size": 256}))
    for key in ("params", "adam_moments", "optimizer_workspace"):
        assert small[key] == large[key] > 0
    counters = _counters(config())  # BN's int64 batch counters: no gradient
    for est in (small, large):  # one gradient copy: in DDP's buckets, or plain grads with one worker
        assert est["grads"] + est["ddp_buckets"] == est["params"] - counters
    bn = footprint.model_trace(config()).line()[0]  # BatchNorm's statistics: per step, not per clip
    assert bn > 0 and large["activations"] - bn == 32 * (small["activations"] - bn)  # linear in the clips


@pytest.mark.parametrize("batch,workers", [(8, 1), (16, 2), (64, 4), (128, 4), (128, 2)])
def test_slab_term_is_proportional_to_local_times_global_clips(batch, workers):
    cfg = config(**{"data.batch_size": batch, "scale.num_workers": workers})
    b, big_b = batch // workers * cfg.data.clips_per_video, cfg.clips_per_step
    slabs = estimate_worker_memory(cfg)["loss_slabs"]
    # (2 per pair x 3 pairs + 3 transient) b x B fp32 slabs, whatever the split
    assert slabs == 9 * b * big_b * 4


def test_gathered_embeddings_only_with_several_workers():
    one = estimate_worker_memory(config(**{"scale.num_workers": 1}))
    four = estimate_worker_memory(config(**{"scale.num_workers": 4}))
    assert one["gathered_embeddings"] == 0 and one["ddp_buckets"] == 0
    # v, a, t detached (no gradient copy), the fused rows and the queue's half of them
    assert four["gathered_embeddings"] == (3 + 1 + 0.5) * 4096 * 6144 * 4
    assert four["ddp_buckets"] == four["params"] - _counters(config())


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_ring_keeps_two_shares_or_the_fused_rows_not_three_gathered_modalities(workers):
    gathered = estimate_worker_memory(config(**{"scale.num_workers": workers}))
    ring = estimate_worker_memory(config(**{"scale.num_workers": workers, "scale.ring_contrastive": True}))
    b = 4096 // workers
    blocks = min(workers - 1, 2) * b * 3 * 6144 * 4  # the block in use and the one arriving
    fused = 1.5 * 4096 * 6144 * 4  # the cluster term's fused rows and the queue's half of them
    assert ring["gathered_embeddings"] == max(blocks, fused) < gathered["gathered_embeddings"]
    assert ring["loss_slabs"] == 3 * b * b * 4 < gathered["loss_slabs"]  # b×b tiles, nothing b×B
    assert ring["total"] < gathered["total"]


@pytest.mark.parametrize("steps", [1, 5, 20])
def test_queue_term_is_rows_times_dim_times_dtype(steps):
    f32 = config(**{"loss.queue_steps": steps})
    bf16 = config(**{"loss.queue_steps": steps, "loss.queue_dtype": "bfloat16"})
    q32 = estimate_worker_memory(f32)["queue"]
    q16 = estimate_worker_memory(bf16)["queue"]
    assert q32 == f32.queue_rows * 6144 * 4
    assert q16 * 2 == q32


def test_gpu_estimate_counts_autocasts_dtypes_and_its_weight_copies():
    """On GPU the same saved tensors at CUDA's autocast dtypes: at paper dims about half the fp32
    bytes (DAVEnet and the gated units compute in bf16), more than half (BatchNorm's statistics
    stay fp32, max-pool's indices int64, the video input gets a bf16 copy of its own)."""
    cpu = estimate_worker_memory(config(**{"scale.num_workers": 4}))
    gpu = estimate_worker_memory(config(**{"scale.num_workers": 4, "scale.use_gpu": True}))
    assert 0.5 * cpu["activations"] < gpu["activations"] < 0.51 * cpu["activations"]
    trace = footprint.model_trace(config())
    assert cpu["autocast_weights"] == 0 and gpu["autocast_weights"] == 2 * (trace.parameters + trace.float_buffers)


def test_total_is_persistent_plus_the_larger_phase():
    est = estimate_worker_memory(config())
    persistent = sum(est[k] for k in footprint.PERSISTENT)
    step = sum(est[k] for k in footprint.STEP_PHASE)
    assert est["total"] == persistent + max(step, est["batch"] + est["optimizer_workspace"])
    assert set(est) >= set(footprint.PERSISTENT) | set(footprint.STEP_PHASE) | {"optimizer_workspace", "total"}


# --- paper numbers -------------------------------------------
def test_paper_defaults_match_the_spec():
    trace = footprint.model_trace(config())
    bn_stats = 2 * (128 + 5 * (128 + 256 + 512 + 1024))  # running mean/var: conv1's BN + 5 BNs per layer
    assert trace.float_buffers == bn_stats and trace.parameters == 223_776_768  # "223.8 M"
    assert trace.largest_parameter == 6144 * 6144  # GU_text's linear layers
    assert footprint.model_trace(config(**{"model.recon": False})).parameters < 193.5e6  # "193.4 M without the heads"
    est = estimate_worker_memory(config(**{"scale.num_workers": 1}))
    assert 3.5e9 < est["params"] + est["grads"] + est["ddp_buckets"] + est["adam_moments"] < 3.7e9  # "≈ 3.6 GB"
    assert est["queue"] == 40960 * 6144 * 4 and abs(est["queue"] / GIB - 0.94) < 0.005  # "0.94 GiB fp32"
    x_bytes = 45056 * 6144 * 4  # X (1.03 GiB), built in place, plus the Lloyd workspace
    assert x_bytes < est["kmeans_input"] < 1.06 * x_bytes  # plus the copy chunk and Lloyd workspace
    per_clip = est["activations"] / 4096
    assert 11.0e6 < per_clip < 11.5e6  # "≈ 11.3 MB per clip fp32"
    assert 44e9 < est["activations"] < 48e9  # "≈ 46 GB fp32 for 4096 clips"
    gpu = estimate_worker_memory(config(**{"scale.num_workers": 1, "scale.use_gpu": True}))
    assert 22e9 < gpu["activations"] < 30e9  # "≈ 23–30 GB in bf16" (ours: half of fp32, and a little more)
    # the paper-scale estimate: activations 23–30 GB + ≈3.6 GB parameters and Adam + ≈2–3 GB queue and
    # k-means, so "one 80 GB H100 should hold the original batch in bf16".
    # cuDNN's workspace is not part of that sum; the estimate adds it as a stated margin.
    assert 29e9 < gpu["total"] - gpu["conv_workspace"] < 37e9 and gpu["total"] < 0.9 * 80 * GIB


# --- fits ---------------------------------------------------------------------------------------------
def test_fits_accepts_a_large_device():
    ok, msg, over = fits(config(**{"scale.num_workers": 4, "scale.use_gpu": True}), 80 * GIB)
    assert ok and over == {} and msg.startswith("fits")


def _paper_on_one_gpu() -> Config:
    # the paper's 128 videos x 32 clips (docs/memory.md)
    return config(**{"scale.num_workers": 1, "scale.use_gpu": True})


@pytest.mark.parametrize("device", [24 * 10**9, 40 * 10**9, 24 * GIB], ids=["24GB", "40GB-A100", "24GiB"])
def test_the_papers_batch_fits_one_gpu_with_gradient_caching(device):
    """The original batch on one 24 GB or 40 GB GPU: refused as is; the first suggestion is gradient
    caching (the objective unchanged), with the fewest chunks that fit, as equal as whole videos allow."""
    cfg = _paper_on_one_gpu()
    usable = 0.9 * device
    ok, msg, over = fits(cfg, device)
    assert not ok and estimate_worker_memory(cfg)["total"] > usable
    assert set(over) == {"scale.grad_cache_clips"}, over
    n = over["scale.grad_cache_clips"]
    assert f"Try scale.grad_cache_clips={n}" in msg and "the same loss, BatchNorm's statistics per chunk" in msg
    chunked = cfg.replace(over)
    assert (chunked.data.batch_size, chunked.data.clips_per_video) == (128, 32)  # the objective is unchanged
    assert n % 32 == 0 and 0 < n < 4096 and estimate_worker_memory(chunked)["total"] <= usable
    assert fits(chunked, device)[0]
    # the fewest chunks: the largest chunk that fits needs as many; and they are as equal as videos allow
    largest = footprint.largest_fitting_chunk(cfg, int(usable), lambda c: estimate_worker_memory(c)["total"])
    assert estimate_worker_memory(cfg.replace({"scale.grad_cache_clips": largest}))["total"] <= usable
    if largest + 32 < 4096:
        assert estimate_worker_memory(cfg.replace({"scale.grad_cache_clips": largest + 32}))["total"] > usable
    chunks = -(-4096 // n)
    assert chunks == -(-4096 // largest) and n - (4096 - (chunks - 1) * n) < chunks * 32


def test_caching_makes_the_activations_a_chunks_whatever_the_batch():
    """Activations and conv workspace are O(chunk); what grows with the share is the cache (its
    embeddings) and the batch itself; the reconstruction gradients are one chunk's too."""
    ests = [estimate_worker_memory(config(**{"scale.num_workers": 1, "data.batch_size": v,
                                           "scale.grad_cache_clips": 256})) for v in (16, 64, 128)]
    for key in ("activations", "conv_workspace", "recon_grads", "grad_accumulation"):
        assert ests[0][key] == ests[1][key] == ests[2][key] > 0, key
    assert ests[2]["grad_cache"] == 8 * ests[0]["grad_cache"] == 128 * 32 * 3 * 6144 * 4
    plain = estimate_worker_memory(config(**{"scale.num_workers": 1}))
    assert plain["grad_cache"] == plain["recon_grads"] == plain["grad_accumulation"] == 0
    fixed = footprint.model_trace(config()).line()[0]  # BatchNorm's statistics, once per forward
    assert ests[2]["activations"] * 16 - 15 * fixed == plain["activations"]
    # with caching the loss phase and the chunk phase never overlap
    est = ests[2]
    persistent = sum(est[k] for k in footprint.PERSISTENT)
    step = sum(est[k] for k in footprint.STEP_COMMON) + max(sum(est[k] for k in footprint.LOSS_PHASE),
                                                            sum(est[k] for k in footprint.CHUNK_PHASE))
    assert est["total"] == persistent + max(step, est["batch"] + est["optimizer_workspace"])


def test_a_chunk_as_large_as_the_share_is_the_plain_step():
    plain = estimate_worker_memory(config(**{"scale.num_workers": 2}))
    for n in (2048, 4096):  # rank 0's share is 2048 clips: the loop takes the plain step
        cfg = config(**{"scale.num_workers": 2, "scale.grad_cache_clips": n})
        assert footprint.cached_chunk(cfg) == 0 and estimate_worker_memory(cfg) == plain


def test_fewer_clips_only_when_no_chunk_fits():
    cfg = _paper_on_one_gpu()
    device = 8 * GIB  # the loss on the whole share alone (slabs, k-means input, cache) leaves no room
    ok, msg, over = fits(cfg, device)
    assert not ok and "Not even gradient caching with one video per chunk fits" in msg
    assert over is not None and 1 <= over["data.clips_per_video"] < 32
    assert estimate_worker_memory(cfg.replace({"scale.grad_cache_clips": 32}))["total"] > 0.9 * device
    assert estimate_worker_memory(cfg.replace(over))["total"] <= 0.9 * device
    assert "Try data.clips_per_video=" in msg and "another objective" in msg


def _device_between(low: Config, high: Config) -> int:
    """Device bytes whose usable 90 % lies halfway between the two configs' estimates (low < high)."""
    a, b = estimate_worker_memory(low)["total"], estimate_worker_memory(high)["total"]
    assert a < b
    return int((a + b) / 2 / 0.9)


def test_ring_is_offered_first_when_it_alone_fits():
    """With several workers the ring (no second forward) comes before gradient caching."""
    cfg = config(**{"scale.num_workers": 4, "scale.use_gpu": True})
    ok, msg, over = fits(cfg, _device_between(cfg.replace({"scale.ring_contrastive": True}), cfg))
    assert not ok and over == {"scale.ring_contrastive": True}
    assert "Try scale.ring_contrastive=true (the same objective" in msg
    single = config(**{"scale.num_workers": 1, "scale.use_gpu": True})  # one worker: nothing to pass around
    assert "scale.ring_contrastive" not in fits(single, 24 * GIB)[2]


def test_ring_with_caching_before_fewer_clips():
    """When not even one video per chunk fits with the gathered loss but does with the ring, the
    advice is both (the objective unchanged), not fewer clips."""
    cfg = config(**{"scale.num_workers": 2, "scale.use_gpu": True})
    one_video = {"scale.grad_cache_clips": 32}
    device = _device_between(cfg.replace({**one_video, "scale.ring_contrastive": True}), cfg.replace(one_video))
    ok, msg, over = fits(cfg, device)
    assert not ok and over["scale.ring_contrastive"] is True and over["scale.grad_cache_clips"] % 32 == 0
    assert "Try scale.ring_contrastive=true scale.grad_cache_clips=" in msg and "the same loss, BatchNorm's statistics per chunk" in msg
    assert fits(cfg.replace(over), device)[0]


def test_fits_says_so_when_nothing_helps():
    ok, msg, over = fits(config(**{"scale.num_workers": 1}), 2 * GIB)  # the parameters alone need 3.6 GB
    assert not ok and over is None
    assert "No smaller data.clips_per_video fits either" in msg


def test_fits_never_suggests_fewer_clips_than_clusters():
    # batch 16 videos, K = 256: clips_per_video must stay >= 16 for k-means' first refit.
    cfg = config(**{"scale.num_workers": 1, "scale.use_gpu": True, "data.batch_size": 16})
    ok, _, over = fits(cfg, 4 * GIB)
    assert not ok and (over is None or over.get("data.clips_per_video", 32) >= 16)


# --- the trace against the real module and torch's autocast (tiny models, fast) -----------------------------
def _real_saved_bytes(cfg: Config, clips: int, autocast: bool = False) -> int:
    """Bytes a real CPU forward of ``cfg``'s model saves for its backward (distinct storages;
    parameters, buffers, the batch and, under torch's CPU autocast, the weights' bf16 copies left
    out: the estimate counts those as autocast_weights)."""
    model = _real(cfg.model)
    if cfg.model.sync_batchnorm:
        from raymcn.model.syncbn import global_batchnorm

        model = global_batchnorm(model, "cpu")
    batch = random_batch(cfg, clips, text_bf16=autocast)
    inputs = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *inputs]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip and not _weight_cast(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(batch, MODALITIES)
    del out
    return sum(seen.values())


def _weight_cast(t: torch.Tensor) -> bool:
    """``t`` is (a view of) autocast's copy of a parameter: made by a cast straight from a leaf."""
    node = t.grad_fn
    while node is not None and type(node).__name__ in ("TBackward0", "ViewBackward0", "TransposeBackward0"):
        node = node.next_functions[0][0]
    return (node is not None and type(node).__name__ == "ToCopyBackward0"
            and type(node.next_functions[0][0]).__name__ == "AccumulateGrad")


@pytest.mark.parametrize("overrides", [
    {}, {"model.recon": False}, {"model.audio_blocks": 3, "model.audio_channels": [3, 5, 6, 7, 9]},
    {"model.sync_batchnorm": True},
], ids=["default", "no-recon", "other-widths", "global-batchnorm"])
@pytest.mark.parametrize("clips", [6, 9])
def test_the_trace_saves_what_a_real_cpu_forward_saves(overrides, clips):
    """On CPU (fp32) the meta trace's saved bytes are exactly a real forward's: every branch and
    head, BatchNorm's statistics, model.sync_batchnorm's global BatchNorm (its element-wise
    arithmetic saves more), at a size off the line's two traced ones."""
    cfg = config(TINY_MODEL, **overrides)
    assert footprint.model_trace(cfg).saved_bytes(clips) == _real_saved_bytes(cfg, clips)


def test_the_gpu_trace_is_torchs_autocast_where_cpus_and_cudas_op_lists_agree():
    """The default parts use only ops that CPU's and CUDA's autocast treat alike (matrix products and
    convolutions in bf16, the rest in their inputs' dtype), so the GPU trace must give what torch's
    own CPU autocast saves. One difference is known: the pooling mask is made with ``.to(x.dtype)``,
    fp32 in the fp32 trace, bf16 under autocast: 2 bytes more per pooled step and clip."""
    cfg = config(TINY_MODEL)
    steps = -(-cfg.data.audio_frames // 16)  # DAVEnet's output steps
    for clips in (6, 10):
        traced = footprint.model_trace(cfg.replace({"scale.use_gpu": True, "scale.num_workers": 1})).saved_bytes(clips)
        real = _real_saved_bytes(cfg, clips, autocast=True)
        assert real <= traced <= real + 2 * steps * clips, (traced, real)


def test_the_gpu_trace_keeps_fp32_where_cudas_autocast_does():
    """A LayerNorm, which CUDA's autocast runs in fp32, saves 4 bytes an element on GPU as on CPU:
    the toy text encoder with and without its LayerNorm differ by the LayerNorm's saved input and
    its per-word mean and inverse std, (W·width + 2·W) fp32 per clip, in both traces. (The matrix
    products' inputs around it halve.)"""
    on_gpu = {"scale.use_gpu": True, "scale.num_workers": 1}
    with registered(), registered("unnormalized", UnnormalizedTextEncoder):
        per_clip = {(name, gpu): footprint.model_trace(config(TINY_MODEL, **{"model.text_encoder": name},
                                                              **(on_gpu if gpu else {}))).line()[1]
                    for name in ("one_layer", "unnormalized") for gpu in (False, True)}
    words, width = TINY_MODEL_WORDS, OneLayerTextEncoder.width
    layer_norm = (words * width + 2 * words) * 4
    for gpu in (False, True):
        assert per_clip[("one_layer", gpu)] - per_clip[("unnormalized", gpu)] == layer_norm, gpu
    assert per_clip[("unnormalized", True)] < 0.6 * per_clip[("unnormalized", False)]


def test_peak_meter_sees_temporaries():
    def work() -> torch.Tensor:
        a = torch.ones(1000, 1000)  # 4 MB, kept
        b = torch.ones(1000, 1000) * 2  # 2 x 4 MB while the product is formed, then freed
        del b
        return a

    kept, peak, end = meters.peak_allocated_bytes(work)
    assert end == kept.nbytes == 4_000_000
    assert peak >= 12_000_000


def _measured_tiny_step(grad_cache_clips: int = 0, compiled: bool = False, text_encoder: str = "gated") -> dict:
    """Peak torch bytes of two tiny training steps, the conv calls' temporaries, and the estimate
    for the conv path this process takes (runs in-process, or as a script under another ISA cap);
    ``compiled``: the model under ``torch.compile`` (``scale.compile``), compiled in the first step;
    ``text_encoder``: the part ``model.text_encoder`` names (the toy's must be registered)."""
    from torch.profiler import ProfilerActivity, profile

    from raymcn.model import MCN
    from raymcn.train.loop import train_one_epoch

    cfg = config(**TINY_MODEL, **{"data.batch_size": 4, "data.clips_per_video": 8, "loss.num_clusters": 8,
                          "scale.num_workers": 0, "scale.grad_cache_clips": grad_cache_clips,
                          "model.text_encoder": text_encoder})
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = MCN(cfg.model)
        if compiled:
            from raymcn.train.compiled import compile_model

            model = compile_model(model)
        batch = random_batch(cfg, 32)
        run = run_of(cfg, model)
        for _ in range(2):
            train_one_epoch(run, [batch])
    live = peak = 0
    for _, nbytes in meters.memory_timeline(prof):
        live += nbytes
        peak = max(peak, live)
    path = footprint.conv_path()
    est = estimate_worker_memory(cfg, conv=path, threads=torch.get_num_threads())
    return {"path": path, "peak": peak, "estimate": est["total"], "conv_estimate": est["conv_workspace"],
            "conv_measured": max(t for _, t in meters.op_transient_bytes(prof))}


def _under_isa_cap(cap: str, text_encoder: str = "gated") -> dict:
    """:func:`_measured_tiny_step` in a fresh process whose oneDNN is capped at ``cap`` (oneDNN reads
    the cap once, at its first kernel), i.e. the kernel path of a CPU that has nothing above it."""
    env = {k: v for k, v in os.environ.items() if k != "DNNL_MAX_CPU_ISA"} | {"ONEDNN_MAX_CPU_ISA": cap}
    proc = subprocess.run([sys.executable, __file__, text_encoder], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return last_json(proc.stdout)


def _assert_bounds(m: dict, conv_within: float = 3) -> None:
    # Never under-estimated, on any path (a path without a measured model gets a margin) ...
    assert m["peak"] <= m["estimate"], m
    assert m["conv_measured"] <= m["conv_estimate"], m
    if m["path"] in footprint.MODELLED_CONV_PATHS:
        # ... and on a modelled path within 2x on this tiny step (the fixed costs weigh more than at
        # paper size), the conv term alone within 3x of every conv call's measured temporaries.
        assert m["estimate"] <= 2 * m["peak"], m
        assert m["conv_estimate"] <= conv_within * m["conv_measured"], m


def test_estimate_bounds_a_measured_tiny_training_step():
    """The whole estimate against torch's allocator on a real (tiny) step, as bench/step.py does at
    paper dims, for the kernel path this machine takes."""
    _assert_bounds(_measured_tiny_step())


@pytest.mark.parametrize("chunk", [8, 16])
def test_estimate_bounds_a_measured_tiny_cached_step(chunk):
    """The same with gradient caching (4 or 2 chunks of the 32 clips): the chunked estimate is
    never below the measured peak (bench/grad_cache.py measures it at paper dims). The conv term's
    fixed per-call allowance (256 KiB) weighs more on a chunk of 8 tiny clips: within 4x there."""
    _assert_bounds(_measured_tiny_step(chunk), conv_within=4)


@pytest.mark.slow  # Inductor compiles the tiny model's C++ first: tens of seconds, the soak tier's (test_compile.py)
@pytest.mark.soak
def test_estimate_bounds_a_measured_tiny_compiled_step():
    """With ``scale.compile`` the step's kernels are Inductor's (fused, other temporaries), its saved
    activations chosen by its partitioner: the same estimate stays at or above the allocator's peak."""
    m = _measured_tiny_step(compiled=True)
    assert m["peak"] <= m["estimate"], m


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and convspace.instruction_level() >= 1),
                    reason="no oneDNN or no AVX2 on this machine: the AVX2 kernel path cannot be taken here")
@pytest.mark.parametrize("text_encoder", ["gated", TOY])
def test_estimate_bounds_the_avx2_only_kernel_path(text_encoder):
    """The path of an AVX2-only CPU (e.g. AMD EPYC Zen 2/3, where the spectrogram conv's backward
    pads its one input channel to 8): reproduced on any AVX2 machine by capping oneDNN's ISA."""
    m = _under_isa_cap("AVX2", text_encoder)
    assert m["path"] == footprint.ONEDNN_AVX2
    _assert_bounds(m)


@pytest.mark.parametrize("text_encoder", ["gated", TOY])
def test_estimate_bounds_the_native_conv_path(text_encoder):
    """oneDNN switched off: torch's own im2col convolutions."""
    with torch.backends.mkldnn.flags(enabled=False), registered():
        m = _measured_tiny_step(text_encoder=text_encoder)
    assert m["path"] == footprint.NATIVE
    _assert_bounds(m)


@pytest.mark.parametrize("chunk", [0, 8])
def test_a_toy_part_added_by_its_class_and_table_entry_alone_keeps_the_estimates_bounds(chunk):
    """A new part, here a one-layer attention text encoder (``tests/toy_parts.py``), is a class and a
    table entry; the preflight is not told about it. Its estimate stays at or above torch's
    allocator peak and within the same bounds as the default parts', plain and gradient-cached."""
    with registered():
        cfg = config(TINY_MODEL, **{"model.text_encoder": TOY})
        trace, default = footprint.model_trace(cfg), footprint.model_trace(config(TINY_MODEL))
        assert trace.recon_width - default.recon_width == cfg.model.word_dim - cfg.model.embed_dim  # its own target
        m = _measured_tiny_step(chunk, text_encoder=TOY)
    _assert_bounds(m, conv_within=4 if chunk else 3)


# --- convolution kernel paths -------------------------------------------------------------------------------
@pytest.mark.parametrize("channels,blocks,frames", [((4, 4, 8, 8, 16), 2, 160), ((3, 5, 6, 7, 9), 3, 301)])
def test_the_traced_convolutions_are_the_models(channels, blocks, frames):
    """The shapes the conv workspace is sized by are the convolutions the real DAVEnet runs."""
    from raymcn.model.davenet import DAVEnet

    net = DAVEnet(channels, blocks, 40)
    seen = []

    def record(module, inputs, output):
        x = inputs[0]
        seen.append(footprint.ConvShape(x.shape[1], output.shape[1], module.kernel_size[0] * module.kernel_size[1],
                                        x.shape[2] * x.shape[3], output.shape[2] * output.shape[3],
                                        module.stride[1]))

    for m in net.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(record)
    net(torch.randn(2, 40, frames))
    cfg = config(**{"model.audio_channels": list(channels), "model.audio_blocks": blocks, "data.audio_frames": frames})
    assert set(footprint.model_trace(cfg).convs) == set(seen) and len(seen) == 1 + 4 * (2 * blocks + 1)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_conv_path_follows_the_isa_cap_mkldnn_and_the_device(monkeypatch):
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)  # the cap's old name, read when the new one is unset
    assert footprint.conv_path(use_gpu=True) == footprint.CUDNN
    with torch.backends.mkldnn.flags(enabled=False):
        assert footprint.conv_path() == footprint.NATIVE
    monkeypatch.setattr(convspace, "instruction_level", lambda: 2)
    for cap, path in [("", footprint.ONEDNN_AVX512), ("AVX512_CORE_AMX", footprint.ONEDNN_AVX512),
                      ("avx2", footprint.ONEDNN_AVX2), ("AVX2_VNNI", footprint.ONEDNN_AVX2),
                      ("SSE41", footprint.UNKNOWN)]:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert footprint.conv_path() == path, cap
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(convspace, "instruction_level", lambda: 1)
    assert footprint.conv_path() == footprint.ONEDNN_AVX2
    monkeypatch.setattr(convspace, "instruction_level", lambda: 0)
    assert footprint.conv_path() == footprint.UNKNOWN


@pytest.mark.skipif(not convspace.cpuinfo_flags(), reason="no /proc/cpuinfo (not Linux)")
def test_the_instruction_level_is_the_hardwares_on_every_torch(monkeypatch):
    """torch 2.3 has no CPU probe (``torch.cpu._is_avx2_supported``): /proc/cpuinfo's flags stand in,
    and agree with torch's probe where torch has one."""
    by_torch = convspace.instruction_level() if hasattr(torch.cpu, "_is_avx2_supported") else None
    monkeypatch.delattr(torch.cpu, "_is_avx512_supported", raising=False)
    by_flags = convspace.instruction_level()
    assert by_flags == (2 if "avx512f" in convspace.cpuinfo_flags() else 1 if "avx2" in convspace.cpuinfo_flags() else 0)
    assert by_torch in (None, by_flags)
    assert convspace.cpuinfo_flags("processor\t: 0\nflags\t\t: fpu sse2 avx2\n\nflags : avx512f\n") == {
        "fpu", "sse2", "avx2"}


def test_unmodelled_paths_get_the_larger_margin_and_say_so():
    m, clips = footprint.model_trace(config()).convs, 64  # the paper's DAVEnet, 1000 frames
    modelled = {p: footprint.conv_workspace_bytes(m, clips, p, threads=2) for p in footprint.MODELLED_CONV_PATHS}
    assert footprint.conv_workspace_bytes(m, clips, footprint.UNKNOWN, threads=2) == max(
        modelled[footprint.ONEDNN_AVX2], modelled[footprint.NATIVE])
    assert footprint.conv_workspace_bytes(m, clips, footprint.CUDNN, threads=2) == modelled[
        footprint.ONEDNN_AVX512]
    for path in (footprint.CUDNN, footprint.UNKNOWN):
        assert "not known in advance" in footprint.conv_path_note(path)
    # AVX2 pads conv1's single input channel to 8: its workspace grows 8x the fp32 spectrogram per clip
    grow = (footprint.conv_workspace_bytes(m, clips + 1, footprint.ONEDNN_AVX2, threads=2)
            - footprint.conv_workspace_bytes(m, clips, footprint.ONEDNN_AVX2, threads=2))
    frames = 1000
    assert grow == 4 * (8 * 40 * frames + 128 * frames)  # padded input + its output, blocked
    ok, msg, _ = fits(config(**{"scale.num_workers": 4, "scale.use_gpu": True}), 80 * GIB)
    assert ok and "conv workspace (cudnn): not known in advance" in msg


if __name__ == "__main__":  # run by _under_isa_cap in a fresh process: argv[1] the text encoder
    with registered():
        print(json.dumps(_measured_tiny_step(text_encoder=sys.argv[1] if len(sys.argv) > 1 else "gated")))


def _no_sync_grads_worker(rank: int, world: int) -> dict:
    """One plain DDP step (gradients become views of DDP's buckets), then a cached step in chunks
    of one video as the loop runs it (``zero_grad(set_to_none=True)`` first): the bytes of
    gradients held outside the buckets when each ``no_sync`` chunk ends."""
    import contextlib

    from conftest import linear_mcn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raymcn.collectives import Collectives
    from raymcn.train.gradcache import cached_step

    net = linear_mcn(5, 8)
    model = DDP(net, find_unused_parameters=True, gradient_as_bucket_view=True)
    cfg = Config().replace({"data.batch_size": 2 * world, "data.clips_per_video": 3, "model.embed_dim": 8,
                            "loss.num_clusters": 2, "loss.refresh_every": 1, "scale.num_workers": world})
    objective = objective_for(cfg, comm=Collectives(rank, world))
    active = frozenset({"video", "audio", "text"})
    g = torch.Generator().manual_seed(rank)
    batch = {m: torch.randn(6, 5, generator=g) for m in sorted(active)}
    objective(model(batch, active), active, 0)["total_loss"].backward()
    buckets = {p.grad.untyped_storage().data_ptr() for p in net.parameters() if p.grad is not None}
    outside: list[int] = []
    real_no_sync = model.no_sync

    @contextlib.contextmanager
    def observed_no_sync():
        with real_no_sync():
            yield
        outside.append(sum(p.grad.numel() * p.grad.element_size() for p in net.parameters()
                           if p.grad is not None and p.grad.untyped_storage().data_ptr() not in buckets))

    model.no_sync = observed_no_sync
    net.zero_grad(set_to_none=True)
    cached_step(model, objective, batch, active, 1, 3)
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    return {"outside": outside, "params": params, "buckets": len(buckets)}


@pytest.mark.dist
def test_cached_ddp_steps_hold_the_gradients_outside_the_buckets_and_the_estimate_counts_them(tmp_path):
    """Gradient caching under DDP: the chunks before the last run under ``no_sync``, where autograd
    accumulates the gradients into fresh ``.grad`` tensors (the loop set them to None), not into
    DDP's buckets: P x 4 bytes beside the buckets' P x 4 until the last chunk's backward copies them
    in. Measured on 2 gloo ranks; the estimate of a cached multi-worker run counts them."""
    from bench.gloo import gloo_ranks

    seen = gloo_ranks(_no_sync_grads_worker, 2)[0]
    assert seen["buckets"] >= 1 and seen["outside"], seen
    assert max(seen["outside"]) == seen["params"]  # every parameter's gradient, outside the buckets

    plain = config(**{"scale.num_workers": 4})
    cached = config(**{"scale.num_workers": 4, "scale.grad_cache_clips": 64})
    trace = footprint.model_trace(plain)
    p = trace.parameters + trace.float_buffers
    assert estimate_worker_memory(plain)["grads"] == 0  # the plain DDP step: gradients are bucket views
    assert estimate_worker_memory(cached)["grads"] == p * 4


def test_gpu_workers_count_a_cuda_context_and_nccls_buffers_outside_the_allocator():
    """The paper's step on 4 GPUs (the lab's servers): every worker holds its CUDA context, and
    with other workers NCCL's buffers; neither is in torch's allocator (the estimate's allocator
    part is what a GPU's peak statistics are compared with). Estimates from published figures."""
    cpu = estimate_worker_memory(config(**{"scale.num_workers": 4}))
    assert cpu["cuda_context"] == cpu["nccl_buffers"] == 0 and footprint.allocator_total(cpu) == cpu["total"]
    by_world = {w: estimate_worker_memory(config(**{"scale.num_workers": w, "scale.use_gpu": True}))
                for w in (1, 2, 4)}
    assert all(e["cuda_context"] == footprint.CUDA_CONTEXT_BYTES == 512 << 20 for e in by_world.values())
    assert [by_world[w]["nccl_buffers"] for w in (1, 2, 4)] == [0, 544 * 10**6, 688 * 10**6]
    four = by_world[4]
    assert four["total"] == footprint.allocator_total(four) + four["cuda_context"] + four["nccl_buffers"]
    # the 4-rank terms the lab's servers add over one process: the gathered 3·B·D (and the fused
    # rows), DDP's buckets, NCCL; the slabs shrink with the share (b = B/4)
    clips, dim = 128 * 32, ModelConfig().embed_dim
    assert four["gathered_embeddings"] >= 3 * clips * dim * 4 and by_world[1]["gathered_embeddings"] == 0
    assert four["ddp_buckets"] == four["params"] - _counters(config())
    assert four["loss_slabs"] * 4 == by_world[1]["loss_slabs"]


def test_a_workers_own_check_does_not_count_its_context_twice(monkeypatch):
    """A worker reads its GPU's free memory after its CUDA context exists: the context is no longer
    free, so the check leaves it out of the estimate (the driver's check, before any worker, keeps it)."""
    import torch

    from raymcn.train.preflight import checks

    cfg = config(**{"scale.num_workers": 4, "scale.use_gpu": True})
    est = estimate_worker_memory(cfg)
    free = int((est["total"] - est["cuda_context"] // 2) / 0.9)  # below the whole, above all but the context
    assert not fits(cfg, free)[0]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
    assert checks.device_problems(cfg, torch.device("cuda", 0)) == []
