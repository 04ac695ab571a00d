"""The MCN training objective: contrastive + weighted cluster + weighted reconstruction terms.

One :class:`MCNObjective` lives in every training worker for the whole run. It gets only what it
needs, as open_clip's ``ClipLoss`` gets rank and world size: the loss settings, the run's
clustering state (:class:`~raymcn.losses.cluster.Clustering`, identical on every rank and
checkpointed by the trainer), this rank's :class:`~raymcn.collectives.Collectives` and the
:class:`Layout` of every step's rows, fixed by the run's plan; it never reads the run's whole config.

Distributed contract (see raymcn/collectives.py): every rank calls the objective every step with the same
active set, the same step and the same local batch size b, and every rank runs ``backward()`` on
``total_loss``. Returned values are this rank's share; the DDP-averaged gradient equals the
full-batch gradient and ``all_reduce_mean`` of a term equals its full-batch value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from raymcn.collectives import Collectives
from raymcn.config import MODALITIES, LossConfig
from raymcn.losses.cluster import Clustering, assign_clusters, cluster_ce
from raymcn.losses.contrastive import PAIRS, mms_loss
from raymcn.losses.recon import recon_loss
from raymcn.losses.ring import ring_mms_loss


@dataclass(frozen=True)
class StepRows:
    """Where this rank's b rows lie among one step's B global rows (rank-major).

    Attributes:
        sizes: every rank's rows at this step, in rank order (equal, or ⌊B/N⌋ / ⌈B/N⌉ clips'
            worth of videos when the batch does not divide evenly).
        offset: this rank's first global row.
        weight: b·N/B, the factor on each of this rank's terms (a mean over its b rows) that makes
            the ranks' mean, and DDP's averaged gradient, the full batch's (1 for equal shares).
    """

    sizes: tuple[int, ...]
    offset: int
    weight: float


@dataclass(frozen=True)
class Layout:
    """How every step's rows lie over the ranks and travel between them, fixed by the run's plan.

    Attributes:
        clips_per_video: clips of one video, consecutive in every batch (video-major rows).
        shares: global step -> every rank's clips at that step, in rank order (the plan's rotating
            shares): the ranks then skip the step's exchange of their row counts (an all-gather
            whose result the host must read, a sync of the GPU's queue on CUDA), and a rank whose
            batch differs from its share is an error. None: the counts are exchanged every step.
        ring: score the contrastive pairs against the other ranks' rows one rank's at a time,
            passed around a ring (ring.py), instead of gathering every rank's rows: the same loss,
            with 1·B·D instead of 3·B·D gathered floats per rank (the cluster term still gathers
            the fused rows) and twice the traffic.
    """

    clips_per_video: int = 1
    shares: Callable[[int], Sequence[int]] | None = None
    ring: bool = False


class MCNObjective:
    """The loss of a step (see the module doc).

    Args:
        loss: the loss settings.
        cluster: the run's clustering state (queue, centroids, active modalities), which each call updates.
        comm: this rank's collectives (default: one process).
        layout: every step's rows over the ranks (default: videos of one clip, counts exchanged
            every step, gathered negatives).
    """

    def __init__(self, loss: LossConfig, cluster: Clustering, comm: Collectives | None = None,
                 layout: Layout | None = None):
        self.loss, self.cluster = loss, cluster
        self.comm = comm or Collectives()
        self.layout = layout or Layout()

    def __call__(self, out: dict, active: frozenset[str], step: int,
                 rows: StepRows | None = None) -> dict[str, torch.Tensor]:
        """Loss terms for one step.

        Args:
            out: model output. ``out[m]`` (b, D) for every active modality m (video-major: the
                ``clips_per_video`` clips of one video are consecutive), and optionally
                ``out["recon_<m>"] = (pred, target)``. Entries of inactive modalities are ignored.
            active: the modalities trained at this step (non-empty subset of video/audio/text).
            step: global optimizer step (drives the centroid refresh period and the k-means seed).
            rows: this rank's rows at ``step`` (:meth:`rows`), when the caller already has them.

        Returns:
            scalar tensors: ``<pair>_contrastive_loss`` for each active pair (tv, at, av; without
            gradient with ``layout.ring``, whose gradient flows through their sum),
            ``contrastive_loss``, ``cluster_loss``, ``recon_loss`` (only when ``out`` has a recon
            entry for an active modality; unweighted) and ``total_loss``.
        """
        active = frozenset(active)
        emb = self._checked_embeddings(out, active)
        ref = next(iter(emb.values()))
        b = ref.shape[0]
        self.cluster.track(active)
        rows = rows or self.rows(b, step, ref.device)
        gather = functools.partial(self.comm.all_gather, sizes=list(rows.sizes))
        pairs = [(x, y, name) for x, y, name in PAIRS if x in active and y in active]
        if self.layout.ring:
            # The cluster term gathers the fused rows (and frees them) before the ring allocates anything.
            cluster = self._cluster_loss(emb, {}, rows, step, gather)
            terms = self._ring_contrastive(emb, pairs, rows, ref.device)
        else:
            # Global negatives: every rank gathers the other ranks' rows, detached; mms_loss hands each
            # rank the full-batch gradient of its own rows, so nothing goes back. The cluster term
            # runs first: its (B, D) temporaries are gone before the contrastive slabs are allocated.
            in_pairs = [m for m in MODALITIES if any(m in (x, y) for x, y, _ in pairs)]
            gathered = {m: gather(emb[m].float()) for m in in_pairs}
            cluster = self._cluster_loss(emb, gathered, rows, step, gather)
            terms = self._gathered_contrastive(emb, gathered, pairs, rows, gather, ref.device)
        terms["cluster_loss"] = rows.weight * cluster

        recon_pairs = {m: out[f"recon_{m}"] for m in MODALITIES if m in active and f"recon_{m}" in out}
        total = terms["contrastive_loss"] + self.loss.cluster_weight * terms["cluster_loss"]
        if recon_pairs:
            terms["recon_loss"] = self.recon_term(recon_pairs, rows)
            total = total + self.in_total(terms["recon_loss"])
        terms["total_loss"] = total
        return terms

    def rows(self, b: int, step: int, device: torch.device) -> StepRows:
        """This rank's ``b`` rows among every rank's at ``step``: from ``layout.shares`` (no
        exchange), else exchanged (a collective)."""
        comm = self.comm
        if self.layout.shares is None or comm.world == 1:
            sizes = comm.sizes(b, device)
        else:
            sizes = [int(n) for n in self.layout.shares(step)]
            if len(sizes) != comm.world or sizes[comm.rank] != b:
                raise ValueError(f"rank {comm.rank} of {comm.world} holds {b} clips at step {step}; the run "
                                 f"plan's shares are {sizes} clips")
        return StepRows(tuple(sizes), sum(sizes[:comm.rank]), b * comm.world / sum(sizes))

    def recon_term(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], rows: StepRows,
                   fraction: float = 1.0) -> torch.Tensor:
        """``recon_loss`` of this rank's share from its ``pairs`` (modality -> (pred, target)),
        weighted by ``rows.weight`` as every term is; for a chunk holding ``fraction`` of the
        share's clips (gradient caching), that chunk's part of it: the parts sum to the share's term."""
        return recon_loss(pairs, self.loss.detach_recon_targets) * (fraction * rows.weight)

    def in_total(self, recon: torch.Tensor) -> torch.Tensor:
        """What a ``recon_loss`` term (or a chunk's part of it) adds to ``total_loss``."""
        return self.loss.recon_weight * recon

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
        cpv = self.layout.clips_per_video
        if b % cpv:  # each rank holds whole videos (video-major rows)
            raise ValueError(f"{b} local clips are not whole videos of {cpv} clips (data.clips_per_video)")
        return emb

    def _ring_contrastive(self, emb, pairs, rows: StepRows, device) -> dict[str, torch.Tensor]:
        """The contrastive terms by the ring schedule (``ring.py``): the per-pair terms carry no
        gradient; it flows through their sum."""
        summed, per_pair = (ring_mms_loss(emb, [(x, y) for x, y, _ in pairs], self.loss.margin, self.comm,
                                          list(rows.sizes))
                            if pairs else (torch.zeros((), device=device), []))
        terms = {f"{name}_contrastive_loss": rows.weight * v for (_, _, name), v in zip(pairs, per_pair)}
        terms["contrastive_loss"] = rows.weight * summed
        return terms

    def _gathered_contrastive(self, emb, gathered, pairs, rows: StepRows, gather, device) -> dict[str, torch.Tensor]:
        """The contrastive terms of this rank's rows against the gathered global rows."""
        terms, contrastive = {}, []
        for x, y, name in pairs:
            loss = rows.weight * mms_loss(emb[x], emb[y], gathered[x], gathered[y], rows.offset, self.loss.margin,
                                          gather=gather)
            terms[f"{name}_contrastive_loss"] = loss
            contrastive.append(loss)
        terms["contrastive_loss"] = torch.stack(contrastive).sum() if contrastive else torch.zeros((), device=device)
        return terms

    def _cluster_loss(self, emb: dict[str, torch.Tensor], gathered: dict[str, torch.Tensor], rows: StepRows,
                      step: int, gather) -> torch.Tensor:
        """Fused-vector k-means labels -> cluster CE (the mean over this rank's rows); refits the
        centroids when due and queues the step's rows.

        ``gathered`` holds the (B, D) global rows of the modalities the contrastive pairs gathered;
        ``gather`` gathers this step's (unequal) shares.
        """
        cluster, lc = self.cluster, self.loss
        # Fused vector over the *active* modalities only (the original divided by 3 regardless).
        fused = _mean_of([e.float() for e in emb.values()])  # (b, D), keeps gradient
        if set(gathered) == set(emb):  # every stage order: the global fused rows need no gather of their own
            with torch.no_grad():
                current = _mean_of([gathered[m] for m in emb], in_place=True)
        else:
            current = gather(fused)
        current = current.to(cluster.device)  # (B, D) global, rank- then video-major
        cluster.refit(current, step, self.comm)
        b = fused.shape[0]
        labels = assign_clusters(current[rows.offset:rows.offset + b], cluster.centroids).to(fused.device)

        if lc.cluster_on == "fused":
            loss = cluster_ce(fused, cluster.centroids, labels, lc.margin)
        else:
            loss = torch.stack([cluster_ce(e, cluster.centroids, labels, lc.margin) for e in emb.values()]).mean()

        cpv = self.layout.clips_per_video
        if current.shape[0] % cpv:
            raise ValueError(f"{current.shape[0]} global clips are not whole videos of {cpv} clips "
                             f"(data.clips_per_video)")
        cluster.push(current.view(current.shape[0] // cpv, cpv, -1))
        return loss


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
