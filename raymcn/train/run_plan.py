"""The run plan: every quantity a run derives from its config and its inputs, computed once.

The flow of a run (``raymcn train``, ``launch.fit``): the config -> its inputs, resolved once
(``inputs.resolve_inputs``: absolute paths, the embedded default generated there) -> this plan
(:func:`make_plan`, pure arithmetic on the config and the inputs) -> the preflight, the trainer and
every rank, which receive this one object. A sweep resolves its inputs once and each trial makes
its own plan from them (its configuration differs; nothing is read again). One definition each:
each rank's share of the batch, steps per epoch, total steps, warm-up steps, the stage-switch step,
the schedulers' budget offset and the queue size. Nothing in it depends on how many workers share
the steps (an elastic group may change that mid-run): the global batch is ``data.batch_size`` at
every world size, and :meth:`RunPlan.share` cuts it for any world. What a plan needs on other
nodes is in ``inputs``: paths that must mean the same files there (shared storage). No Ray, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from raymcn.config import Config, ConfigError
from raymcn.data.read.order import share
from raymcn.train.inputs import RunInputs
from raymcn.train.stages import budget_epoch, switch_step


@dataclass(frozen=True)
class RunPlan:
    """What a run will do, fixed before it starts (see the module doc).

    Attributes:
        videos: the videos an epoch draws from (the manifest's readable videos, or an in-memory
            corpus's).
        inputs: the files the run reads (``inputs.RunInputs``); None for a plan of an in-memory
            corpus (benchmarks and unit tests).
        batch_videos: ``data.batch_size``, videos per global step at every world size.
        min_workers, max_workers: the worker range (equal unless elastic; 0 in-process).
        clips_per_video: clips drawn per video per step (video-major rows on every rank).
        steps_per_epoch: steps every rank runs per epoch (videos // batch, capped by
            ``schedule.steps_per_epoch``); epochs: ``schedule.epochs``.
        switch_step: first global step of stage 2 (0 for ``joint``).
        budget_offset: epochs before the schedulers' clock starts (``budget_epoch = max(0, epoch -
            budget_offset)``); the same for every trial of a sweep (stage orders included).
        queue_rows: global FIFO rows; queue_clips_per_video: clips of each video queued per step.
        warmup_steps: steps of linear LR warm-up (:func:`warmup_steps`); the half cosine then runs
            to 0 at ``total_steps``, so both are fixed shares of the run's videos at any batch size.
    """

    videos: int
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
    inputs: RunInputs | None = None

    @property
    def shards_dir(self) -> str:
        """The shard folder the run reads (``inputs.shards_dir``)."""
        if self.inputs is None:
            raise ValueError("a plan of an in-memory corpus reads no shards")
        return self.inputs.shards_dir

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
        """The sweep schedulers' clock after ``epoch`` completed epochs (``stages.budget_epoch``):
        epochs completed since every stage order has all three modalities, 0 in stage 1."""
        return budget_epoch(epoch, self.budget_offset)


def warmup_steps(cfg: Config) -> int:
    """Warm-up steps of ``cfg``: ``optim.warmup_steps`` when set (a fixed count), else
    ⌈optim.warmup_videos / data.batch_size⌉, the steps that see that many videos. Measured in videos,
    a batch-8 and a batch-32 run end their warm-up after the same share of an epoch, so an early
    rung compares them at the same point of the schedule. The defaults give the paper's 5000 steps
    at its batch of 128 (640 000 videos), on any corpus."""
    if cfg.optim.warmup_steps:
        return cfg.optim.warmup_steps
    return -(-cfg.optim.warmup_videos // cfg.data.batch_size)


def make_plan(cfg: Config, videos: int, inputs: RunInputs | None = None) -> RunPlan:
    """The plan of ``cfg`` over ``inputs`` (then ``videos`` is theirs) or an in-memory corpus of
    ``videos`` videos.

    Raises:
        ConfigError: the videos cannot fill one step of ``data.batch_size`` (naming both numbers).
    """
    try:
        steps = cfg.steps_per_epoch(videos)
    except ValueError as e:
        where = f"data.shards={inputs.shards_dir!r}" if inputs is not None else "data.batch_size"
        raise ConfigError([f"{where}: {e}"]) from None
    s = cfg.schedule
    return RunPlan(videos=videos, batch_videos=cfg.data.batch_size,
                   min_workers=cfg.scale.min_workers, max_workers=cfg.scale.max_workers,
                   clips_per_video=cfg.data.clips_per_video,
                   steps_per_epoch=steps, epochs=s.epochs,
                   switch_step=switch_step(s.stage_order, s.stage1_fraction, steps * s.epochs),
                   budget_offset=cfg.stage1_epochs, queue_rows=cfg.queue_rows,
                   queue_clips_per_video=cfg.queue_clips_per_video, warmup_steps=warmup_steps(cfg), inputs=inputs)


def capped_steps_note(cfg: Config, plan: RunPlan) -> str | None:
    """What a run says when ``schedule.steps_per_epoch`` asks for more steps than its corpus fills:
    an epoch reads each video at most once, so the corpus caps it; None when it does not."""
    asked = cfg.schedule.steps_per_epoch
    if not asked or plan.steps_per_epoch >= asked:
        return None
    return (f"schedule.steps_per_epoch={asked} is more than the corpus fills: {plan.videos} videos // "
            f"data.batch_size={plan.batch_videos} = {plan.steps_per_epoch} steps, so each epoch runs "
            f"{plan.steps_per_epoch} (an epoch reads each video at most once)")


def plan_of(cfg: Config, inputs: RunInputs) -> RunPlan:
    """The plan of ``cfg`` over the resolved ``inputs`` (its videos are theirs)."""
    return make_plan(cfg, inputs.videos, inputs)
