"""Per-worker memory of one MCN training step: an estimate and a fit check.

The preflight calls :func:`fits` before Ray starts, so a run that cannot fit its device is
refused with what to change instead of dying with an OOM hours later: the ring loss and gradient
caching first (``scale.ring_contrastive``: the same objective; ``scale.grad_cache_clips``: the same
loss, BatchNorm's statistics per chunk), only then a smaller ``data.clips_per_video``. No Ray here.
Every term of the model comes from the model itself, traced on the meta device
(``model_trace.py``: its parameters and buffers, what its forward saves, its embeddings' and
targets' widths, its convolutions); the batch's bytes from the batch contract
(``data/formats/batch.batch_arrays``); the convolutions' workspace from ``convspace.py``; the
loss's, the optimizer's, the collectives' and the device's terms are formulas of those sizes.

Each term of :func:`estimate_worker_memory` (bytes, per worker, for rank 0, the largest), its
formula and how it was checked against measurement: docs/memory.md, "What the memory estimate
counts"; the measurements themselves: ``bench/memory.py``, ``bench/step.py`` and
docs/measurements/memory.json.
"""

from __future__ import annotations

import math

from raymcn.config import Config
from raymcn.data.formats.batch import batch_arrays
from raymcn.model.parts import text_in_bf16
from raymcn.train.preflight.convspace import (
    CONV_PATHS,
    CUDNN,
    MARGIN_PATHS,
    MODELLED_CONV_PATHS,
    NATIVE,
    ONEDNN_AVX2,
    ONEDNN_AVX512,
    UNKNOWN,
    ConvShape,
    conv_path,
    conv_path_note,
    conv_workspace_bytes,
)
from raymcn.train.preflight.model_trace import ModelTrace, TraceKey, trace_of

GIB = 1 << 30

# How the components combine into the peak (docs/memory.md, "What the memory estimate counts").
PERSISTENT = ("params", "grads", "adam_moments", "ddp_buckets", "queue", "centroids")
OPTIMIZER_SMALL_TEMPORARIES = 1 << 20  # Adam's scalars and small per-parameter temporaries (allowance)
COPY_CHUNK_ROWS = 512  # FeatureQueue.copy_into's chunk: queue rows gathered at a time into X
STEP_PHASE = ("autocast_weights", "batch", "activations", "conv_workspace", "loss_slabs", "gathered_embeddings",
              "loss_grads", "kmeans_input", "grad_cache", "recon_grads", "grad_accumulation")
# With gradient caching the step phase is STEP_COMMON + the larger of the other two (module table).
STEP_COMMON = ("autocast_weights", "batch", "grad_cache")
LOSS_PHASE = ("loss_slabs", "gathered_embeddings", "loss_grads", "kmeans_input")
CHUNK_PHASE = ("activations", "conv_workspace", "recon_grads", "grad_accumulation")
FP32 = 4
_QUEUE_ITEMSIZE = {"float32": 4, "bfloat16": 2}
MODALITY_COUNT = 3  # video, audio, text: all active in the last stage of every order
PAIR_COUNT = 3  # tv, at, av
LIVE_SLABS_PER_PAIR = 2  # margin-shifted row and column slabs, saved for backward
LIVE_SLABS_TRANSIENT = 3  # backward: the two exp terms of one slab's gradient, plus small D-wide temporaries
EMBED_GRAD_COPIES = 2  # per modality: the accumulated gradient + the addend being summed into it
RING_TILES = 3  # ring loss: live b × b_p tiles (the block, its gradient's two exp terms)

# Per GPU worker, outside torch's caching allocator (its peak statistics never see them): estimates
# from published figures, to be replaced by measurements on the lab's servers (docs/memory.md).
OUTSIDE_ALLOCATOR = ("cuda_context", "nccl_buffers")
# A CUDA context with lazy module loading (CUDA >= 11.7, PyTorch's default since 1.13): 274 MiB
# after creating one tensor (PyTorch's change that made lazy loading its default, measured there),
# ~400 MB once the first operations ran (PyTorch maintainers' answers); a training process also
# loads cuBLAS and cuDNN and their workspaces: 0.5 GiB.
CUDA_CONTEXT_BYTES = 512 << 20
# A PyTorch NCCL process group on 4 A100s with NVLink after its first all-reduce, per rank: 544 MB in
# a group of 2 ranks, 688 MB in a group of 3 or 4 (a user's published measurement). NCCL's memory
# grows with its channels (more on faster links), not with ranks beyond a node (NCCL's maintainers).
NCCL_GROUP_BYTES = {2: 544 * 10**6, 3: 688 * 10**6}  # world 2; world >= 3


def loss_memory(b: int, clips: int, embed_dim: int, world: int, recon_width: int = 0,
                recon_live_width: int = 0, ring: bool = False, queued_fraction: float = 1.0) -> dict[str, int]:
    """Bytes the MCN objective adds on one worker during its forward + backward (beyond its inputs),
    all three modalities and their pairs active.

    Args:
        b: the worker's clips, the largest share (the ring's blocks are that size); clips: B,
            global clips; embed_dim: D; world: number of workers.
        recon_width, recon_live_width: F and F_live, the reconstruction targets' widths summed over
            the modalities, all and those that receive gradient (0 = no recon term).
        ring: the ring contrastive loss (``scale.ring_contrastive``) instead of the gathered one.
        queued_fraction: the share of the B current rows the queue takes per step
            (``queue_clips_per_video / clips_per_video``; default 1, an upper bound).

    Returns:
        ``loss_slabs``, ``gathered_embeddings``, ``loss_grads`` (see the module table) and
        ``loss_inputs``: the embeddings and reconstruction (prediction, target) pairs themselves,
        which a training step already counts among the activations.
    """
    pairs, modalities, peer = PAIR_COUNT, MODALITY_COUNT, b
    grads = b * (EMBED_GRAD_COPIES * modalities * embed_dim + recon_width + recon_live_width) * FP32
    inputs = b * (modalities * embed_dim + 2 * recon_width) * FP32
    # the cluster term's global fused rows (B, D) and the copy of the queue's share of them it pushes
    fused = int((1 + queued_fraction) * clips) * embed_dim * FP32 if world > 1 else 0
    if ring:
        slabs = RING_TILES * b * peer * FP32 if pairs else 0
        blocks = min(world - 1, 2) * peer * modalities * embed_dim * FP32 if pairs else 0
        gathered = max(blocks, fused)  # the fused rows are freed before the ring starts
    else:
        slabs = (LIVE_SLABS_PER_PAIR * pairs + LIVE_SLABS_TRANSIENT) * b * clips * FP32 if pairs else 0
        gathered = (modalities * clips * embed_dim * FP32 if pairs else 0) + fused if world > 1 else 0
    return {"loss_slabs": slabs, "gathered_embeddings": gathered, "loss_grads": grads, "loss_inputs": inputs}


def estimate_worker_memory(cfg: Config, *, trace: ModelTrace | None = None, refit: bool = True,
                           conv: str | None = None, threads: int | None = None) -> dict[str, int]:
    """Estimated peak bytes of one training worker (rank 0) for ``cfg``, by component.

    Args:
        cfg: the run config (batch, clips per video, workers, model, queue, GPU or CPU).
        trace: :func:`model_trace` of ``cfg``, if already made (default: made, once per process).
        refit: estimate a k-means refit step (the largest, every ``loss.refresh_every`` steps on
            rank 0); False gives the other steps (``kmeans_input`` = 0).
        conv: the convolution kernel path (:data:`CONV_PATHS`); default :func:`conv_path` of this
            machine (cuDNN with ``scale.use_gpu``).
        threads: the worker's intra-op threads (default: every CPU of this machine, an upper bound).

    Returns:
        The components of the module table (bytes, ints) and ``total``. Keys are stable: the
        preflight prints them and the benchmarks compare them with measurements.
    """
    d, lc = cfg.data, cfg.loss
    world = max(1, cfg.scale.min_workers)
    b = largest_share_videos(cfg) * d.clips_per_video
    n = cached_chunk(cfg)  # clips per chunk with gradient caching, 0 without
    clips = cfg.clips_per_step
    gpu = cfg.scale.use_gpu
    t = trace or model_trace(cfg)
    dim = t.embed_dim
    p, largest = t.parameters + t.float_buffers, t.largest_parameter
    conv = conv or conv_path(gpu)
    f, f_live = t.recon_width, 0 if lc.detach_recon_targets else t.recon_live_width
    # with caching the reconstruction term lives in the chunk pass, not in the loss on the share
    loss = loss_memory(b, clips, dim, world, 0 if n else f, 0 if n else f_live,
                       ring=cfg.scale.ring_contrastive, queued_fraction=cfg.queue_clips_per_video / d.clips_per_video)
    rows = cfg.queue_rows
    est = {
        "params": t.state_bytes,
        "grads": p * FP32 if world == 1 or n else 0,
        "adam_moments": 2 * p * FP32,
        "ddp_buckets": p * FP32 if world > 1 else 0,
        "autocast_weights": p * 2 if gpu else 0,
        "batch": batch_bytes(cfg, b) * (1 + (d.prefetch_batches if gpu else 0)),
        "activations": t.saved_bytes(n or b),
        "loss_slabs": loss["loss_slabs"],
        "gathered_embeddings": loss["gathered_embeddings"],
        "loss_grads": loss["loss_grads"],
        "queue": rows * dim * _QUEUE_ITEMSIZE[lc.queue_dtype],
        "centroids": lc.num_clusters * dim * FP32,
        "conv_workspace": conv_workspace_bytes(t.convs, n or b, conv, threads),
        "grad_cache": b * MODALITY_COUNT * dim * t.embed_itemsize if n else 0,
        "recon_grads": n * (f + f_live) * FP32,
        "grad_accumulation": 2 * largest * FP32 if n else 0,
        "kmeans_input": _kmeans_bytes(rows, clips, lc.num_clusters, dim) if refit else 0,
        # foreach Adam on GPU: one fp32 temporary per parameter (sqrt of exp_avg_sq); the CPU
        # single-tensor Adam: two temporaries of the largest parameter (sqrt, then the division).
        "optimizer_workspace": (p * FP32 if gpu else 2 * largest * FP32) + OPTIMIZER_SMALL_TEMPORARIES,
        "cuda_context": CUDA_CONTEXT_BYTES if gpu else 0,
        "nccl_buffers": nccl_bytes(world) if gpu else 0,
    }
    persistent = sum(est[k] for k in PERSISTENT)
    step = sum(est[k] for k in STEP_PHASE)
    if n:  # the loss on the share, then the chunks' forwards and backwards: never at once
        step = sum(est[k] for k in STEP_COMMON) + max(sum(est[k] for k in LOSS_PHASE),
                                                      sum(est[k] for k in CHUNK_PHASE))
    # Adam runs after the backward has freed the activations; the batch is still held then.
    est["total"] = (persistent + max(step, est["batch"] + est["optimizer_workspace"])
                    + sum(est[k] for k in OUTSIDE_ALLOCATOR))
    return est


def model_trace(cfg: Config) -> ModelTrace:
    """The run's model traced for the estimate (``model_trace.py``), once per process and model."""
    return trace_of(TraceKey.of(cfg))


def batch_bytes(cfg: Config, clips: int) -> int:
    """Bytes of one batch of ``clips`` clips as the reader delivers it (its text in the dtype the
    text encoder asks for on this run's device)."""
    arrays = batch_arrays(cfg, clips, text_in_bf16(cfg.model, cfg.scale.use_gpu))
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in arrays.values())


def nccl_bytes(world: int) -> int:
    """NCCL's buffers on one GPU worker of ``world`` (see :data:`NCCL_GROUP_BYTES`); 0 alone."""
    return NCCL_GROUP_BYTES[min(world, 3)] if world >= 2 else 0


def allocator_total(est: dict[str, int]) -> int:
    """The part of ``est["total"]`` torch's caching allocator holds (what its peak statistics measure)."""
    return est["total"] - sum(est[k] for k in OUTSIDE_ALLOCATOR)


def largest_share_videos(cfg: Config) -> int:
    """Videos of the largest share a worker holds: ⌈B/N⌉ with the fewest workers (an elastic
    group's minimum; shares rotate, so every rank holds it at some step)."""
    return -(-cfg.data.batch_size // max(1, cfg.scale.min_workers))


def cached_chunk(cfg: Config) -> int:
    """Clips per chunk rank 0 runs with gradient caching: ``scale.grad_cache_clips`` when it is
    smaller than the largest share, else 0 (the loop then takes the plain step: nothing to save)."""
    n = cfg.scale.grad_cache_clips
    b = largest_share_videos(cfg) * cfg.data.clips_per_video
    return n if 0 < n < b else 0


def _kmeans_bytes(queue_rows: int, clips: int, k: int, d: int) -> int:
    """X (queue_rows + clips, d) fp32, the chunk it is copied through, and one Lloyd iteration's
    workspace (see the table above)."""
    n = queue_rows + clips
    return (n + min(queue_rows, COPY_CHUNK_ROWS)) * d * FP32 + min(n, 16384) * k * FP32 + 5 * k * d * FP32


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def format_estimate(est: dict[str, int], top: int | None = None) -> str:
    """``'total 41.20 GiB; largest: activations 30.10 GiB, ...'``, components largest first."""
    parts = sorted(((k, v) for k, v in est.items() if k != "total" and v), key=lambda kv: -kv[1])
    if top is not None:
        parts = parts[:top]
    return f"total {_gib(est['total'])}; largest: " + ", ".join(f"{k} {_gib(v)}" for k, v in parts)


def fits(cfg: Config, device_bytes: int, *, headroom: float = 0.9, conv: str | None = None,
         held: tuple[str, ...] = ()) -> tuple[bool, str, dict[str, int] | None]:
    """Will one worker of ``cfg`` fit a device of ``device_bytes``?

    Only ``headroom`` of the device is considered usable (allocator fragmentation). ``conv`` is the
    convolution kernel path (default: this machine's, :func:`conv_path`). ``held``: components
    already taken out of ``device_bytes`` (a worker's own free memory, read after its CUDA context
    exists, holds ``("cuda_context",)``).

    Returns:
        ``(ok, message, overrides)``. When it fits: ``{}``. When it does not, the dotted settings
        to change, in this order of preference, each the same loss until (4): (1) with
        several workers, the ring contrastive loss (``scale.ring_contrastive``) when that alone
        fits (no second forward); (2) gradient caching, ``scale.grad_cache_clips``: the fewest
        chunks that fit, as equal as whole videos allow (:func:`balanced_chunk` of
        :func:`largest_fitting_chunk`); (3) with several workers, caching and the ring together;
        (4) only when not even one video per chunk fits, the largest smaller
        ``data.clips_per_video`` that fits, plainly or
        else with caching as in (2), and whose config is valid (k-means needs
        ``loss.num_clusters`` clips per step): fewer negatives, another objective; None when
        nothing fits. The message names the largest components, the conv path, and what to change.
    """
    usable = int(device_bytes * headroom)
    conv = conv or conv_path(cfg.scale.use_gpu)

    def total(c: Config) -> int:
        est = estimate_worker_memory(c, conv=conv)  # every config here has cfg's model: one trace
        return est["total"] - sum(est[k] for k in held)

    est = estimate_worker_memory(cfg, conv=conv)
    est["total"] = total(cfg)
    n = cached_chunk(cfg)
    caching = f" with gradient caching in chunks of {n} clips" if n else ""
    where = f"of {_gib(device_bytes)} ({headroom:.0%} usable = {_gib(usable)}); {conv_path_note(conv)}"
    if est["total"] <= usable:
        return True, f"fits: estimated {_gib(est['total'])} per worker{caching} {where}", {}
    msg = f"does not fit: estimated {_gib(est['total'])} per worker{caching} {where}; {format_estimate(est, top=4)}. "
    b = cfg.data.clips_per_video * largest_share_videos(cfg)
    ring = {"scale.ring_contrastive": True} if cfg.scale.min_workers > 1 and not cfg.scale.ring_contrastive else {}
    if ring and not n and total(cfg.replace(ring)) <= usable:
        return False, msg + (
            f"Try scale.ring_contrastive=true (the same objective; the other workers' embeddings passed around a "
            f"ring instead of gathered: 1·B·D instead of 3·B·D floats per worker, twice the traffic; estimated "
            f"{_gib(total(cfg.replace(ring)))}), or more workers (scale.num_workers)."), ring
    for extra in ([{}, ring] if ring else [{}]):  # caching alone first, then with the ring
        base = cfg.replace(extra)
        largest = largest_fitting_chunk(base, usable, total)
        if largest is not None:
            chunk = balanced_chunk(base, largest)
            over = {**extra, "scale.grad_cache_clips": chunk}
            also = (" with the ring contrastive loss (scale.ring_contrastive=true: the other workers' embeddings "
                    "passed around a ring instead of gathered)") if extra else ""
            settings = " ".join(f"{k}={str(v).lower()}" for k, v in over.items())
            return False, msg + (
                f"Try {settings} (gradient caching{also}: the same loss, BatchNorm's statistics per chunk; the {b} "
                f"clips of a worker embedded in {-(-b // chunk)} chunks of whole videos, as equal as they go, the "
                f"fewest that fit (the largest chunk that fits is {largest} clips); estimated "
                f"{_gib(total(cfg.replace(over)))}), or more workers (scale.num_workers)."), over
    over = _fewer_clips(cfg, usable, total)
    smallest = cfg.replace({"scale.grad_cache_clips": cfg.data.clips_per_video})
    msg += f"Not even gradient caching with one video per chunk fits (estimated {_gib(total(smallest))}). "
    if over is None:
        return False, msg + ("No smaller data.clips_per_video fits either; use more workers (scale.num_workers), a "
                             "smaller data.batch_size, or a device with more memory."), None
    settings = " ".join(f"{k}={v}" for k, v in over.items())
    return False, msg + (f"Try {settings} (fewer clips per video: fewer negatives, another objective; estimated "
                         f"{_gib(total(cfg.replace(over)))}), more workers (scale.num_workers) or a smaller "
                         f"data.batch_size."), over


def largest_fitting_chunk(cfg: Config, usable: int, total) -> int | None:
    """The largest ``scale.grad_cache_clips`` (whole videos, smaller than the largest share) whose
    ``total(config)`` is at most ``usable`` bytes, or None. The estimate grows with the chunk, so a
    bisection over the number of videos per chunk finds it."""
    cpv = cfg.data.clips_per_video
    videos = largest_share_videos(cfg)
    lo, hi = 0, videos - 1  # videos per chunk: lo fits (0 = none yet), hi is the largest to try
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(cfg.replace({"scale.grad_cache_clips": mid * cpv})) <= usable:
            lo = mid
        else:
            hi = mid - 1
    return lo * cpv or None


def balanced_chunk(cfg: Config, largest: int) -> int:
    """The chunk to run when chunks of up to ``largest`` clips fit: the fewest chunks (as many as the
    largest chunk needs, so as many extra forwards), as equal as whole videos allow. The largest
    chunk itself may leave a last chunk of one video, whose BatchNorm statistics come from one
    video's clips only; equal chunks also peak lower."""
    cpv = cfg.data.clips_per_video
    videos = largest_share_videos(cfg)
    chunks = -(-videos // (largest // cpv))
    return -(-videos // chunks) * cpv


def _fewer_clips(cfg: Config, usable: int, total) -> dict[str, int] | None:
    """The largest smaller ``data.clips_per_video`` that fits, plainly or with the largest fitting chunk."""
    for c in range(cfg.data.clips_per_video - 1, 0, -1):
        if cfg.data.batch_size * c < cfg.loss.num_clusters:
            break  # fewer clips per step than clusters: no valid smaller setting below this
        over = {"data.clips_per_video": c, "scale.grad_cache_clips": 0}
        try:
            smaller = cfg.replace(over)
        except ValueError:
            continue
        if total(smaller) <= usable:
            return over if cfg.scale.grad_cache_clips else {"data.clips_per_video": c}
        largest = largest_fitting_chunk(smaller, usable, total)
        if largest is not None:
            return {"data.clips_per_video": c, "scale.grad_cache_clips": balanced_chunk(smaller, largest)}
    return None


__all__ = ["CONV_PATHS", "CUDNN", "MARGIN_PATHS", "MODELLED_CONV_PATHS", "NATIVE", "ONEDNN_AVX2", "ONEDNN_AVX512",
           "UNKNOWN", "ConvShape", "ModelTrace", "allocator_total", "balanced_chunk", "batch_bytes", "cached_chunk",
           "conv_path", "conv_path_note", "conv_workspace_bytes", "estimate_worker_memory", "fits", "format_estimate",
           "largest_fitting_chunk", "largest_share_videos", "loss_memory", "model_trace", "nccl_bytes"]
