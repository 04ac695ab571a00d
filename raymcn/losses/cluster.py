"""Online clustering pieces: cosine k-means, the global feature queue, and the cluster CE.

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

from raymcn.losses.contrastive import margin_cross_entropy
from raymcn.losses.gather import Collectives

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


@torch.no_grad()
def cosine_kmeans(x: torch.Tensor, k: int, iters: int, tol: float, init: torch.Tensor | None = None,
                  generator: torch.Generator | None = None, chunk_rows: int = 16384,
                  comm: Collectives | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means with cosine assignment and plain-mean centroids, in fp32.

    Args:
        x: (N, D) points (detached; any float dtype). N >= k.
        k: number of clusters.
        iters: at most this many assignment + update passes.
        tol: stop once Σ_k ‖C_new − C_old‖² <= tol.
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
    """
    comm = comm or Collectives()
    with torch.autocast(device_type=x.device.type, enabled=False):
        x = x.detach().float()
        n, d = x.shape
        if n < k:
            raise ValueError(f"cosine_kmeans: {n} points cannot form {k} clusters")
        if init is None:
            idx = torch.randperm(n, generator=generator)[:k].to(x.device)
            centroids = x[idx].clone()
        else:
            if tuple(init.shape) != (k, d):
                raise ValueError(f"cosine_kmeans: init has shape {tuple(init.shape)}, expected {(k, d)}")
            centroids = init.detach().to(device=x.device, dtype=torch.float32).clone()
        lo, hi = comm.share(n)
        part = x[lo:hi]  # this rank's rows (all of them in one process)
        part_norm = part.norm(dim=1).clamp_min(_EPS)

        for _ in range(iters):
            labels, best = _best_cosine(part, centroids, part_norm, chunk_rows)
            counts = comm.all_reduce_sum_(torch.bincount(labels, minlength=k))
            sums = torch.zeros(k, d, dtype=torch.float32, device=x.device).index_add_(0, labels, part)
            sums = comm.all_reduce_sum_(sums)
            new = sums / counts.clamp_min(1).to(sums.dtype)[:, None]
            empty = torch.nonzero(counts == 0).squeeze(1)
            if empty.numel():  # the same decision on every rank: the counts are all-reduced integers
                # Re-seed each empty centroid with one of the worst-fit points (lowest cosine to its
                # own centroid), distinct, taken only from clusters that keep other members so no
                # cluster is emptied in turn. Stable sort over all N rows -> deterministic choice.
                sizes = comm.share_sizes(n)
                labels, best = comm.all_gather(labels, sizes), comm.all_gather(best, sizes)
                donor_ok = counts[labels] > 1
                order = torch.argsort(best, stable=True)
                order = order[donor_ok[order]]
                new[empty] = x[order[:empty.numel()]]
            shift = ((new - centroids) ** 2).sum().reshape(1).double()
            centroids = new
            if float(comm.broadcast_from_rank0(shift)) <= tol:
                break
        labels, _ = _best_cosine(part, centroids, part_norm, chunk_rows)
        return centroids, comm.all_gather(labels, comm.share_sizes(n))


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
