"""Per-worker memory estimate (raymcn.train.preflight.footprint): scaling of each component, the paper
numbers of the original's memory accounting, the fit check, and the formulas against measured tiny-model runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TINY_MODEL, config, last_json, objective_for, run_of

from bench import meters
from raymcn.config import Config, ModelConfig
from raymcn.data.formats.batch import random_batch
from raymcn.train.preflight import convspace, footprint, model_size
from raymcn.train.preflight.footprint import GIB, estimate_worker_memory, fits


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
    sizes, buffers = model_size.parameter_tensors(cfg)
    assert sorted(sizes) == sorted(p.numel() for p in model.parameters())
    assert buffers == sum(b.numel() for b in model.buffers() if b.is_floating_point())


# --- scaling ------------------------------------------------------------------------------------------
def test_parameter_terms_do_not_depend_on_the_batch(paper_params):
    small = estimate_worker_memory(config(**{"data.batch_size": 8}), params=paper_params)
    large = estimate_worker_memory(config(**{"data.batch_size": 256}), params=paper_params)
    for key in ("params", "adam_moments", "optimizer_workspace"):
        assert small[key] == large[key] > 0
    counters = 8 * footprint.batchnorm_layers(ModelConfig())  # BN's int64 batch counters: no gradient
    for est in (small, large):  # one gradient copy: in DDP's buckets, or plain grads with one worker
        assert est["grads"] + est["ddp_buckets"] == est["params"] - counters
    bn = footprint.batchnorm_saved_bytes(ModelConfig())  # per step, not per clip
    assert large["activations"] - bn == 32 * (small["activations"] - bn)  # linear in the clips per worker


@pytest.mark.parametrize("batch,workers", [(8, 1), (16, 2), (64, 4), (128, 4), (128, 2)])
def test_slab_term_is_proportional_to_local_times_global_clips(paper_params, batch, workers):
    cfg = config(**{"data.batch_size": batch, "scale.num_workers": workers})
    b, big_b = batch // workers * cfg.data.clips_per_video, cfg.clips_per_step
    slabs = estimate_worker_memory(cfg, params=paper_params)["loss_slabs"]
    # (2 per pair x 3 pairs + 3 transient) b x B fp32 slabs, whatever the split
    assert slabs == 9 * b * big_b * 4


def test_gathered_embeddings_only_with_several_workers(paper_params):
    one = estimate_worker_memory(config(**{"scale.num_workers": 1}), params=paper_params)
    four = estimate_worker_memory(config(**{"scale.num_workers": 4}), params=paper_params)
    assert one["gathered_embeddings"] == 0 and one["ddp_buckets"] == 0
    # v, a, t detached (no gradient copy), the fused rows and the queue's half of them
    assert four["gathered_embeddings"] == (3 + 1 + 0.5) * 4096 * 6144 * 4
    assert four["ddp_buckets"] == four["params"] - 8 * footprint.batchnorm_layers(ModelConfig())


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_ring_keeps_two_shares_or_the_fused_rows_not_three_gathered_modalities(paper_params, workers):
    gathered = estimate_worker_memory(config(**{"scale.num_workers": workers}), params=paper_params)
    ring = estimate_worker_memory(config(**{"scale.num_workers": workers, "scale.ring_contrastive": True}),
                                  params=paper_params)
    b = 4096 // workers
    blocks = min(workers - 1, 2) * b * 3 * 6144 * 4  # the block in use and the one arriving
    fused = 1.5 * 4096 * 6144 * 4  # the cluster term's fused rows and the queue's half of them
    assert ring["gathered_embeddings"] == max(blocks, fused) < gathered["gathered_embeddings"]
    assert ring["loss_slabs"] == 3 * b * b * 4 < gathered["loss_slabs"]  # b×b tiles, nothing b×B
    assert ring["total"] < gathered["total"]


@pytest.mark.parametrize("steps", [1, 5, 20])
def test_queue_term_is_rows_times_dim_times_dtype(paper_params, steps):
    f32 = config(**{"loss.queue_steps": steps})
    bf16 = config(**{"loss.queue_steps": steps, "loss.queue_dtype": "bfloat16"})
    q32 = estimate_worker_memory(f32, params=paper_params)["queue"]
    q16 = estimate_worker_memory(bf16, params=paper_params)["queue"]
    assert q32 == f32.queue_rows * 6144 * 4
    assert q16 * 2 == q32


def test_gpu_estimate_uses_bf16_activations_and_autocast_copies(paper_params):
    cpu = estimate_worker_memory(config(**{"scale.num_workers": 4}), params=paper_params)
    gpu = estimate_worker_memory(config(**{"scale.num_workers": 4, "scale.use_gpu": True}), params=paper_params)
    bn = footprint.batchnorm_saved_bytes(ModelConfig())  # BatchNorm's statistics stay fp32 under autocast
    assert (gpu["activations"] - bn) * 2 == cpu["activations"] - bn
    assert cpu["autocast_weights"] == 0 and gpu["autocast_weights"] == 2 * footprint.count_parameters(ModelConfig())


def test_total_is_persistent_plus_the_larger_phase(paper_params):
    est = estimate_worker_memory(config(), params=paper_params)
    persistent = sum(est[k] for k in footprint.PERSISTENT)
    step = sum(est[k] for k in footprint.STEP_PHASE)
    assert est["total"] == persistent + max(step, est["batch"] + est["optimizer_workspace"])
    assert set(est) >= set(footprint.PERSISTENT) | set(footprint.STEP_PHASE) | {"optimizer_workspace", "total"}


# --- paper numbers -------------------------------------------
def test_paper_defaults_match_the_spec(paper_params):
    n, largest = paper_params
    bn_stats = 2 * (128 + 5 * (128 + 256 + 512 + 1024))  # running mean/var: conv1's BN + 5 BNs per layer
    assert n - bn_stats == 223_776_768  # "223.8 M"
    assert largest == 6144 * 6144  # GU_text's linear layers
    assert footprint.count_parameters(ModelConfig(recon=False)) < 193.5e6  # "193.4 M without the heads"
    est = estimate_worker_memory(config(**{"scale.num_workers": 1}), params=paper_params)
    assert 3.5e9 < est["params"] + est["grads"] + est["ddp_buckets"] + est["adam_moments"] < 3.7e9  # "≈ 3.6 GB"
    assert est["queue"] == 40960 * 6144 * 4 and abs(est["queue"] / GIB - 0.94) < 0.005  # "0.94 GiB fp32"
    x_bytes = 45056 * 6144 * 4  # X (1.03 GiB), built in place, plus the Lloyd workspace
    assert x_bytes < est["kmeans_input"] < 1.06 * x_bytes  # plus the copy chunk and Lloyd workspace
    per_clip = est["activations"] / 4096
    assert 11.0e6 < per_clip < 11.5e6  # "≈ 11.3 MB per clip fp32"
    assert 44e9 < est["activations"] < 48e9  # "≈ 46 GB fp32 for 4096 clips"
    davenet = footprint.activation_elements_per_clip(ModelConfig(), 1000)["audio"] * 4
    assert 0.9 < davenet / per_clip < 0.95  # "DAVEnet ≈ 92 %"
    gpu = estimate_worker_memory(config(**{"scale.num_workers": 1, "scale.use_gpu": True}), params=paper_params)
    assert 22e9 < gpu["activations"] < 30e9  # "≈ 23–30 GB in bf16" (ours: exactly half of fp32)
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


def test_caching_makes_the_activations_a_chunks_whatever_the_batch(paper_params):
    """Activations and conv workspace are O(chunk); what grows with the share is the cache (its
    embeddings) and the batch itself; the reconstruction gradients are one chunk's too."""
    ests = [estimate_worker_memory(config(**{"scale.num_workers": 1, "data.batch_size": v,
                                           "scale.grad_cache_clips": 256}), params=paper_params) for v in (16, 64, 128)]
    for key in ("activations", "conv_workspace", "recon_grads", "grad_accumulation"):
        assert ests[0][key] == ests[1][key] == ests[2][key] > 0, key
    assert ests[2]["grad_cache"] == 8 * ests[0]["grad_cache"] == 128 * 32 * 3 * 6144 * 4
    plain = estimate_worker_memory(config(**{"scale.num_workers": 1}), params=paper_params)
    assert plain["grad_cache"] == plain["recon_grads"] == plain["grad_accumulation"] == 0
    assert ests[2]["activations"] * 16 - 15 * footprint.batchnorm_saved_bytes(ModelConfig()) == plain["activations"]
    # with caching the loss phase and the chunk phase never overlap
    est = ests[2]
    persistent = sum(est[k] for k in footprint.PERSISTENT)
    step = sum(est[k] for k in footprint.STEP_COMMON) + max(sum(est[k] for k in footprint.LOSS_PHASE),
                                                            sum(est[k] for k in footprint.CHUNK_PHASE))
    assert est["total"] == persistent + max(step, est["batch"] + est["optimizer_workspace"])


def test_a_chunk_as_large_as_the_share_is_the_plain_step(paper_params):
    plain = estimate_worker_memory(config(**{"scale.num_workers": 2}), params=paper_params)
    for n in (2048, 4096):  # rank 0's share is 2048 clips: the loop takes the plain step
        cfg = config(**{"scale.num_workers": 2, "scale.grad_cache_clips": n})
        assert footprint.cached_chunk(cfg) == 0 and estimate_worker_memory(cfg, params=paper_params) == plain


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


# --- formulas against measurement (tiny model, fast) -------------------------------------------------------
@pytest.mark.parametrize("active", [("video",), ("audio",), ("text",), ("video", "audio", "text")])
def test_activation_formula_equals_the_saved_tensors(active):
    from raymcn.model import MCN

    cfg = config(**TINY_MODEL)
    torch.manual_seed(0)
    model = MCN(cfg.model)
    clips = 6
    batch = random_batch(cfg, clips)
    inputs = tuple(v for v in batch.values() if isinstance(v, torch.Tensor))
    state = tuple(model.parameters()) + tuple(model.buffers())
    out, saved = meters.saved_tensor_bytes(lambda: model(batch, active), exclude=state + inputs)
    del out
    formula = footprint.activation_elements_per_clip(cfg.model, cfg.data.audio_frames, active,
                                                     cfg.data.max_words)
    # BatchNorm also saves its batch mean and inverse std: per channel, not per clip.
    bn = sum(2 * m.num_features * 4 for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert saved == sum(formula.values()) * 4 * clips + (bn if "audio" in active else 0)


def test_global_batchnorm_extra_bounds_its_saved_tensors():
    """model.sync_batchnorm on CPU: GlobalBatchNorm2d's saved tensors beyond BatchNorm's are what
    the estimate adds (never fewer, at most 5 % more)."""
    from raymcn.model import MCN
    from raymcn.model.syncbn import global_batchnorm

    cfg = config(**TINY_MODEL)
    clips, batch = 6, random_batch(cfg, 6)
    inputs = tuple(v for v in batch.values() if isinstance(v, torch.Tensor))
    saved = []
    for sync in (False, True):
        torch.manual_seed(0)
        model = MCN(cfg.model)
        if sync:
            model = global_batchnorm(model, "cpu")
        state = tuple(model.parameters()) + tuple(model.buffers())
        out, n = meters.saved_tensor_bytes(lambda: model(batch, ("video", "audio", "text")), exclude=state + inputs)
        del out
        saved.append(n)
    extra = footprint.global_batchnorm_extra_bytes(cfg.model, cfg.data.audio_frames, clips)
    assert saved[1] - saved[0] <= extra <= 1.05 * (saved[1] - saved[0])


def test_peak_meter_sees_temporaries():
    def work() -> torch.Tensor:
        a = torch.ones(1000, 1000)  # 4 MB, kept
        b = torch.ones(1000, 1000) * 2  # 2 x 4 MB while the product is formed, then freed
        del b
        return a

    kept, peak, end = meters.peak_allocated_bytes(work)
    assert end == kept.nbytes == 4_000_000
    assert peak >= 12_000_000


def _measured_tiny_step(grad_cache_clips: int = 0, compiled: bool = False) -> dict:
    """Peak torch bytes of two tiny training steps, the conv calls' temporaries, and the estimate
    for the conv path this process takes (runs in-process, or as a script under another ISA cap);
    ``compiled``: the model under ``torch.compile`` (``scale.compile``), compiled in the first step."""
    from torch.profiler import ProfilerActivity, profile

    from raymcn.model import MCN
    from raymcn.train.loop import train_one_epoch

    cfg = config(**TINY_MODEL, **{"data.batch_size": 4, "data.clips_per_video": 8, "loss.num_clusters": 8,
                          "scale.num_workers": 0, "scale.grad_cache_clips": grad_cache_clips})
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


def _under_isa_cap(cap: str) -> dict:
    """:func:`_measured_tiny_step` in a fresh process whose oneDNN is capped at ``cap`` (oneDNN reads
    the cap once, at its first kernel), i.e. the kernel path of a CPU that has nothing above it."""
    env = {k: v for k, v in os.environ.items() if k != "DNNL_MAX_CPU_ISA"} | {"ONEDNN_MAX_CPU_ISA": cap}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
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


@pytest.mark.slow  # Inductor compiles the tiny model's C++ first: tens of seconds
def test_estimate_bounds_a_measured_tiny_compiled_step():
    """With ``scale.compile`` the step's kernels are Inductor's (fused, other temporaries), its saved
    activations chosen by its partitioner: the same estimate stays at or above the allocator's peak."""
    m = _measured_tiny_step(compiled=True)
    assert m["peak"] <= m["estimate"], m


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and convspace.instruction_level() >= 1),
                    reason="no oneDNN or no AVX2 on this machine: the AVX2 kernel path cannot be taken here")
def test_estimate_bounds_the_avx2_only_kernel_path():
    """The path of an AVX2-only CPU (e.g. AMD EPYC Zen 2/3, where the spectrogram conv's backward
    pads its one input channel to 8): reproduced on any AVX2 machine by capping oneDNN's ISA."""
    m = _under_isa_cap("AVX2")
    assert m["path"] == footprint.ONEDNN_AVX2
    _assert_bounds(m)


def test_estimate_bounds_the_native_conv_path():
    """oneDNN switched off: torch's own im2col convolutions."""
    with torch.backends.mkldnn.flags(enabled=False):
        m = _measured_tiny_step()
    assert m["path"] == footprint.NATIVE
    _assert_bounds(m)


# --- convolution kernel paths -------------------------------------------------------------------------------
@pytest.mark.parametrize("channels,blocks,frames", [((4, 4, 8, 8, 16), 2, 160), ((3, 5, 6, 7, 9), 3, 301)])
def test_conv_shapes_are_the_models_convolutions(channels, blocks, frames):
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
    cfg = ModelConfig(audio_channels=channels, audio_blocks=blocks)
    assert sorted(footprint.conv_shapes(cfg, frames), key=repr) == sorted(seen, key=repr)


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
    m, frames, clips = ModelConfig(), 1000, 64
    modelled = {p: footprint.conv_workspace_bytes(m, frames, clips, p, threads=2) for p in footprint.MODELLED_CONV_PATHS}
    assert footprint.conv_workspace_bytes(m, frames, clips, footprint.UNKNOWN, threads=2) == max(
        modelled[footprint.ONEDNN_AVX2], modelled[footprint.NATIVE])
    assert footprint.conv_workspace_bytes(m, frames, clips, footprint.CUDNN, threads=2) == modelled[
        footprint.ONEDNN_AVX512]
    for path in (footprint.CUDNN, footprint.UNKNOWN):
        assert "not known in advance" in footprint.conv_path_note(path)
    # AVX2 pads conv1's single input channel to 8: its workspace grows 8x the fp32 spectrogram per clip
    grow = (footprint.conv_workspace_bytes(m, frames, clips + 1, footprint.ONEDNN_AVX2, threads=2)
            - footprint.conv_workspace_bytes(m, frames, clips, footprint.ONEDNN_AVX2, threads=2))
    assert grow == 4 * (8 * 40 * frames + 128 * frames)  # padded input + its output, blocked
    ok, msg, _ = fits(config(**{"scale.num_workers": 4, "scale.use_gpu": True}), 80 * GIB)
    assert ok and "conv workspace (cudnn): not known in advance" in msg


if __name__ == "__main__":  # run by _under_isa_cap in a fresh process
    print(json.dumps(_measured_tiny_step()))


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
    p = footprint.parameter_stats(plain.model)[0]
    assert estimate_worker_memory(plain)["grads"] == 0  # the plain DDP step: gradients are bucket views
    assert estimate_worker_memory(cached)["grads"] == p * 4


def test_gpu_workers_count_a_cuda_context_and_nccls_buffers_outside_the_allocator(paper_params):
    """The paper's step on 4 GPUs (the lab's servers): every worker holds its CUDA context, and
    with other workers NCCL's buffers; neither is in torch's allocator (the estimate's allocator
    part is what a GPU's peak statistics are compared with). Estimates from published figures."""
    cpu = estimate_worker_memory(config(**{"scale.num_workers": 4}), params=paper_params)
    assert cpu["cuda_context"] == cpu["nccl_buffers"] == 0 and footprint.allocator_total(cpu) == cpu["total"]
    by_world = {w: estimate_worker_memory(config(**{"scale.num_workers": w, "scale.use_gpu": True}),
                                          params=paper_params)
                for w in (1, 2, 4)}
    assert all(e["cuda_context"] == footprint.CUDA_CONTEXT_BYTES == 512 << 20 for e in by_world.values())
    assert [by_world[w]["nccl_buffers"] for w in (1, 2, 4)] == [0, 544 * 10**6, 688 * 10**6]
    four = by_world[4]
    assert four["total"] == footprint.allocator_total(four) + four["cuda_context"] + four["nccl_buffers"]
    # the 4-rank terms the lab's servers add over one process: the gathered 3·B·D (and the fused
    # rows), DDP's buckets, NCCL; the slabs shrink with the share (b = B/4)
    clips, dim = 128 * 32, ModelConfig().embed_dim
    assert four["gathered_embeddings"] >= 3 * clips * dim * 4 and by_world[1]["gathered_embeddings"] == 0
    assert four["ddp_buckets"] == four["params"] - 8 * footprint.batchnorm_layers(ModelConfig())
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
