"""The MCN training objective: contrastive + weighted cluster + weighted reconstruction terms.

One :class:`MCNObjective` lives in every training worker for the whole run. It owns the
clustering state (global feature queue, centroids, last active modality set), which is identical
on every rank and is checkpointed by the trainer through :meth:`state_dict`.

Distributed contract (see raymcn/collectives.py): every rank calls the objective every step with the same
active set, the same step and the same local batch size b, and every rank runs ``backward()`` on
``total_loss``. Returned values are this rank's share; the DDP-averaged gradient equals the
full-batch gradient and ``all_reduce_mean`` of a term equals its full-batch value. The objective
gets only what it needs (its loss settings, the clip layout, the queue size, the seed, and its rank
and world as a :class:`~raymcn.collectives.Collectives`); it never reads the run's whole config.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from raymcn.collectives import Collectives
from raymcn.config import MODALITIES, LossConfig
from raymcn.losses.cluster import FeatureQueue, assign_clusters, cluster_ce, cosine_kmeans
from raymcn.losses.contrastive import PAIRS, mms_loss
from raymcn.losses.recon import recon_loss
from raymcn.losses.ring import ring_mms_loss

_QUEUE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KMEANS_REFIT = "raymcn.kmeans_refit"  # profiler label of the refit (building X and Lloyd's iterations)


class MCNObjective(torch.nn.Module):
    """The loss of a step, with clustering state: a module, so a caller may hook its calls as it
    hooks any torch module's (``register_forward_hook``: fault injection makes a step's loss
    non-finite that way, ``train/faults.py``). Its state is not in parameters or buffers: it
    checkpoints through its own :meth:`state_dict`.

    Args:
        loss: the loss settings.
        embed_dim: D of the shared space (the queue's width).
        clips_per_video: clips of one video, consecutive in every batch (video-major rows).
        queue_rows: global FIFO length; queue_clips_per_video: clips of each video pushed per step.
        seed: the run's seed (k-means initialisation, with the step).
        device: where the queue and centroids live (the worker's device).
        comm: this rank's collectives (default: one process).
        ring: score the contrastive pairs against the other ranks' rows one rank's at a time,
            passed around a ring (ring.py), instead of gathering every rank's rows: the same loss,
            with 1·B·D instead of 3·B·D gathered floats per rank (the cluster term still gathers the
            fused rows) and twice the traffic.
        shares: global step -> every rank's clips at that step, in rank order (the run plan's
            rotating shares), when they are known in advance: several ranks then skip the step's
            exchange of their row counts (an all-gather whose result the host must read, a sync
            of the GPU's queue on CUDA), and a rank whose batch differs from its share is an error.
            None: the counts are exchanged every step.
    """

    def __init__(self, loss: LossConfig, *, embed_dim: int, clips_per_video: int, queue_rows: int,
                 queue_clips_per_video: int, seed: int, device: torch.device | str,
                 comm: Collectives | None = None, ring: bool = False,
                 shares: Callable[[int], Sequence[int]] | None = None):
        super().__init__()
        self.loss = loss
        self.embed_dim = int(embed_dim)
        self.clips_per_video, self.queue_clips_per_video = int(clips_per_video), int(queue_clips_per_video)
        self.seed = int(seed)
        self.device = torch.device(device)
        self.comm = comm or Collectives()
        self.ring = bool(ring)
        self.shares = shares
        self.queue = FeatureQueue(queue_rows, self.embed_dim, _QUEUE_DTYPES[loss.queue_dtype], self.device)
        self.centroids: torch.Tensor | None = None  # (K, D) fp32, identical on every rank, no grad
        self.active: frozenset[str] | None = None  # modality set of the previous call
        self.share_weight = 1.0  # the previous call's b·N/B: its terms' weight for this rank's share

    # --- state ----------------------------------------------------------------------------------
    def reset_clustering(self) -> None:
        """Forget queue and centroids (their geometry no longer matches the embeddings)."""
        self.queue.clear()
        self.centroids = None

    def state_dict(self) -> dict:  # the clustering state (torch's would be empty: no parameters)
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

    # --- the loss -------------------------------------------------------------------------------
    def forward(self, out: dict, active: frozenset[str], step: int) -> dict[str, torch.Tensor]:
        """Loss terms for one step.

        Args:
            out: model output. ``out[m]`` (b, D) for every active modality m (video-major: the
                ``cfg.data.clips_per_video`` clips of one video are consecutive), and optionally
                ``out["recon_<m>"] = (pred, target)``. Entries of inactive modalities are ignored.
            active: the modalities trained at this step (non-empty subset of video/audio/text).
            step: global optimizer step (drives the centroid refresh period and the k-means seed).

        Returns:
            scalar tensors: ``<pair>_contrastive_loss`` for each active pair (tv, at, av; without
            gradient with ``ring``, whose gradient flows through their sum), ``contrastive_loss``,
            ``cluster_loss``, ``recon_loss`` (only when ``out`` has a recon entry for an active
            modality; unweighted) and ``total_loss``.
        """
        active = frozenset(active)
        emb = self._checked_embeddings(out, active)
        b = next(iter(emb.values())).shape[0]
        if self.active is not None and active != self.active:
            self.reset_clustering()  # stage switch: fused vectors now live in another subspace
        self.active = active
        ref = next(iter(emb.values()))
        # Every rank's rows this step: equal, or ⌊B/N⌋ / ⌈B/N⌉ when the batch does not divide evenly.
        sizes = self._sizes(b, step, ref.device)
        offset, clips = sum(sizes[:self.comm.rank]), sum(sizes)
        gather = functools.partial(self.comm.all_gather, sizes=sizes)
        # Each term below is a mean over this rank's b rows. DDP averages the ranks' gradients and
        # the reports average their values; weighted by b·N/B, both are the full-batch mean's
        # (the weight is 1 when the shares are equal).
        weight = b * self.comm.world / clips
        self.share_weight = weight  # gradient caching weights the reconstruction it runs per chunk alike
        pairs = [(x, y, name) for x, y, name in PAIRS if x in active and y in active]
        if self.ring:
            # The cluster term gathers the fused rows (and frees them) before the ring allocates anything.
            cluster = self._cluster_loss(emb, {}, b, offset, step, gather)
            terms = self._ring_contrastive(emb, pairs, sizes, weight, ref.device)
        else:
            # Global negatives: every rank gathers the other ranks' rows, detached; mms_loss hands each
            # rank the full-batch gradient of its own rows, so nothing goes back. The cluster term
            # runs first: its (B, D) temporaries are gone before the contrastive slabs are allocated.
            in_pairs = [m for m in MODALITIES if any(m in (x, y) for x, y, _ in pairs)]
            gathered = {m: gather(emb[m].float()) for m in in_pairs}
            cluster = self._cluster_loss(emb, gathered, b, offset, step, gather)
            terms = self._gathered_contrastive(emb, gathered, pairs, offset, gather, weight, ref.device)
        terms["cluster_loss"] = weight * cluster

        recon_pairs = {m: out[f"recon_{m}"] for m in MODALITIES if m in active and f"recon_{m}" in out}
        total = terms["contrastive_loss"] + self.loss.cluster_weight * terms["cluster_loss"]
        if recon_pairs:
            terms["recon_loss"] = self.recon_term(recon_pairs)
            total = total + self.in_total(terms["recon_loss"])
        terms["total_loss"] = total
        return terms

    def recon_term(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], fraction: float = 1.0) -> torch.Tensor:
        """``recon_loss`` of this rank's share from its ``pairs`` (modality -> (pred, target)),
        weighted by the last call's share weight b·N/B as every term is; for a chunk holding
        ``fraction`` of the share's clips (gradient caching), that chunk's part of it: the parts
        sum to the share's term."""
        return recon_loss(pairs, self.loss.detach_recon_targets) * (fraction * self.share_weight)

    def in_total(self, recon: torch.Tensor) -> torch.Tensor:
        """What a ``recon_loss`` term (or a chunk's part of it) adds to ``total_loss``."""
        return self.loss.recon_weight * recon

    def _sizes(self, b: int, step: int, device: torch.device) -> list[int]:
        """Every rank's rows at ``step``: from ``shares`` when given (no exchange), else exchanged."""
        if self.shares is None or self.comm.world == 1:
            return self.comm.sizes(b, device)
        sizes = [int(n) for n in self.shares(step)]
        if len(sizes) != self.comm.world or sizes[self.comm.rank] != b:
            raise ValueError(f"rank {self.comm.rank} of {self.comm.world} holds {b} clips at step {step}; the run "
                             f"plan's shares are {sizes} clips")
        return sizes

    def _checked_embeddings(self, out: dict, active: frozenset[str]) -> dict[str, torch.Tensor]:
        """The active modalities' (b, D) embeddings of ``out`` in a fixed order (the collectives
        must match on every rank), checked before any state changes."""
        if not active or not active <= set(MODALITIES):
            raise ValueError(f"active modalities must be a non-empty subset of {MODALITIES}, got {sorted(active)}")
        missing = [m for m in MODALITIES if m in active and m not in out]
        if missing:
            raise KeyError(f"model output lacks active modalities {missing}; has {sorted(out)}")
        emb = {m: out[m] for m in MODALITIES if m in active}
        b = next(iter(emb.values())).shape[0]
        for m, e in emb.items():
            if e.ndim != 2 or e.shape[0] != b:
                raise ValueError(f"out[{m!r}] has shape {tuple(e.shape)}; expected ({b}, D)")
        if b % self.clips_per_video:  # each rank holds whole videos (video-major rows)
            raise ValueError(f"{b} local clips are not whole videos of {self.clips_per_video} clips "
                             f"(data.clips_per_video)")
        return emb

    def _ring_contrastive(self, emb, pairs, sizes, weight: float, device) -> dict[str, torch.Tensor]:
        """The contrastive terms by the ring schedule (``ring.py``): the per-pair terms carry no
        gradient; it flows through their sum."""
        summed, per_pair = (ring_mms_loss(emb, [(x, y) for x, y, _ in pairs], self.loss.margin, self.comm, sizes)
                            if pairs else (torch.zeros((), device=device), []))
        terms = {f"{name}_contrastive_loss": weight * v for (_, _, name), v in zip(pairs, per_pair)}
        terms["contrastive_loss"] = weight * summed
        return terms

    def _gathered_contrastive(self, emb, gathered, pairs, offset: int, gather, weight: float,
                              device) -> dict[str, torch.Tensor]:
        """The contrastive terms of this rank's rows against the gathered global rows."""
        terms, contrastive = {}, []
        for x, y, name in pairs:
            loss = weight * mms_loss(emb[x], emb[y], gathered[x], gathered[y], offset, self.loss.margin, gather=gather)
            terms[f"{name}_contrastive_loss"] = loss
            contrastive.append(loss)
        terms["contrastive_loss"] = torch.stack(contrastive).sum() if contrastive else torch.zeros((), device=device)
        return terms

    def _cluster_loss(self, emb: dict[str, torch.Tensor], gathered: dict[str, torch.Tensor], b: int, offset: int,
                      step: int, gather) -> torch.Tensor:
        """Fused-vector k-means labels -> cluster CE (the mean over this rank's rows); updates the
        queue and the centroids.

        ``gathered`` holds the (B, D) global rows of the modalities the contrastive pairs gathered;
        ``gather`` gathers this step's (unequal) shares.
        """
        lc = self.loss
        # Fused vector over the *active* modalities only (the original divided by 3 regardless).
        fused = _mean_of([e.float() for e in emb.values()])  # (b, D), keeps gradient
        if set(gathered) == set(emb):  # every stage order: the global fused rows need no gather of their own
            with torch.no_grad():
                current = _mean_of([gathered[m] for m in emb], in_place=True)
        else:
            current = gather(fused)
        current = current.to(self.device)  # (B, D) global, rank- then video-major

        refresh = self.centroids is None or step % lc.refresh_every == 0
        if refresh:
            # k-means input: the queue as it was before this step's push, then the current rows,
            # written in place (no extra copy of the queue alongside X); identical on every rank.
            # The label lets a profile (bench/step.py) find the refit's memory.
            with torch.profiler.record_function(KMEANS_REFIT):
                n = len(self.queue)
                x = torch.empty(n + current.shape[0], self.embed_dim, dtype=torch.float32, device=self.device)
                self.queue.copy_into(x)
                x[n:] = current
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + int(step))
                # Every rank assigns its share of the rows and the centroid sums are all-reduced:
                # the refit takes 1/world of one device's time instead of the others waiting for rank 0.
                centroids, _ = cosine_kmeans(x, lc.num_clusters, lc.kmeans_iters, lc.kmeans_tol,
                                             init=self.centroids, generator=gen, comm=self.comm)
                del x
            # One source of truth: rank 0's centroids, so ranks never drift apart by float noise
            # (the all-reduced sums may round differently per rank).
            self.centroids = self.comm.broadcast_from_rank0(centroids.contiguous())
        labels = assign_clusters(current[offset:offset + b], self.centroids).to(fused.device)

        if lc.cluster_on == "fused":
            loss = cluster_ce(fused, self.centroids, labels, lc.margin)
        else:
            loss = torch.stack([cluster_ce(e, self.centroids, labels, lc.margin) for e in emb.values()]).mean()

        self._push(current)
        return loss

    def _push(self, current: torch.Tensor) -> None:
        """Queue the first ``queue_clips_per_video`` clips of every global video in ``current`` (B, D)."""
        cpv = self.clips_per_video
        if current.shape[0] % cpv:
            raise ValueError(f"{current.shape[0]} global clips are not whole videos of {cpv} clips "
                             f"(data.clips_per_video)")
        per_video = current.view(current.shape[0] // cpv, cpv, self.embed_dim)
        self.queue.push(per_video[:, :self.queue_clips_per_video].reshape(-1, self.embed_dim))


def _mean_of(xs: list[torch.Tensor], in_place: bool = False) -> torch.Tensor:
    """Elementwise mean in one fixed order of operations, ((x0 + x1) + x2) / n: the mean of gathered
    rows is then bit for bit the gathered local means, so each rank's cluster labels (from the
    global rows) belong to exactly the fused vectors its loss uses. ``in_place`` (no autograd):
    one output allocation instead of one per operation (the same arithmetic)."""
    if in_place:
        total = xs[0].clone()
        for x in xs[1:]:
            total.add_(x)
        return total.div_(len(xs))
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total / len(xs)
