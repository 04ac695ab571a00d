"""One rank's training run as the loop carries it: :class:`Run` (what the steps use, built once by
``build.assemble``), :class:`LoopState` (what the loop has done, checkpointed) and :class:`Hooks`
(what a caller plugs in). No Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from raymcn.collectives import Collectives
from raymcn.config import Config
from raymcn.data.formats.batch import Batch
from raymcn.losses import MCNObjective
from raymcn.train.checkpoints.policy import CheckpointPolicy
from raymcn.train.compiled import CompileClock
from raymcn.train.monitor.epoch_metrics import EpochProgress
from raymcn.train.run_plan import RunPlan


@dataclass
class LoopState:
    """Counters that must survive a resume (checkpointed with the model): the data position is
    (epoch, step), and the data order is a function of it alone (``data/read/order.py``).

    ``best``: each evaluated metric's best value over the epochs so far, by its ``best_`` name
    (``config.best_values``), reported with every epoch: a run restarted from its checkpoint (a
    reboot, a BOHB pause, a restored sweep) reports the best of the epochs before the restart too."""

    step: int = 0  # next global step
    epoch: int = 0  # the epoch in progress (or next, between epochs)
    nonfinite_streak: int = 0
    progress: EpochProgress = field(default_factory=EpochProgress)
    best: dict[str, float] = field(default_factory=dict)

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "nonfinite_streak": self.nonfinite_streak,
                "progress": asdict(self.progress), "best": dict(self.best)}

    def load_state_dict(self, d: dict) -> None:
        # (checkpoints before the epoch's progress counted the skipped steps also hold "skipped_steps")
        for k in ("step", "epoch", "nonfinite_streak"):
            setattr(self, k, int(d[k]))
        # checkpoints written before mid-epoch checkpoints existed hold no progress (epoch ends only)
        self.progress = EpochProgress(**d.get("progress", {}))
        # checkpoints written before the best values were reported hold none: the best restarts there
        self.best = {k: float(v) for k, v in d.get("best", {}).items()}

    def step_in_epoch(self, steps_per_epoch: int) -> int:
        """The next step's index within the current epoch (0 between epochs)."""
        return self.step - self.epoch * steps_per_epoch


def _no_watch(phase: str, step: int) -> None:
    pass


@dataclass
class Hooks:
    """What a caller plugs into a run: each hook is called with the run, and none is required but
    ``batches`` (for :func:`raymcn.train.loop.run_epochs`).

    Attributes:
        batches: (run, epoch, first in-epoch step) -> (this rank's batches of that epoch from that
            step on, its data counters or None); the counters' ``as_metrics()`` (``bad_samples``,
            ``videos_read``) are reported, summed over ranks.
        evaluate: run -> retrieval metrics after each epoch (its wall time is ``time_eval_s``).
        save: (run, the epoch's metrics, or None inside an epoch) -> None: a checkpoint, after each
            epoch and whenever ``run.checkpoints`` says one is due (the Ray worker saves a folder
            and reports it).
        before_step: run -> None before each step's compute, in order (fault injection,
            ``faults.install``, adds its hooks here only when a fault is asked for).
        after_backward: (run, the step's loss terms) -> None after its backward, before the
            update, in order (fault injection: a non-finite step).
        after_step: (run, the step's loss terms, its batch) -> None after each step, in order
            (progress lines, the probes); their time, and a mid-epoch checkpoint's after them, is
            the ``checkpoint`` phase.
        after_epoch: (run, the epoch's metrics) -> None after each epoch's checkpoint, in order
            (metrics.csv and the epoch line, a Tune report, fault injection).
        copy_checkpoint: (local checkpoint folder, storage filesystem, folder there) -> None: how a
            checkpoint's files go into the run's storage (``checkpoints/persist.py``); None: its
            ``copy_files`` (fault injection stands in a full disk here).
        log: progress lines (rank 0 passes print).
        watch: (phase, global step) -> None as each phase starts: ``"data"`` (waiting for the
            batch), ``"step"`` (compute and collectives), ``"checkpoint"`` (the ``after_step``
            hooks and a mid-epoch checkpoint), ``"evaluation"``, ``"report"``
            (``watchdog.Watchdog.at``).
    """

    batches: Callable[[Run, int, int], tuple[Iterable[Batch], Any]] | None = None
    evaluate: Callable[[Run], dict[str, float]] | None = None
    save: Callable[[Run, dict[str, float] | None], None] | None = None
    before_step: list[Callable[[Run], None]] = field(default_factory=list)
    after_backward: list[Callable[[Run, dict[str, torch.Tensor]], None]] = field(default_factory=list)
    after_step: list[Callable[[Run, dict[str, float], Batch], None]] = field(default_factory=list)
    after_epoch: list[Callable[[Run, dict[str, float]], None]] = field(default_factory=list)
    copy_checkpoint: Callable[[str, Any, str], None] | None = None
    log: Callable[[str], None] | None = None
    watch: Callable[[str, int], None] = _no_watch


@dataclass
class Run:
    """One rank's training run: built once (``build.assemble``) and carried whole through the
    epochs (``loop.run_epochs``), the epoch (``loop.train_one_epoch``) and the step
    (``loop.forward_backward``).

    Attributes:
        model: what the loop trains (the DDP wrapper on several ranks); net: the bare MCN
            (checkpoints and evaluation use it).
        comm: this rank's collectives (rank and world): the objective's gathers and the metric means.
        state: what the loop has done (checkpointed).
        hooks: what the caller plugged in (:class:`Hooks`).
        checkpoints: when to checkpoint inside an epoch (``hooks.save`` writes it); None: at
            epoch ends only.
        compile_clock: with ``scale.compile``, what compiling has cost since the run was built
            (``compiled.CompileClock``: each epoch's metrics say it); None: nothing is compiled.
    """

    cfg: Config
    plan: RunPlan
    comm: Collectives
    device: torch.device
    model: nn.Module
    net: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    objective: MCNObjective
    state: LoopState
    hooks: Hooks = field(default_factory=Hooks)
    checkpoints: CheckpointPolicy | None = None
    compile_clock: CompileClock | None = None

    def parts(self) -> dict[str, Any]:
        """What a checkpoint holds and restores, by name (``checkpoint.save/restore``)."""
        return {"model": self.net, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "objective": self.objective.cluster, "loop": self.state}
