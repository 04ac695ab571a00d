"""Peak memory of the MCN loss per rank, gathered and ring negatives, vs the DataParallel original.

    python -m bench.memory            # B in 512 1024 2048 4096, N in 1 2 4 8, both (~10 min on 2 quiet cores)
    python -m bench.memory --quick    # B in 512 1024 (~2 min)
    python -m bench.memory --json     # the tables, then one JSON line with every figure and ratio
    python -m bench.memory --negatives ring      # only the ring loss (scale.ring_contrastive)
    python -m bench.memory --dim 64 --no-recon --no-refit   # only the b×B slabs matter (~15 s)

Peak RSS of the process: ~5.3 GB (at B = 4096), ~2.4 GB with --quick.
Measured figures: docs/measurements/memory.json (docs/performance.md).

What is measured: the loss computation of one training step, forward + backward, starting from the
embeddings (D = 6144, paper) and the reconstruction (prediction, target) pairs, on CPU in fp32:

* **raymcn, per rank**: the real :class:`raymcn.losses.MCNObjective` (contrastive MMS on the three
  pairs, cluster CE against fixed centroids on a non-refresh step, reconstruction, queue push),
  as rank 0 of N. One process plays rank 0: the objective is built with the collectives of rank 0
  of N (``Rank0Of``: a ``Collectives`` whose gather fills the other ranks' rows with copies of rank
  0's, whose ring hands every arriving block a copy of the one passed on, and whose mean /
  broadcast do nothing). So every allocation of the real code path is made (the gathered
  ``(B, D)`` tensors or the ring's blocks, the normalisers, the ``b×B`` row and column slabs or the
  ring's ``b×b`` tiles, and the gradients); only the wire is missing (gloo's internal buffers are
  not counted). The rank holds b = B/N clips. Two modes per (B, N): ``gathered`` (the default
  loss) and ``ring`` (``scale.ring_contrastive``, losses/ring.py).
* **DataParallel (the original)**: everything on one device, as ``train_tri_kmeans.py`` did on
  GPU 0 after DataParallel gathered the B embeddings: ``MMS_loss`` as written in the original
  ``loss.py`` (dense ``th.eye(B)`` margin, ``S − δI``, ``log_softmax`` on S and on Sᵀ, NLL), the
  three B×B similarity matrices kept as locals until backward as ``TrainOneBatch`` does, the
  cluster CE with its one-hot B×K margin, and the same reconstruction term. fp32 throughout, as
  raymcn's losses (under apex O1 the three S were fp16; everything after ``S − δI`` was fp32
  already). Left out, in the baseline's favour: the labels of the whole queue that the original
  assigned every step (only the B current rows here) and its queue shift (a clone of the whole
  queue, ~0.9 GB at paper size).

Both sides create their inputs inside the measured region (the DataParallel side holds all B rows
of each output, a raymcn rank its b rows), so the peak includes them; persistent state (the
feature queue, centroids) exists before and is excluded (it is listed in the second table).

How: :func:`bench.meters.peak_allocated_bytes` runs the step under ``torch.profiler``
with ``profile_memory=True`` and replays every allocation and free of torch's CPU allocator in time
order; the peak is the high-water mark of live bytes. This is an allocator-level measurement
(temporaries inside kernels count; glibc fragmentation does not), so it is what a CUDA caching
allocator would have to provide, minus its rounding.

The estimate column is ``footprint.loss_memory`` (the preflight's accounting) plus the inputs;
the slabs and gathered columns are its b×B and B×D terms, which explain the ratio: at D = 6144 the
gathered loss's per-rank floor is the gathered, detached (B, D) embeddings (3·B·D·4 bytes, whatever
N), which a rank needs to score its rows against all B columns, so its ratio stays above 1/N; with
``--dim 64 --no-recon`` the b×B slabs dominate and the ratio is below 1/N (no identity, no
S − δI copy, no B×B matrix). The ring's floor is the cluster term's gathered fused rows (B·D·4
bytes and the queue's half of them) or two ranks' blocks, whichever is larger; the target column
``1/N + 0.1`` is the issue's (the ring must stay at or below it at every B).

Before/after of the change that stopped sending gradients back through the gather (the loss now
computes each rank's full gradient locally from the gathered row/column normalisers): run this
file in a checkout of the commit before it (``git worktree add /tmp/before e88bb5c``) and here.

Second table, the k-means refit on rank 0 (skip it with ``--no-refit``): building the k-means input
X = [queue contents; current rows] and one Lloyd iteration, for the queue at paper proportions
(queue_steps = 20, half the clips of each video per step: 10·B rows), fp32 and bf16 queues,
before (``torch.cat([queue.contents(), current])``, as the objective first did) and now
(``FeatureQueue.copy_into`` writes the queue rows straight into a preallocated X, as
``MCNObjective`` does since this benchmark found the extra copy; the table checks both build the
same X).

What it found (this machine; the tables are in docs/performance.md): the gathered embeddings
first carried gradient, so every rank cloned and all-reduced a (B, D) gradient per modality in the
backward (at B = 4096: 1360 and 968 MiB per rank at N = 2 and 4, now 1110 and 699; the loss 4.6 s
instead of 7.1 s at N = 4); the estimate was 4-15 % below the measured peak at N = 8, where the
cluster term's gathered fused rows and the queue's copy decide the peak (now counted); the
k-means input held an extra fp32 copy of the queue (refit peak 2016 -> 1108 MiB at paper size).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from bench import harness, meters
from raymcn.collectives import Collectives
from raymcn.config import Config, ModelConfig
from raymcn.losses import FeatureQueue, cosine_kmeans
from raymcn.results.render import render_table
from raymcn.train.build import build_objective
from raymcn.train.preflight import footprint
from raymcn.train.run_plan import make_plan

MIB = 1 << 20
EMBED_DIM = ModelConfig().embed_dim  # 6144
MODALITIES = ("video", "audio", "text")
CLIPS_PER_VIDEO = 32
MARGIN = 0.001


# --- raymcn: rank 0 of N in one process ------------------------------------------------------------
class Rank0Of(Collectives):
    """Rank 0 of ``world``, played in one process: the objective's collectives with only the
    transport missing. ``all_gather`` allocates the (world·b, ...) result as the real one does and
    fills every rank's part with rank 0's rows; the ring allocates every arriving block as the real
    one does (two ranks' blocks held from the second hop on) and fills it with the block passed on;
    the mean and the broadcast leave the tensor as is."""

    def __init__(self, world: int):
        super().__init__(0, world)

    def _gather_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        for part in out.view(self.world, *x.shape):
            part.copy_(x)

    def _pass_on(self, held, arriving):
        for a, h in zip(arriving, held):
            a.copy_(h)
        return lambda: None

    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    def broadcast_from_rank0(self, t: torch.Tensor) -> torch.Tensor:
        return t


def loss_config(clips: int, world: int, queue_dtype: str = "float32", dim: int = EMBED_DIM) -> Config:
    """Paper loss settings for B = ``clips`` global clips (32 per video) over ``world`` ranks."""
    return Config().replace({"data.batch_size": clips // CLIPS_PER_VIDEO, "data.clips_per_video": CLIPS_PER_VIDEO,
                             "scale.num_workers": world, "loss.queue_dtype": queue_dtype, "loss.kmeans_iters": 1,
                             "model.embed_dim": dim})


def _recon_widths(dim: int) -> dict[str, int]:
    """Reconstruction target widths of the default model with a ``dim``-wide space, as its parts
    give them (built on the meta device: no memory)."""
    from raymcn.model import MCN

    with torch.device("meta"):
        model = MCN(ModelConfig(embed_dim=dim))
    return {m: model.encoder(m).target_dim for m in MODALITIES}


def _sources(rows: int, dim: int, recon: bool, seed: int = 0) -> dict:
    """Embeddings (rows, D) and, with ``recon``, reconstruction (pred, target) pairs."""
    g = torch.Generator().manual_seed(seed)
    src = {m: torch.randn(rows, dim, generator=g) * 0.02 for m in MODALITIES}
    if recon:
        for m, width in _recon_widths(dim).items():
            src[f"recon_{m}"] = (torch.rand(rows, width, generator=g), torch.rand(rows, width, generator=g))
    return src


def _inputs(src: dict) -> dict:
    """Fresh leaves (allocated inside the measured region), gradient where the model would have it:
    embeddings and predictions always, targets for audio and text (not detached in the original)."""
    out = {m: src[m].clone().requires_grad_() for m in MODALITIES}
    for m in MODALITIES:
        if f"recon_{m}" not in src:
            continue
        pred, target = src[f"recon_{m}"]
        out[f"recon_{m}"] = (pred.clone().requires_grad_(), target.clone().requires_grad_(m != "video"))
    return out


def raymcn_peak(clips: int, world: int, dim: int = EMBED_DIM, recon: bool = True,
                ring: bool = False) -> tuple[int, float]:
    """Peak bytes and seconds of rank 0's objective forward + backward (b = clips / world); ``ring``:
    the ring contrastive loss instead of the gathered one."""
    cfg = loss_config(clips, world, dim=dim).replace({"scale.ring_contrastive": ring})
    b = clips // world
    src = _sources(b, dim, recon)
    objective = build_objective(cfg, make_plan(cfg, videos=cfg.data.batch_size), "cpu", comm=Rank0Of(world))
    objective.cluster.centroids = torch.randn(cfg.loss.num_clusters, dim, generator=torch.Generator().manual_seed(1))
    objective.cluster.active = frozenset(MODALITIES)

    def step() -> None:
        out = _inputs(src)
        terms = objective(out, frozenset(MODALITIES), step=1)  # step 1: not a refresh step
        terms["total_loss"].backward()

    t0 = time.perf_counter()
    _, peak, _ = meters.peak_allocated_bytes(step)
    return peak, time.perf_counter() - t0


# --- the original, DataParallel: everything on GPU 0 -----------------------------------------------
def original_mms(s: torch.Tensor, margin: float = MARGIN) -> torch.Tensor:
    """``MMS_loss.forward`` of the original loss.py, verbatim in substance."""
    deltas = margin * torch.eye(s.size(0)).to(s.device)
    s = s - deltas
    target = torch.arange(s.size(0), device=s.device)
    i2c = F.nll_loss(F.log_softmax(s, dim=1), target)
    c2i = F.nll_loss(F.log_softmax(s.t(), dim=1), target)
    return i2c + c2i


def original_cluster_contrast(e: torch.Tensor, centroids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The original ``cluster_contrast`` (nce=0): one-hot B×K margin, log_softmax, NLL."""
    s = e @ centroids.t()
    onehot = torch.zeros(e.shape[0], centroids.shape[0])
    onehot[torch.arange(e.shape[0]), labels] = 1
    s = s - onehot * MARGIN
    return F.nll_loss(F.log_softmax(s, dim=1), labels)


def dataparallel_peak(clips: int, dim: int = EMBED_DIM, recon: bool = True) -> tuple[int, float]:
    """Peak bytes and seconds of the original loss forward + backward with all B rows on one device."""
    src = _sources(clips, dim, recon)
    centroids = torch.randn(256, dim, generator=torch.Generator().manual_seed(1))

    def step() -> None:
        out = _inputs(src)
        audio, video, text = out["audio"], out["video"], out["text"]
        # TrainOneBatch keeps the three similarity matrices as locals until backward.
        sim_audio_video = audio @ video.t()
        sim_audio_text = audio @ text.t()
        sim_text_video = text @ video.t()
        loss = original_mms(sim_text_video) + original_mms(sim_audio_text) + original_mms(sim_audio_video)
        fused = (audio + text + video) / 3
        with torch.no_grad():
            labels = (F.normalize(fused, dim=1) @ F.normalize(centroids, dim=1).t()).argmax(dim=1)
        loss = loss + (original_cluster_contrast(video, centroids, labels)
                       + original_cluster_contrast(audio, centroids, labels)
                       + original_cluster_contrast(text, centroids, labels)) / 3
        if recon:
            mse = sum(((out[f"recon_{m}"][0] - out[f"recon_{m}"][1]) ** 2).mean(dim=1) for m in MODALITIES)
            loss = loss + 50 * mse.mean()
        loss.backward()

    t0 = time.perf_counter()
    _, peak, _ = meters.peak_allocated_bytes(step)
    return peak, time.perf_counter() - t0


def loss_estimate(clips: int, world: int, dim: int = EMBED_DIM, recon: bool = True,
                  ring: bool = False) -> dict[str, int]:
    """The preflight's loss accounting (footprint.loss_memory) for rank 0, plus its inputs."""
    cfg = loss_config(clips, world, dim=dim).replace({"model.recon": recon})
    trace = footprint.model_trace(cfg)  # the model's targets as its traced forward returns them
    f, f_live = trace.recon_width, 0 if cfg.loss.detach_recon_targets else trace.recon_live_width
    est = footprint.loss_memory(clips // world, clips, dim, world, f, f_live, ring=ring,
                                queued_fraction=cfg.queue_clips_per_video / cfg.data.clips_per_video)
    est["total"] = sum(est.values())
    return est


# --- k-means refit on rank 0 ------------------------------------------------------------------------
def _full_queue(cfg: Config, seed: int = 2) -> FeatureQueue:
    """The queue as it is at a refresh step: full, filled push by push (ring pointer back at 0)."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.loss.queue_dtype]
    q = FeatureQueue(cfg.queue_rows, EMBED_DIM, dtype)
    g = torch.Generator().manual_seed(seed)
    per_push = cfg.clips_per_step * cfg.queue_clips_per_video // cfg.data.clips_per_video
    for _ in range(cfg.queue_rows // per_push):
        q.push(torch.randn(per_push, EMBED_DIM, generator=g) * 0.02)
    return q


def kmeans_input_current(queue: FeatureQueue, current: torch.Tensor) -> torch.Tensor:
    """X as ``MCNObjective._cluster_loss`` first built it ("before"): ``contents()`` materialises
    the ring in chronological order (a copy), flips it (a second copy) and converts it (a third,
    for bf16) before ``torch.cat`` makes X."""
    return torch.cat([queue.contents(), current])


def kmeans_input_lean(queue: FeatureQueue, current: torch.Tensor) -> torch.Tensor:
    """X as ``Clustering.refit`` builds it now: the only large allocation is X itself."""
    n = len(queue)
    x = torch.empty(n + current.shape[0], queue.dim, dtype=torch.float32, device=current.device)
    queue.copy_into(x)
    x[n:].copy_(current)
    return x


def refit_peak(clips: int, queue_dtype: str, lean: bool) -> tuple[int, float, int]:
    """(peak bytes above the queue, seconds, queue bytes) of building X + one k-means iteration."""
    cfg = loss_config(clips, 1, queue_dtype)
    queue = _full_queue(cfg)
    current = torch.randn(clips, EMBED_DIM, generator=torch.Generator().manual_seed(3)) * 0.02
    build = kmeans_input_lean if lean else kmeans_input_current

    def refit() -> None:
        x = build(queue, current)
        cosine_kmeans(x, cfg.loss.num_clusters, iters=1, tol=0.0, generator=torch.Generator().manual_seed(0))

    t0 = time.perf_counter()
    _, peak, _ = meters.peak_allocated_bytes(refit)
    return peak, time.perf_counter() - t0, queue._buf.nbytes


def check_lean_matches(clips: int = 64) -> bool:
    cfg = loss_config(256, 1, "bfloat16").replace({"loss.queue_steps": 3})
    queue = _full_queue(cfg)
    queue.push(torch.randn(40, EMBED_DIM))  # wrap the ring: pointer no longer at 0
    current = torch.randn(clips, EMBED_DIM)
    return torch.equal(kmeans_input_current(queue, current), kmeans_input_lean(queue, current))


# --- tables ------------------------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def loss_table(rows: list[dict]) -> str:
    head = ("B", "N", "b", "negatives", "raymcn/rank MiB", "DataParallel MiB", "ratio", "1/N + 0.1", "estimate MiB",
            "est/meas", "slabs MiB", "gathered MiB", "raymcn s", "DP s")
    table = []
    for r in rows:
        e = r["estimate"]
        cells = (r["B"], r["N"], r["b"], r["negatives"], _mib(r["raymcn_peak"]), _mib(r["dataparallel_peak"]),
                 f"{r['ratio']:.3f}", f"{r['target']:.3f}", _mib(e["total"]), f"{r['estimate_over_measured']:.2f}",
                 _mib(e["loss_slabs"]), _mib(e["gathered_embeddings"]), f"{r['raymcn_s']:.1f}",
                 f"{r['dataparallel_s']:.1f}")
        table.append(dict(zip(head, cells)))
    return render_table(table, right=head)


def refit_table(rows: list[dict]) -> str:
    head = ("B", "queue rows", "queue dtype", "queue MiB", "X MiB", "peak before MiB", "peak now MiB", "saved MiB",
            "estimate MiB")
    table = [dict(zip(head, (r["B"], r["queue_rows"], r["queue_dtype"], _mib(r["queue_bytes"]), _mib(r["x_bytes"]),
                             _mib(r["peak_current"]), _mib(r["peak_lean"]), _mib(r["peak_current"] - r["peak_lean"]),
                             _mib(r["estimate"])))) for r in rows]
    return render_table(table, right=head)


def build_parser():
    ap = harness.parser(__doc__, smoke="B = 256, N in 1 2, D = 64 in the loss table; the refit table at B = 256")
    ap.add_argument("--clips", type=int, nargs="+", help="global batch sizes B (default 512 1024 2048 4096)")
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2, 4, 8], help="world sizes N (default 1 2 4 8)")
    ap.add_argument("--quick", action="store_true", help="B in 512 1024 only")
    ap.add_argument("--no-refit", dest="refit", action="store_false", help="skip the k-means refit table")
    ap.add_argument("--dim", type=int, default=EMBED_DIM,
                    help="embedding width D of the loss table (default 6144, the paper's); a small D with "
                         "--no-recon isolates the b×B slabs")
    ap.add_argument("--no-recon", dest="recon", action="store_false",
                    help="leave the reconstruction term out of the loss table (both sides)")
    ap.add_argument("--negatives", nargs="+", choices=("gathered", "ring"), default=["gathered", "ring"],
                    help="how a rank gets the other ranks' rows: all-gathered, or passed around a ring "
                         "(scale.ring_contrastive); default both")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.smoke:
        args.clips, args.world, args.dim = [256], [1, 2], 64  # B >= loss.num_clusters (256)
    sizes = args.clips or ([512, 1024] if args.quick else [512, 1024, 2048, 4096])
    for b in sizes:
        if b % CLIPS_PER_VIDEO or any((b // CLIPS_PER_VIDEO) % n for n in args.world):
            ap.error(f"B={b}: must be {CLIPS_PER_VIDEO} clips × a number of videos divisible by every N")

    with harness.Results("memory", args) as results:
        print(f"bench.memory: loss forward+backward per rank, D={args.dim}, "
              f"{'with' if args.recon else 'without'} reconstruction, fp32 on CPU, "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
        rows = loss_rows(sizes, args, results)
        print()
        print(loss_table(rows))
        refit_rows = refit_figures(sizes, results) if args.refit else []
        results.finish({"bench": "memory", "embed_dim": args.dim, "recon": args.recon, "loss": rows,
                        "refit": refit_rows, "refit_embed_dim": EMBED_DIM})
    return 0


def loss_rows(sizes: list[int], args, results: harness.Results) -> list[dict]:
    """The loss table's rows: every (B, N, negatives), raymcn's rank 0 against the DataParallel original."""
    rows = []
    for clips in sizes:
        dp, dp_s = dataparallel_peak(clips, args.dim, args.recon)
        for world in args.world:
            for negatives in args.negatives:
                ring = negatives == "ring"
                peak, s = raymcn_peak(clips, world, args.dim, args.recon, ring)
                est = loss_estimate(clips, world, args.dim, args.recon, ring)
                rows.append({"B": clips, "N": world, "b": clips // world, "negatives": negatives, "raymcn_peak": peak,
                             "dataparallel_peak": dp, "ratio": peak / dp, "target": 1 / world + 0.1, "estimate": est,
                             "estimate_over_measured": est["total"] / peak, "raymcn_s": s, "dataparallel_s": dp_s})
                results.save(loss=rows)
                print(f"  B={clips} N={world} {negatives}: raymcn {_mib(peak)} MiB, DataParallel {_mib(dp)} MiB",
                      flush=True)
    return rows


def refit_figures(sizes: list[int], results: harness.Results) -> list[dict]:
    """The refit table's rows (printed, with the check that both ways build the same X)."""
    print("\nk-means refit on rank 0 (building X + one Lloyd iteration), queue at paper proportions:", flush=True)
    refit_rows = []
    for clips in sizes:
        for dtype in ("float32", "bfloat16"):
            cfg = loss_config(clips, 1, dtype)
            now, now_s, qbytes = refit_peak(clips, dtype, lean=False)
            lean, lean_s, _ = refit_peak(clips, dtype, lean=True)
            est = footprint.estimate_worker_memory(cfg)["kmeans_input"]
            refit_rows.append({"B": clips, "queue_rows": cfg.queue_rows, "queue_dtype": dtype,
                               "queue_bytes": qbytes, "x_bytes": (cfg.queue_rows + clips) * EMBED_DIM * 4,
                               "peak_current": now, "peak_lean": lean, "estimate": est,
                               "current_s": now_s, "lean_s": lean_s})
            results.save(refit=refit_rows)
    print(refit_table(refit_rows))
    print(f"X built now identical to X built before (wrapped bf16 ring): {check_lean_matches()}")
    return refit_rows


if __name__ == "__main__":
    sys.exit(main())
