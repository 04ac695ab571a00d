"""Online clustering: cosine k-means, the global feature queue, the cluster CE, and a run's
clustering state (:class:`Clustering`: queue, centroids, the modalities they were fitted for).

Semantics follow the original: assignment by argmax cosine similarity, centroid =
plain mean of the *un-normalised* member vectors, raw dot-product logits in the cluster CE. Two
deliberate deviations, both documented in docs/fidelity.md:

* an empty cluster is re-seeded with a poorly-fit point instead of becoming a zero vector
  (a zero centroid has no direction, attracts nothing and contributes a constant 0 logit);
* the returned labels are nearest-centroid w.r.t. the *final* centroids, not the last assignment
  made before the final update, so labels and centroids are always consistent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raymcn.collectives import Collectives
from raymcn.config import LossConfig
from raymcn.losses.contrastive import margin_cross_entropy

_EPS = 1e-12


def _best_cosine(x: torch.Tensor, centroids: torch.Tensor, x_norm: torch.Tensor,
                 chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid by cosine for every row of x (N, D): (labels (N,) long, cosine (N,) fp32).

    Chunked over rows, so the peak extra memory is chunk_rows × K, never N × K × D.
    """
    c_unit = F.normalize(centroids, dim=1, eps=_EPS)
    labels = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    best = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    for s in range(0, x.shape[0], chunk_rows):
        # argmax over centroids does not depend on the row's own norm, so normalise afterwards.
        sim = x[s:s + chunk_rows] @ c_unit.T
        lab = sim.argmax(dim=1)  # first maximum on ties: deterministic
        labels[s:s + chunk_rows] = lab
        best[s:s + chunk_rows] = sim.gather(1, lab[:, None]).squeeze(1) / x_norm[s:s + chunk_rows]
    return labels, best


@torch.no_grad()
def assign_clusters(x: torch.Tensor, centroids: torch.Tensor, chunk_rows: int = 16384) -> torch.Tensor:
    """Labels (N,) long: argmax cosine similarity of each row of x (N, D) to centroids (K, D)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        x = x.detach().float()
        norm = x.norm(dim=1).clamp_min(_EPS)
        return _best_cosine(x, centroids.detach().float(), norm, chunk_rows)[0]


# Lloyd iterations between two looks of the host at the convergence flag. The flag lives on the
# device, and iterations after convergence leave the centroids as they were (masked), so the result
# is that of stopping at convergence; the host waits for the device once per this many iterations
# instead of once per iteration, at the cost of at most this many - 1 iterations past convergence.
KMEANS_CHECK_EVERY = 10


@torch.no_grad()
def cosine_kmeans(x: torch.Tensor, k: int, iters: int, tol: float, init: torch.Tensor | None = None,
                  generator: torch.Generator | None = None, chunk_rows: int = 16384,
                  comm: Collectives | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means with cosine assignment and plain-mean centroids, in fp32.

    Args:
        x: (N, D) points (detached; any float dtype). N >= k.
        k: number of clusters.
        iters: at most this many assignment + update passes.
        tol: stop once Σ_k ‖C_new − C_old‖² <= tol (the update that reached it included).
        init: (k, D) warm start, or None for k distinct random rows of x drawn with ``generator``
            (a CPU torch.Generator; same seed -> same result).
        chunk_rows: rows per similarity block (memory knob only).
        comm: the ranks sharing the work (default one process). Every rank holds the same ``x``
            and calls this with the same arguments (a collective); each assigns its contiguous
            share of the rows (:meth:`Collectives.share`), and the per-cluster sums and counts are
            all-reduced, so every rank computes the centroids of all N rows with 1/world of the
            assignment work (the same centroids as one process, to float rounding of the sums).
            Rank 0's shift decides when every rank stops.

    Returns:
        centroids (k, D) fp32 and labels (N,) long, labels = nearest centroid (cosine) w.r.t. the
        returned centroids.

    Run-to-run deterministic on every device (the per-cluster sums: :func:`cluster_sums`). The host
    waits for the device once every :data:`KMEANS_CHECK_EVERY` iterations (the convergence flag),
    not once or twice per iteration.
    """
    comm = comm or Collectives()
    with torch.autocast(device_type=x.device.type, enabled=False):
        x = x.detach().float()
        n, d = x.shape
        if n < k:
            raise ValueError(f"cosine_kmeans: {n} points cannot form {k} clusters")
        if init is None:
            idx = torch.randperm(n, generator=generator)[:k].to(x.device, non_blocking=True)
            centroids = x[idx].clone()
        else:
            if tuple(init.shape) != (k, d):
                raise ValueError(f"cosine_kmeans: init has shape {tuple(init.shape)}, expected {(k, d)}")
            centroids = init.detach().to(device=x.device, dtype=torch.float32).clone()
        lo, hi = comm.share(n)
        part = x[lo:hi]  # this rank's rows (all of them in one process)
        part_norm = part.norm(dim=1).clamp_min(_EPS)
        sizes = comm.share_sizes(n)
        done = torch.zeros((), dtype=torch.bool, device=x.device)  # converged: later updates are masked

        for it in range(iters):
            labels, best = _best_cosine(part, centroids, part_norm, chunk_rows)
            counts = comm.all_reduce_sum_(cluster_counts(labels, k))
            sums = comm.all_reduce_sum_(cluster_sums(part, labels, k))
            new = sums / counts.clamp_min(1).to(sums.dtype)[:, None]
            new = _reseeded(new, counts, x, comm.all_gather(labels, sizes), comm.all_gather(best, sizes))
            shift = comm.broadcast_from_rank0(((new - centroids) ** 2).sum().reshape(1).double())[0]
            centroids = torch.where(done, centroids, new)
            done = done | (shift <= tol)
            if (it + 1) % KMEANS_CHECK_EVERY == 0 and it + 1 < iters and bool(done):
                break
        labels, _ = _best_cosine(part, centroids, part_norm, chunk_rows)
        return centroids, comm.all_gather(labels, sizes)


def cluster_counts(labels: torch.Tensor, k: int) -> torch.Tensor:
    """(k,) int64: how many of ``labels`` (n,) name each cluster. Added into a tensor of ``k``
    zeros, not by ``torch.bincount``, which on CUDA reads the labels' largest value on the host to
    size its output: a host sync per call, two per Lloyd iteration with its minimum check. Integer
    additions are exact, so the order the device adds them in does not matter."""
    return torch.zeros(k, dtype=torch.int64, device=labels.device).index_add_(0, labels, torch.ones_like(labels))


def cluster_sums(rows: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """(k, D) fp32: the sum of the ``rows`` (n, D) of each cluster, added in a fixed order, so the
    same bits on every run. On CPU ``index_add_`` adds row after row. On CUDA ``index_add_`` adds
    with atomics, whose order (so the sum's last bits) changes from run to run; ``index_put_`` with
    accumulation (its CUDA path whenever it accumulates) sorts the rows by label and adds each
    cluster's rows one after the other instead, for one sort of n labels more."""
    sums = torch.zeros(k, rows.shape[1], dtype=torch.float32, device=rows.device)
    if rows.device.type == "cpu":
        return sums.index_add_(0, labels, rows)
    return sums.index_put_((labels,), rows, accumulate=True)


def _reseeded(new: torch.Tensor, counts: torch.Tensor, x: torch.Tensor, labels: torch.Tensor,
              best: torch.Tensor) -> torch.Tensor:
    """``new`` (k, D) centroids with every empty cluster (``counts`` 0) re-seeded with one of the
    worst-fit points: the lowest cosine to their own centroid (``best``, all N rows), distinct,
    taken only from clusters that keep other members so no cluster is emptied in turn; the i-th
    empty cluster (by index) takes the i-th such point (a stable sort: deterministic). Computed on
    the device whether or not a cluster is empty, so the host never waits to find out; the same on
    every rank (the counts are all-reduced integers)."""
    empty = counts == 0
    order = torch.argsort(best, stable=True)
    donors = (counts[labels] > 1)[order]
    order = order[torch.argsort((~donors).to(torch.uint8), stable=True)]  # donors first, each kept in order
    slot = (torch.cumsum(empty, 0) - 1).clamp_min(0)  # the i-th empty cluster -> the i-th point
    return torch.where(empty[:, None], x[order[slot]], new)


def cluster_ce(e: torch.Tensor, centroids: torch.Tensor, labels: torch.Tensor, margin: float) -> torch.Tensor:
    """Cluster cross-entropy, a scalar in fp32.

    Args:
        e: (b, D) embeddings (with gradient).
        centroids: (K, D), treated as constants (detached).
        labels: (b,) long target cluster of each row.
        margin: subtracted from the target logit.

    Returns:
        mean over b of CE(e·Cᵀ − margin·onehot(label), label); logits are raw dot products.
    """
    with torch.autocast(device_type=e.device.type, enabled=False):
        logits = e.float() @ centroids.detach().float().T  # (b, K)
        return margin_cross_entropy(logits, labels, margin)


class FeatureQueue:
    """Global FIFO of feature rows, newest first, stored as float32 or bfloat16.

    A ring buffer: a push writes only its own rows (no shift of the whole 40k×6144 buffer);
    :meth:`contents` returns the filled rows in logical order, newest push first and, within a
    push, in the order given. ``capacity`` rows of ``dim`` columns.
    """

    def __init__(self, capacity: int, dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if capacity < 1 or dim < 1:
            raise ValueError(f"FeatureQueue needs capacity >= 1 and dim >= 1, got {capacity}, {dim}")
        self.capacity, self.dim, self.dtype = int(capacity), int(dim), dtype
        # Stored oldest -> newest with each push reversed, so reading it backwards gives the logical order.
        self._buf = torch.zeros(self.capacity, self.dim, dtype=dtype, device=device)
        self._ptr = 0  # next write position
        self._filled = 0

    def __len__(self) -> int:
        return self._filled

    @property
    def device(self) -> torch.device:
        return self._buf.device

    def clear(self) -> None:
        self._ptr = 0
        self._filled = 0
        self._buf.zero_()

    @torch.no_grad()
    def push(self, rows: torch.Tensor) -> None:
        """Insert rows (n, dim) at the front; the oldest rows fall off once capacity is reached.

        If n > capacity only the first ``capacity`` rows are kept.
        """
        if rows.ndim != 2 or rows.shape[1] != self.dim:
            raise ValueError(f"FeatureQueue.push: expected (n, {self.dim}), got {tuple(rows.shape)}")
        rows = rows.detach()[:self.capacity].flip(0).to(device=self._buf.device, dtype=self.dtype)
        n = rows.shape[0]
        first = min(n, self.capacity - self._ptr)
        self._buf[self._ptr:self._ptr + first] = rows[:first]
        if first < n:
            self._buf[:n - first] = rows[first:]
        self._ptr = (self._ptr + n) % self.capacity
        self._filled = min(self.capacity, self._filled + n)

    @torch.no_grad()
    def contents(self, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Filled rows (len, dim), newest first, as a new tensor of ``dtype`` (None = storage dtype)."""
        if self._filled < self.capacity:
            chrono = self._buf[:self._filled]  # has never wrapped: ptr == filled
        else:
            chrono = torch.cat([self._buf[self._ptr:], self._buf[:self._ptr]])
        out = chrono.flip(0)  # flip always copies
        return out if dtype is None else out.to(dtype)

    def copy_into(self, out: torch.Tensor, chunk_rows: int = 512) -> int:
        """Write the filled rows, newest first, into ``out[:len]`` (any float dtype) and return len.

        Unlike ``contents()`` this makes no full-size intermediate copy: the k-means input is
        built in place, which saves one fp32 queue copy (0.9 GiB at paper size, bench/memory.py).
        """
        n = self._filled
        # the i-th newest row sits just before the write position, wrapping around
        slots = (self._ptr - 1 - torch.arange(n, device=self._buf.device)) % self.capacity
        for start in range(0, n, chunk_rows):
            part = slots[start:start + chunk_rows]
            out[start:start + len(part)].copy_(self._buf.index_select(0, part))
        return n

    def state_dict(self) -> dict:
        """Logical contents (newest first, storage dtype, on CPU) plus shape; layout-independent."""
        return {"capacity": self.capacity, "dim": self.dim, "dtype": str(self.dtype).removeprefix("torch."),
                "rows": self.contents(dtype=None).cpu()}

    def load_state_dict(self, state: dict) -> None:
        """Restore rows saved by :meth:`state_dict`; a different capacity keeps the newest rows."""
        rows = state["rows"]
        if rows.ndim != 2 or rows.shape[1] != self.dim:
            raise ValueError(f"FeatureQueue.load_state_dict: rows {tuple(rows.shape)} do not match dim {self.dim}")
        self.clear()
        if rows.shape[0]:
            self.push(rows[:self.capacity])


_QUEUE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KMEANS_REFIT = "raymcn.kmeans_refit"  # profiler label of the refit (building X and Lloyd's iterations)


class Clustering:
    """A run's online clustering state: the global feature queue, the centroids and the modalities
    they were fitted for. Identical on every rank (every rank pushes the same global rows and takes
    rank 0's centroids); checkpointed through :meth:`state_dict` (the checkpoint's ``objective``).

    Args:
        loss: the loss settings (K, the refit's iterations, tolerance and period, the queue's dtype).
        embed_dim: D, the queue's width.
        queue_rows: global FIFO length; queue_clips_per_video: clips of each video pushed per step.
        seed: the run's seed (k-means initialisation, with the step).
        device: where the queue and centroids live (the worker's device).
    """

    def __init__(self, loss: LossConfig, *, embed_dim: int, queue_rows: int, queue_clips_per_video: int, seed: int,
                 device: torch.device | str = "cpu"):
        self.loss, self.embed_dim = loss, int(embed_dim)
        self.queue_clips_per_video, self.seed, self.device = int(queue_clips_per_video), int(seed), torch.device(device)
        self.queue = FeatureQueue(queue_rows, self.embed_dim, _QUEUE_DTYPES[loss.queue_dtype], self.device)
        self.centroids: torch.Tensor | None = None  # (K, D) fp32, identical on every rank, no grad
        self.active: frozenset[str] | None = None  # the modalities of the last step

    def track(self, active: frozenset[str]) -> None:
        """The step's modalities: a change (a stage switch) forgets queue and centroids, whose
        fused vectors lived in another subspace."""
        if self.active is not None and active != self.active:
            self.reset()
        self.active = active

    def reset(self) -> None:
        """Forget queue and centroids (their geometry no longer matches the embeddings)."""
        self.queue.clear()
        self.centroids = None

    @torch.no_grad()
    def refit(self, current: torch.Tensor, step: int, comm: Collectives) -> None:
        """Refit the centroids when due (none yet, or every ``loss.refresh_every`` steps) on the queue
        as it was before this step's push and ``current`` (B, D), this step's global fused rows.

        The k-means input is written in place (no copy of the queue beside it) and is identical on
        every rank; every rank assigns its share of the rows and the centroid sums are all-reduced,
        so the refit takes 1/world of one device's time. The label lets a profile (bench/step.py)
        find the refit's memory."""
        lc = self.loss
        if self.centroids is not None and step % lc.refresh_every:
            return
        with torch.profiler.record_function(KMEANS_REFIT):
            n = len(self.queue)
            x = torch.empty(n + current.shape[0], self.embed_dim, dtype=torch.float32, device=self.device)
            self.queue.copy_into(x)
            x[n:] = current
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + int(step))
            centroids, _ = cosine_kmeans(x, lc.num_clusters, lc.kmeans_iters, lc.kmeans_tol, init=self.centroids,
                                         generator=gen, comm=comm)
            del x
        # One source of truth: rank 0's centroids, so ranks never drift apart by float noise
        # (the all-reduced sums may round differently per rank).
        self.centroids = comm.broadcast_from_rank0(centroids.contiguous())

    def push(self, per_video: torch.Tensor) -> None:
        """Queue the first ``queue_clips_per_video`` clips of every global video of ``per_video``
        (videos, clips, D)."""
        self.queue.push(per_video[:, :self.queue_clips_per_video].reshape(-1, self.embed_dim))

    def state_dict(self) -> dict:
        return {"queue": self.queue.state_dict(),
                "centroids": None if self.centroids is None else self.centroids.detach().cpu().clone(),
                "active": None if self.active is None else sorted(self.active)}

    def load_state_dict(self, state: dict) -> None:
        self.queue.load_state_dict(state["queue"])
        c = state.get("centroids")
        if c is not None and tuple(c.shape) != (self.loss.num_clusters, self.embed_dim):
            # A resumed run with another K or D: refit from scratch rather than fail.
            c = None
        self.centroids = None if c is None else c.to(device=self.device, dtype=torch.float32)
        self.active = None if state.get("active") is None else frozenset(state["active"])
