"""The training loop, read top to bottom: [1] the epochs, [2] one epoch, [3] one step, [4] its
forward and backward, [5] the update, [6] what follows a step. No Ray.

``run_epochs`` and ``train_one_epoch`` return ``dict[str, float]``. What the loop runs on is in
``run.py`` (the run, its state, the caller's hooks); beside it: ``optim.py`` (optimizer, LR
schedule, precision), ``gradcache.py`` (the step in chunks), ``evaluate.py``,
``monitor/epoch_metrics.py`` (what an epoch accumulates, its metrics over the ranks) and
``checkpoints/policy.py`` (when to checkpoint inside an epoch). The Ray side (``on_ray/worker.py``)
only plugs data, the evaluation and the checkpoint's save and report into the run's hooks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from raymcn.config import Config, PermanentError, best_values
from raymcn.data.formats.batch import Batch
from raymcn.train import optim
from raymcn.train.feed import Prefetcher, to_device
from raymcn.train.gradcache import cached_step
from raymcn.train.monitor.epoch_metrics import TIMING_PHASES, EpochProgress, PhaseTimer, epoch_metrics, fold_progress
from raymcn.train.run import Run
from raymcn.train.stages import active_modalities, stage_of


class NonFiniteLossError(RuntimeError, PermanentError):
    """Raised when the loss or gradients stayed non-finite for too many consecutive steps."""


# --- [1] The epochs: each one's steps, evaluation, checkpoint and report --------------------------------
def run_epochs(run: Run) -> dict[str, float]:
    """Train from ``run.state`` (an epoch boundary, or inside an epoch after a mid-epoch
    checkpoint) to the plan's last epoch, with ``run.hooks``; returns the last epoch's metrics.

    Each epoch's metrics: the per-step means of every loss term and timing phase, averaged over the
    ranks (``bad_samples`` and ``videos_read`` summed), ``workers`` (the world size), with
    ``scale.compile`` the epoch's ``compiled_graphs`` and ``time_compile_s``, the evaluation's
    metrics with ``time_eval_s`` and each one's best over the epochs so far (``best_<metric>``,
    ``LoopState.best``), ``epoch`` (completed), ``global_step`` and ``budget_epoch`` (the sweep
    schedulers' clock).
    """
    plan, state, hooks = run.plan, run.state, run.hooks
    metrics: dict[str, float] = {}
    for epoch in range(state.epoch, plan.epochs):
        state.epoch = epoch
        start = state.step_in_epoch(plan.steps_per_epoch)  # > 0 only when resumed inside this epoch
        batches, stats = hooks.batches(run, epoch, start)
        # The next batches are fetched (and moved to the device) while the step runs.
        feed = Prefetcher(batches, run.device, depth=run.cfg.data.prefetch_batches,
                          stats=stats if hasattr(stats, "as_metrics") else None)
        try:
            metrics = train_one_epoch(run, feed, feed.stats)
        finally:
            feed.close()
        state.epoch = epoch + 1
        state.progress = EpochProgress()  # the epoch-end checkpoint holds no partial epoch
        metrics["workers"] = float(run.comm.world)  # an elastic group's size in this epoch
        if run.compile_clock is not None:  # this rank's compiling in the epoch (rank 0's is reported)
            metrics.update(run.compile_clock.lap())
        if hooks.evaluate is not None:
            hooks.watch("evaluation", state.step)
            started = time.perf_counter()
            metrics.update(hooks.evaluate(run))
            metrics["time_eval_s"] = time.perf_counter() - started  # the epoch's evaluation, wall seconds
        state.best = best_values(state.best, metrics)  # in the state the epoch's checkpoint holds
        metrics.update(state.best)
        metrics.update(epoch=float(state.epoch), global_step=float(state.step),
                       budget_epoch=float(plan.budget_epoch(state.epoch)))
        if hooks.log:
            hooks.log(f"epoch {state.epoch}/{plan.epochs} " + " ".join(
                f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith("text_to_video") or k == "total_loss"))
        if hooks.save is not None or hooks.after_epoch:
            hooks.watch("report", state.step)
        checkpoint(run, metrics)
        for hook in hooks.after_epoch:
            hook(run, metrics)
    return metrics


def checkpoint(run: Run, metrics: dict[str, float] | None) -> None:
    """A checkpoint of ``run`` (``hooks.save``): after an epoch with its ``metrics``, inside one
    (None) when ``run.checkpoints`` asks; either restarts the checkpoint clock."""
    if run.hooks.save is not None:
        run.hooks.save(run, metrics)
    if run.checkpoints is not None:
        run.checkpoints.done()


# --- [2] One epoch: its steps, then its metrics over every rank ------------------------------------------
def train_one_epoch(run: Run, batches: Iterable[Batch], data_stats: Any = None) -> dict[str, float]:
    """Run the rest of the current epoch (``run.state.epoch``) over ``batches``; returns the epoch's
    metrics over all its steps (``epoch_metrics``: per-step means of every ``*_loss`` term and
    phase time, ``samples_per_s``, the data counters) and ``lr`` and ``stage`` after its last step.

    Everything accumulates in ``run.state.progress`` (``EpochProgress``, checkpointed), so an
    epoch resumed after its step k reports what the uninterrupted epoch reports. The metrics are
    combined over ``run.comm``'s ranks (a collective at the epoch's end).

    Args:
        batches: this rank's batches (``raymcn.data.formats.batch.Batch``): video (b,4096), audio
            (b,40,T), nframes (b,), text (b,W,300), key; b = local videos × clips per video, video-major.
        data_stats: the epoch's data counters as they fill (``as_metrics()``), kept in
            ``run.state.progress`` after every step so a mid-epoch checkpoint holds them.

    Raises:
        NonFiniteLossError: more than ``cfg.optim.max_nonfinite_steps`` non-finite steps in a row.
    """
    run.model.train()
    epoch = _Epoch(run, data_stats)
    for batch in batches:
        batch = to_device(batch, run.device)
        values = train_step(run, epoch, batch)
        after_step(run, epoch, values, batch)
        run.hooks.watch("data", run.state.step)
    return epoch.finish()


class _Epoch:
    """What one epoch adds to the run on this rank: its phase timer, the trained parameters, the
    steps' gradient-caching chunk, the data counters already counted and the clock of the wait
    for its first batch."""

    def __init__(self, run: Run, data_stats: Any):
        self.run, self.data_stats = run, data_stats
        self.params = [p for p in run.model.parameters() if p.requires_grad]
        self.chunk_clips = cache_chunk(run.cfg, run.comm.world)
        self.counted: dict[str, float] = {}  # data counters already added to the progress in this attempt
        p = run.state.progress
        for phase in TIMING_PHASES:  # every phase on every rank (0 s when unused): ranks combine them by key
            p.add(f"time:{phase}", 0.0)
        self.timer = PhaseTimer(p, run.device)
        self.waiting = time.perf_counter()  # host clock: the wait for the epoch's first batch
        run.hooks.watch("data", run.state.step)

    def count_data(self) -> None:
        """The data counters' growth since the last call, into the progress."""
        for k, v in (self.data_stats.as_metrics() if self.data_stats is not None else {}).items():
            self.run.state.progress.add(f"count:{k}", v - self.counted.get(k, 0.0))
            self.counted[k] = v

    def finish(self) -> dict[str, float]:
        """The epoch's metrics (a collective over the ranks)."""
        run = self.run
        self.timer.settle(wait=True)
        self.count_data()  # the epoch's last counters (also when no step ran in this attempt)
        p = run.state.progress
        p.add("count:bad_samples", 0.0)  # reported even without data counters: never a silent drop
        metrics = epoch_metrics(p, run.comm, run.device)
        metrics.update(lr=float(run.optimizer.param_groups[0]["lr"]),
                       stage=float(stage_of(run.cfg.schedule.stage_order, run.state.step - 1, run.plan.switch_step)))
        return metrics


# --- [3] One step: forward and backward, the update, the bookkeeping ---------------------------------------
def train_step(run: Run, epoch: _Epoch, batch: Batch) -> dict[str, float]:
    """One training step on ``batch`` (already on the device); returns the step's loss terms."""
    state, hooks = run.state, run.hooks
    # Free last step's gradients before the forward: holding them through forward and loss
    # costs one copy of the parameters (0.9 GB at paper size; measured by bench/step.py).
    run.optimizer.zero_grad(set_to_none=True)
    active = active_modalities(run.cfg.schedule.stage_order, state.step, run.plan.switch_step)
    epoch.timer.lap("data")
    hooks.watch("step", state.step)
    if state.progress.first_batch_s is None:  # the epoch's first batch: Ray Data starts the epoch (its own metric)
        state.progress.first_batch_s = time.perf_counter() - epoch.waiting
    for hook in hooks.before_step:
        hook(run)
    terms = forward_backward(run, batch, active, epoch.chunk_clips, epoch.timer.lap)
    for hook in hooks.after_backward:
        hook(run, terms)
    values = update(run, epoch.params, terms)
    run.scheduler.step()
    state.step += 1
    epoch.timer.lap("optimizer")
    record(run, epoch, values, batch)
    return values


# --- [4] Forward and backward, in one piece or in chunks with cached gradients -----------------------------
def forward_backward(run: Run, batch: Batch, active: frozenset[str], chunk_clips: int,
                     lap: Callable[[str], None]) -> dict[str, torch.Tensor]:
    """Forward, objective and backward of one step of ``run`` (at ``run.state.step``); returns
    the loss terms. With ``chunk_clips`` > 0 the step runs with gradient caching in chunks of that
    many clips (:func:`raymcn.train.gradcache.cached_step`: the same terms and gradients, the
    activation memory of one chunk, a second forward per chunk timed as ``reforward``); with 0 in
    one piece. ``lap`` is called with each phase's name as it ends."""
    step = run.state.step
    if chunk_clips:
        return cached_step(run.model, run.objective, batch, active, step, chunk_clips,
                           forward_context=lambda: optim.autocast(run.device), lap=lap)
    with optim.autocast(run.device):
        out = run.model(batch, active)
    lap("forward")
    terms = run.objective(out, active, step)
    del out  # the embeddings and reconstructions are freed by the backward, not held through Adam
    lap("loss")
    terms["total_loss"].backward()  # DDP all-reduces gradients inside backward
    lap("backward")
    return terms


def cache_chunk(cfg: Config, world: int) -> int:
    """Clips per gradient-caching chunk of a step (``scale.grad_cache_clips``), 0 for the plain step.

    One decision for every rank, from the largest share any rank holds (⌈B/world⌉ videos): ranks
    whose shares differ (a batch that does not divide by the world) must take the same path, or
    each waits in collectives the others never call. A smaller share is then one chunk."""
    largest = -(-cfg.data.batch_size // world) * cfg.data.clips_per_video
    return cfg.scale.grad_cache_clips if 0 < cfg.scale.grad_cache_clips < largest else 0


# --- [5] The update, unless the step is non-finite ----------------------------------------------------------
def update(run: Run, params: list[torch.nn.Parameter], terms: dict[str, torch.Tensor]) -> dict[str, float]:
    """The optimizer step, unless the gradients are non-finite (skipped and counted; too many in
    a row end the run). Gradients are all-reduced, so every rank sees the same norm and takes the
    same decision. Returns the loss terms' values, read with the norm in the step's one host sync
    (:func:`read_values`)."""
    state = run.state
    norm = torch.nn.utils.clip_grad_norm_(params, run.cfg.optim.grad_clip or float("inf"))
    values, norm_value = read_values(terms, norm)
    if math.isfinite(norm_value):
        run.optimizer.step()
        state.nonfinite_streak = 0
        return values
    state.progress.skipped += 1
    state.nonfinite_streak += 1
    if run.hooks.log:
        run.hooks.log(f"non-finite loss/gradient at step {state.step} (skipped; {state.nonfinite_streak} in a row)")
    limit = run.cfg.optim.max_nonfinite_steps
    if state.nonfinite_streak > limit:
        raise NonFiniteLossError(
            f"loss or gradients non-finite for {state.nonfinite_streak} consecutive steps "
            f"(last at global step {state.step}, terms: {values}); optim.max_nonfinite_steps="
            f"{limit}. Lower optim.lr or check the input data.")
    return values


def read_values(terms: dict[str, torch.Tensor], norm: torch.Tensor) -> tuple[dict[str, float], float]:
    """The loss terms' values and the gradient norm, read in one host sync (the step's only one:
    on a GPU each read waits for every kernel queued before it, and the queue runs dry while the
    host then queues the next ones). float64 holds every fp32 value exactly."""
    read = torch.stack([norm.detach().double(), *(v.detach().double() for v in terms.values())]).tolist()
    return dict(zip(terms, read[1:])), read[0]


# --- [6] After a step: its bookkeeping, the caller's hooks, a checkpoint when due ---------------------------
def record(run: Run, epoch: _Epoch, values: dict[str, float], batch: Batch) -> None:
    """The step's terms, clips and data counters into the epoch's progress, and the log line."""
    state = run.state
    p = state.progress
    epoch.timer.settle()  # the phases whose events have completed (never waits)
    for k, v in values.items():  # every key on every rank: metrics are combined across ranks by key
        p.add(f"sum:{k}", v if math.isfinite(v) else 0.0)
    p.steps += 1
    p.add("clips", float(batch["video"].shape[0]))
    epoch.count_data()
    if run.hooks.log and (state.step % run.cfg.run.log_every == 0):
        run.hooks.log(_progress_line(run, values))


def after_step(run: Run, epoch: _Epoch, values: dict[str, float], batch: Batch) -> None:
    """The caller's ``after_step`` hooks, then a checkpoint when ``run.checkpoints`` says one is
    due (every rank asks after every step: the answer is the same on all); their time is the
    ``checkpoint`` phase. The epoch's sums so far are combined over the ranks first, in every run
    alike, so a resumed run does the same arithmetic as one never stopped."""
    hooks, state = run.hooks, run.state
    if not hooks.after_step and run.checkpoints is None:
        return
    hooks.watch("checkpoint", state.step)
    for hook in hooks.after_step:
        hook(run, values, batch)
    if run.checkpoints is not None and run.checkpoints.due(state.step):
        fold_progress(state.progress, run.comm, run.device)
        checkpoint(run, None)
    epoch.timer.lap("checkpoint")


def _progress_line(run: Run, values: dict[str, float]) -> str:
    state, p = run.state, run.state.progress
    terms = " ".join(f"{k.removesuffix('_loss')}={v:.4g}" for k, v in values.items() if k != "total_loss")
    seconds = sum(v for k, v in p.live.items() if k.startswith("time:"))
    stage = stage_of(run.cfg.schedule.stage_order, state.step - 1, run.plan.switch_step)
    return (f"epoch {state.epoch + 1} step {state.step}/{run.plan.total_steps} stage {stage} "
            f"loss={values['total_loss']:.4g} [{terms}] {p.live.get('clips', 0.0) / max(seconds, 1e-9):.1f} clips/s")
