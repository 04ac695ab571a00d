"""At most one host sync per training step outside logging, counted on CPU.

On a GPU every read of a device tensor's value on the host (``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool``/``float``/``int`` of a tensor, ``nonzero``) waits for every kernel queued
before it, and the device then idles while the host queues the next ones. So do the torch
operations whose output size depends on the values (:data:`TORCH_SYNCS`: ``torch.bincount`` reads
its input's largest value to size its output; indexing with a boolean mask is a ``nonzero``).
On CPU the same calls cost nothing, so they are counted instead: every such call raymcn's own code
makes (a call inside torch, e.g. Adam reading its step counters, which live on the host, is not
raymcn's) between a step's start and its end, for real steps of the tiny MCN of the embedded default on one process
and on 2 gloo ranks with unequal shares. A step reads its loss terms and gradient norm once
(``loop.read_values``); a k-means refit step adds one look at the convergence flag per
``cluster.KMEANS_CHECK_EVERY`` Lloyd iterations.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import raymcn
from raymcn.cli import preset_path
from raymcn.config import load_config
from raymcn.losses import cluster

PACKAGE = str(Path(raymcn.__file__).parent)
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "nonzero")
# torch operations that synchronise on CUDA (their output's size is read from the values), as
# functions of torch and methods of tensors
TORCH_SYNCS = ("bincount", "unique", "unique_consecutive", "masked_select", "repeat_interleave", "histc")
STEPS = 9  # refits at steps 0, 4, 8 (loss.refresh_every 4) and the steps between


class SyncCounter:
    """Counts the host syncs raymcn's code makes (module doc), by the step they fall in."""

    def __init__(self, monkeypatch):
        self.count, self.where = 0, []
        for name in SYNCS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name), name))
        monkeypatch.setattr(torch, "nonzero", self._counting(torch.nonzero, "torch.nonzero"))
        for name in TORCH_SYNCS:
            monkeypatch.setattr(torch, name, self._counting(getattr(torch, name), f"torch.{name}"))
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name), name))
        getitem = torch.Tensor.__getitem__
        masked = self._counting(getitem, "boolean mask index", depth=2)  # called by the lambda below
        monkeypatch.setattr(torch.Tensor, "__getitem__",
                            lambda t, index: masked(t, index) if _masks(index) else getitem(t, index))

    def _counting(self, original, name: str, depth: int = 1):
        def call(*args, **kwargs):
            code = sys._getframe(depth).f_code
            if code.co_filename.startswith(PACKAGE):
                self.count += 1
                self.where.append(f"{name} in {Path(code.co_filename).name}:{code.co_name}")
            return original(*args, **kwargs)
        return call


def _masks(index) -> bool:
    """Whether a tensor index selects with a boolean mask (its size then depends on the values)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def tiny_run(overrides: list[str], world: int = 1, rank: int = 0):
    """The embedded default's tiny MCN assembled as a rank of ``world`` runs it (DDP on several)."""
    from raymcn.collectives import Collectives
    from raymcn.train.build import assemble
    from raymcn.train.run_plan import make_plan

    cfg = load_config(preset_path(), [f"scale.num_workers={world}", "optim.warmup_steps=1", *overrides])
    plan = make_plan(cfg, cfg.data.batch_size * STEPS)
    wrap = None
    if world > 1:
        unused = cfg.schedule.stage_order != "joint"
        wrap = lambda net: torch.nn.parallel.DistributedDataParallel(  # noqa: E731
            net, find_unused_parameters=unused, gradient_as_bucket_view=True)
    return cfg, plan, assemble(cfg, plan, comm=Collectives(rank, world), wrap=wrap)


def rank_batches(cfg, plan, rank: int, world: int) -> list[dict]:
    """Each step's rows of this rank: its share of a random batch of the contract (the plan's rotation)."""
    from raymcn.data.formats.batch import random_batch
    from raymcn.data.read.order import rank_slots

    batches = []
    for step in range(STEPS):
        lo, hi = (v * cfg.data.clips_per_video for v in rank_slots(plan.batch_videos, rank, world, step))
        batches.append({k: v[lo:hi] for k, v in random_batch(cfg, cfg.clips_per_step, step).items()})
    return batches


def syncs_per_step(counter: SyncCounter, run, cfg, plan, batches) -> dict[int, int]:
    """Host syncs counted from each step's start to its end (``train_one_epoch``'s ``watch`` and
    ``after_step``); the epoch's closing metrics come after the last step and are not a step's."""
    from raymcn.train.loop import train_one_epoch
    from raymcn.train.run import Hooks

    start: dict[int, int] = {}
    per_step: dict[int, int] = {}

    def watch(phase: str, step: int) -> None:
        if phase == "step":
            start[step] = counter.count

    def after_step(run, values, batch) -> None:
        per_step[run.state.step - 1] = counter.count - start[run.state.step - 1]

    run.hooks = Hooks(watch=watch, after_step=[after_step], log=lambda line: None)
    train_one_epoch(run, batches)
    return per_step


def assert_at_most_one_per_step(per_step: dict[int, int], cfg, where: list[str]) -> None:
    assert sorted(per_step) == list(range(STEPS))
    refit_budget = 1 + math.ceil(cfg.loss.kmeans_iters / cluster.KMEANS_CHECK_EVERY)
    for step, n in per_step.items():
        refit = step % cfg.loss.refresh_every == 0
        assert n == 1 or (refit and n <= refit_budget), (step, n, where)


@pytest.mark.parametrize("overrides", [
    [],  # the plain step
    ["scale.grad_cache_clips=16"],  # gradient caching: 2 chunks of 2 videos
    ["schedule.stage_order=AV_T", "schedule.steps_per_epoch=9", "schedule.epochs=2"],  # stage 1: two modalities
    ["scale.ring_contrastive=true"],
], ids=["plain", "grad_cache", "staged", "ring"])
def test_a_step_reads_the_device_once(monkeypatch, overrides):
    cfg, plan, run = tiny_run(overrides)
    counter = SyncCounter(monkeypatch)
    per_step = syncs_per_step(counter, run, cfg, plan, rank_batches(cfg, plan, 0, 1))
    assert_at_most_one_per_step(per_step, cfg, counter.where)
    assert counter.where.count("tolist in loop.py:read_values") == STEPS  # the step's one read


@pytest.mark.parametrize("iters, looks", [(9, 0), (10, 0), (11, 1), (20, 1), (25, 2)])
def test_a_refit_looks_at_the_device_once_per_check_interval(monkeypatch, iters, looks):
    """Lloyd's iterations that never converge (a negative tolerance) look at the convergence flag
    once per ``KMEANS_CHECK_EVERY`` iterations, never after the last."""
    x = torch.randn(200, 16, generator=torch.Generator().manual_seed(0))
    counter = SyncCounter(monkeypatch)
    cluster.cosine_kmeans(x, 8, iters, -1.0, generator=torch.Generator().manual_seed(1))
    assert counter.count == looks and all(w == "__bool__ in cluster.py:cosine_kmeans" for w in counter.where)


def test_stopping_at_convergence_between_two_looks_gives_the_centroids_of_stopping_there():
    """The iterations after convergence and before the next look are masked: the centroids are
    those of Lloyd's iterations stopped at the convergence (the loop run one look at a time)."""
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(2))
    c, labels = cluster.cosine_kmeans(x, 6, 100, 1e-3, generator=torch.Generator().manual_seed(3))
    for iters in range(1, 100):  # the first iteration count that converges, run without looking further
        once, _ = cluster.cosine_kmeans(x, 6, iters, -1.0, generator=torch.Generator().manual_seed(3))
        more, _ = cluster.cosine_kmeans(x, 6, iters + 1, -1.0, generator=torch.Generator().manual_seed(3))
        if ((more - once) ** 2).sum().item() <= 1e-3:
            break
    assert torch.equal(c, more) and 1 < iters < cluster.KMEANS_CHECK_EVERY * 9
    assert torch.equal(labels, cluster.assign_clusters(x, c))


def _ranks_worker(rank: int, world: int) -> dict:
    from _pytest.monkeypatch import MonkeyPatch

    patch = MonkeyPatch()
    try:
        cfg, plan, run = tiny_run(["data.batch_size=15"], world, rank)  # 8 + 7 videos, rotating
        counter = SyncCounter(patch)
        per_step = syncs_per_step(counter, run, cfg, plan, rank_batches(cfg, plan, rank, world))
        return {"per_step": per_step, "where": counter.where, "refresh_every": cfg.loss.refresh_every,
                "kmeans_iters": cfg.loss.kmeans_iters}
    finally:
        patch.undo()


@pytest.mark.dist
def test_ranks_with_unequal_shares_exchange_no_row_counts():
    """On 2 gloo ranks the objective takes every rank's rows from the run plan (no all-gather of the
    counts, whose result the host would read every step)."""
    from bench.gloo import gloo_ranks

    for result in gloo_ranks(_ranks_worker, 2):
        cfg = load_config(preset_path(), [])
        assert_at_most_one_per_step(result["per_step"], cfg, result["where"])
        assert not any("collectives.py" in w for w in result["where"]), result["where"]
