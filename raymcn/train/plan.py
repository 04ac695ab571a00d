"""The run plan: every quantity a run derives from its config and its shards, computed once.

The driver builds a :class:`RunPlan` from the config and the shard manifest (``plan_run``); the
preflight builds the same one, so it and the trainer can never disagree on a path or a count, and
the workers receive it beside the config instead of re-deriving anything. One definition each:
the shard folder (``data.shards`` with ``~`` expanded, or the cached synthetic shards), each
rank's share of the batch, steps per epoch, total steps, warm-up steps, the stage-switch step, the
schedulers' budget offset and the queue size. Nothing in it depends on how many workers share the
steps (an elastic group may change that mid-run): the global batch is ``data.batch_size`` at every
world size, and :meth:`RunPlan.share` cuts it for any world. No Ray, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raymcn.config import Config, ConfigError
from raymcn.data.order import share
from raymcn.train.stages import budget_offset, switch_step


@dataclass(frozen=True)
class RunPlan:
    """What a run will do, fixed before it starts (see the module doc).

    Attributes:
        shards_dir: absolute folder of the shards (and ``vocab.npy``) the run reads.
        videos, num_shards: readable videos and shards listed in the manifest.
        batch_videos: ``data.batch_size``, videos per global step at every world size.
        min_workers, max_workers: the worker range (equal unless elastic; 0 in-process).
        clips_per_video: clips drawn per video per step (video-major rows on every rank).
        steps_per_epoch: steps every rank runs per epoch (videos // batch, capped by
            ``schedule.steps_per_epoch``); epochs: ``schedule.epochs``.
        switch_step: first global step of stage 2 (0 for ``joint``).
        budget_offset: epochs before the schedulers' clock starts: ``budget_epoch = epoch -
            budget_offset`` is the same for every trial of a sweep (stage orders included).
        queue_rows: global FIFO rows; queue_clips_per_video: clips of each video queued per step.
        warmup_steps: steps of linear LR warm-up (:func:`warmup_steps`); the half cosine then runs
            to 0 at ``total_steps``, so both are fixed shares of the run's videos at any batch size.
    """

    shards_dir: str
    videos: int
    num_shards: int
    batch_videos: int
    min_workers: int
    max_workers: int
    clips_per_video: int
    steps_per_epoch: int
    epochs: int
    switch_step: int
    budget_offset: int
    queue_rows: int
    queue_clips_per_video: int
    warmup_steps: int

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    @property
    def warmup_epochs(self) -> float:
        """Epochs the warm-up lasts (a fraction when it ends mid-epoch)."""
        return self.warmup_steps / self.steps_per_epoch

    @property
    def clips_per_step(self) -> int:
        """B: clips of one global step, over all ranks."""
        return self.batch_videos * self.clips_per_video

    def share(self, rank: int, world: int, step: int) -> int:
        """Videos rank ``rank`` of ``world`` holds at global step ``step`` (:func:`share`)."""
        return share(self.batch_videos, rank, world, step)

    def shares(self, world: int, step: int) -> tuple[int, ...]:
        """Every rank's videos at ``step``; they sum to ``batch_videos``."""
        return tuple(self.share(r, world, step) for r in range(world))

    def budget_epoch(self, epoch: int) -> int:
        """Epochs completed since every stage order has all three modalities (the schedulers' clock)."""
        return epoch - self.budget_offset

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunPlan:
        return cls(**raw)


def warmup_steps(cfg: Config) -> int:
    """Warm-up steps of ``cfg``: ``optim.warmup_steps`` when set (a fixed count), else
    ⌈optim.warmup_videos / data.batch_size⌉, the steps that see that many videos. Measured in videos,
    a batch-8 and a batch-32 run end their warm-up after the same share of an epoch, so an early
    rung compares them at the same point of the schedule. The defaults give the paper's 5000 steps
    at its batch of 128 (640 000 videos), on any corpus."""
    if cfg.optim.warmup_steps:
        return cfg.optim.warmup_steps
    return -(-cfg.optim.warmup_videos // cfg.data.batch_size)


def make_plan(cfg: Config, videos: int, shards_dir: str | Path = "", num_shards: int = 0) -> RunPlan:
    """The plan of ``cfg`` over a corpus of ``videos`` (the manifest's count, or an in-memory corpus's).

    Raises:
        ConfigError: the videos cannot fill one step of ``data.batch_size`` (naming both numbers).
    """
    try:
        steps = cfg.steps_per_epoch(videos)
    except ValueError as e:
        raise ConfigError([f"data.shards={str(shards_dir)!r}: {e}"]) from None
    s = cfg.schedule
    return RunPlan(shards_dir=str(shards_dir), videos=videos, num_shards=num_shards, batch_videos=cfg.data.batch_size,
                   min_workers=cfg.scale.min_workers, max_workers=cfg.scale.max_workers,
                   clips_per_video=cfg.data.clips_per_video,
                   steps_per_epoch=steps, epochs=s.epochs,
                   switch_step=switch_step(s.stage_order, s.stage1_fraction, steps * s.epochs),
                   budget_offset=budget_offset(s.stage1_fraction, s.epochs), queue_rows=cfg.queue_rows,
                   queue_clips_per_video=cfg.queue_clips_per_video, warmup_steps=warmup_steps(cfg))


def resolve_shards_dir(cfg: Config) -> Path:
    """The shard folder of ``cfg``: ``data.shards`` (``~`` expanded, made absolute), or the cached
    synthetic shards, generated once when ``data.shards`` is empty. The only place it is resolved."""
    from raymcn.data import synthetic

    if cfg.data.shards:
        return Path(cfg.data.shards).expanduser().resolve()
    return synthetic.ensure_synthetic_shards(cfg)


def locate_shards(cfg: Config) -> tuple[Path, dict]:
    """(shard folder, its manifest) of ``cfg``; the manifest is read once, on the driver (it lists
    every video).

    Raises:
        ConfigError: the folder or its manifest is missing or unreadable (naming ``data.shards``).
    """
    from raymcn.data import shards

    directory = resolve_shards_dir(cfg)
    where = f"data.shards={cfg.data.shards!r}"
    if not directory.is_dir():
        raise ConfigError([f"{where}: directory does not exist (write the shards there with `raymcn shards "
                           f"--out {cfg.data.shards} ...` from the feature folders or tars)"])
    try:
        manifest = shards.load_manifest(directory)
        shards.feature_dtype(manifest, directory)  # one dtype in the folder, or the shards of each named
        return directory, manifest
    except (OSError, ValueError) as e:
        raise ConfigError([f"{where}: {e}"]) from None


def plan_run(cfg: Config) -> tuple[RunPlan, dict]:
    """(plan, manifest) of ``cfg`` (:func:`locate_shards`, then :func:`make_plan`)."""
    directory, manifest = locate_shards(cfg)
    return make_plan(cfg, int(manifest["counts"]["videos"]), directory, len(manifest["shards"])), manifest
