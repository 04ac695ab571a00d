"""The training loop: the run (:class:`Run`, one object from its assembly to every step), what a
caller plugs into it (:class:`Hooks`), optimizer, LR schedule, one epoch, the step, evaluation. No Ray.

``train_one_epoch`` and ``evaluate`` return ``dict[str, float]``; the Ray side (``worker.py``)
only wires the run's hooks to data, checkpoints and ``ray.train.report``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from raymcn.collectives import Collectives
from raymcn.config import RETRIEVAL_METRICS, Config, PermanentError
from raymcn.losses import MCNObjective
from raymcn.train.feed import to_device
from raymcn.train.gradcache import cached_step
from raymcn.train.metrics import ranks_of_matches, retrieval_metrics
from raymcn.train.run_plan import RunPlan
from raymcn.train.run_plan import warmup_steps as planned_warmup
from raymcn.train.stages import active_modalities, stage_of

# "reforward": gradient caching's second forward of each chunk (scale.grad_cache_clips; 0 s when off);
# "checkpoint": the step loop's stall for mid-epoch checkpoints and progress marks (after_step)
TIMING_PHASES = ("data", "forward", "loss", "backward", "reforward", "optimizer", "checkpoint")


class NonFiniteLossError(RuntimeError, PermanentError):
    """Raised when the loss or gradients stayed non-finite for too many consecutive steps."""


@dataclass
class EpochProgress:
    """What the epoch in progress has accumulated. Checkpointed with the loop state, so an epoch
    resumed in its middle (on as many ranks or on others) reports the per-epoch means of the
    uninterrupted one.

    Values are keyed ``sum:<term>`` (the loss term summed over finite steps), ``time:<phase>``
    (seconds), ``clips`` and ``count:<counter>`` (``bad_samples``, ``videos_read``). ``live`` is
    this rank's since the last fold; ``folded`` is combined over the ranks (identical on every rank,
    so rank 0's checkpoint holds it for all): the ranks' mean for sums, times and clips (a loss term
    is each rank's share, its mean over ranks the full batch's value), their total for counts.
    :func:`fold_progress` moves ``live`` into ``folded`` before a mid-epoch checkpoint, in every run
    alike, so a resumed run does the same arithmetic as one that was never stopped.

    Attributes:
        steps, skipped: steps run in the epoch and non-finite steps skipped (equal on every rank).
        first_batch_s: this rank's wait for the epoch's first batch.
    """

    steps: int = 0
    skipped: int = 0
    first_batch_s: float | None = None
    folded: dict[str, float] = field(default_factory=dict)
    live: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.live[key] = self.live.get(key, 0.0) + value


def _combined(progress: EpochProgress, comm: Collectives, device: torch.device) -> dict[str, float]:
    """``folded`` + the ranks' ``live`` combined (a collective: every rank calls it with the same keys)."""
    keys = sorted(set(progress.live) | set(progress.folded))
    live = torch.tensor([progress.live.get(k, 0.0) for k in keys], dtype=torch.float64, device=device)
    mean = comm.all_reduce_mean(live).tolist() if keys else []
    return {k: progress.folded.get(k, 0.0) + (m * comm.world if k.startswith("count:") else m)
            for k, m in zip(keys, mean)}


def fold_progress(progress: EpochProgress, comm: Collectives, device: torch.device) -> None:
    """Combine every rank's ``live`` values into ``folded`` (collective; before a mid-epoch checkpoint)."""
    progress.folded = _combined(progress, comm, device)
    progress.live = {}


def epoch_metrics(progress: EpochProgress, comm: Collectives, device: torch.device) -> dict[str, float]:
    """The epoch's metrics over all its steps and ranks (collective): per-step means of each loss
    term and phase time, ``samples_per_s`` (per worker), ``time_first_batch_s`` (ranks' mean),
    ``time_epoch_s`` and the data counters summed over ranks."""
    progress.add("wait:first_batch", progress.first_batch_s or 0.0)
    total = _combined(progress, comm, device)
    steps = max(1, progress.steps)
    out = {k[4:]: v / max(1, progress.steps - progress.skipped) for k, v in total.items() if k.startswith("sum:")}
    out.update({f"time_{k[5:]}_s": v / steps for k, v in total.items() if k.startswith("time:")})
    elapsed = max(sum(v for k, v in total.items() if k.startswith("time:")), 1e-9)
    out.update({k[6:]: float(round(v)) for k, v in total.items() if k.startswith("count:")})
    out.update(time_first_batch_s=total.get("wait:first_batch", 0.0), time_epoch_s=elapsed,
               samples_per_s=total.get("clips", 0.0) / elapsed, steps=float(progress.steps),
               skipped_steps=float(progress.skipped))
    return out


@dataclass
class LoopState:
    """Counters that must survive a resume (checkpointed with the model): the data position is
    (epoch, step), and the data order is a function of it alone (``data/read/order.py``)."""

    step: int = 0  # next global step
    epoch: int = 0  # the epoch in progress (or next, between epochs)
    nonfinite_streak: int = 0
    skipped_steps: int = 0
    progress: EpochProgress = field(default_factory=EpochProgress)

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "nonfinite_streak": self.nonfinite_streak,
                "skipped_steps": self.skipped_steps, "progress": asdict(self.progress)}

    def load_state_dict(self, d: dict) -> None:
        for k in ("step", "epoch", "nonfinite_streak", "skipped_steps"):
            setattr(self, k, int(d[k]))
        # checkpoints written before mid-epoch checkpoints existed hold no progress (epoch ends only)
        self.progress = EpochProgress(**d.get("progress", {}))

    def step_in_epoch(self, steps_per_epoch: int) -> int:
        """The next step's index within the current epoch (0 between epochs)."""
        return self.step - self.epoch * steps_per_epoch


def autocast(device: torch.device):
    """bf16 autocast on GPU (no GradScaler needed for bf16); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def apply_precision(cfg: Config) -> None:
    """The process's precision policy: process-wide torch flags, set once at a rank's start (the
    Ray worker, the step probe, a benchmark's rank), never by the run's assembly.

    * The model's forward runs under :func:`autocast` (bf16 on GPU); the losses, k-means and the
      retrieval scores compute in fp32 (they disable autocast themselves).
    * Those fp32 matrix products use ``scale.matmul_precision``: ``"highest"`` = true fp32 (TF32
      off for matmuls and for cuDNN), ``"high"`` = TF32 allowed on Ampere and later GPUs (the
      default argued in ``config/sections.py`` and docs/memory.md).
    * ``cudnn.benchmark`` on: a run's convolutions see few shapes (a share of ⌊B/N⌋ or ⌈B/N⌉ videos,
      gradient-caching chunks, the evaluation), so each is tuned once and reused for the whole run.
      The price on CUDA: each process picks its algorithms by timing them, and some of cuDNN's use
      atomics, so a restarted attempt's convolutions may round differently from the attempt it
      replaces; GPU runs are therefore reproducible to rounding, not bitwise (on CPU they are,
      docs/development.md, "Equal on any x86-64 CPU").
    """
    torch.set_float32_matmul_precision(cfg.scale.matmul_precision)  # also sets cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = cfg.scale.matmul_precision != "highest"
    torch.backends.cudnn.benchmark = True


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up from 0 to 1, then a half cosine to 0 at ``total_steps`` (clamped there).

    Defined over the *global* step, so a resumed run continues the same curve.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config, total_steps: int, warmup_steps: int | None = None):
    """The LR schedule of a run: :func:`lr_factor` over the global step. ``warmup_steps`` is the
    run plan's (``plan.warmup_steps``); None derives it from ``cfg`` the same way."""
    if warmup_steps is None:
        warmup_steps = planned_warmup(cfg)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup_steps, total_steps))


class PhaseTimer:
    """Seconds of each phase of the step, added to ``progress`` as ``time:<phase>``, without
    synchronising the device.

    On CPU a lap is a ``perf_counter`` reading. On CUDA it is an event recorded on the compute
    stream (kernels are queued ahead of their execution, so the host's clock would bill them to the
    wrong phase, and a ``cuda.synchronize`` per phase would stop the host from queueing the next
    phase's kernels): a phase's time is the GPU-side time between its two events. Events are read
    by :meth:`settle` once they have completed (``query``, which never waits; the loop calls it
    after every step, and the events still running then are read at a later step). The ``data``
    phase is then the time the device waited for the next batch.
    """

    def __init__(self, progress: EpochProgress, device: torch.device):
        self.progress, self.device = progress, device
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[str, Any, Any]] = []  # (phase, start event, end event), CUDA only
        self.last = self._mark()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def lap(self, phase: str) -> None:
        """The phase that started at the last lap ends now."""
        now = self._mark()
        if self.cuda:
            self.pending.append((phase, self.last, now))
        else:
            self.progress.add(f"time:{phase}", now - self.last)
        self.last = now

    def settle(self, wait: bool = False) -> None:
        """Add the times of the phases whose events have completed (``wait``: all, synchronising on the last)."""
        if wait and self.pending:
            self.pending[-1][2].synchronize()
        open_ = []
        for phase, start, end in self.pending:
            if wait or end.query():
                self.progress.add(f"time:{phase}", start.elapsed_time(end) / 1000.0)
            else:
                open_.append((phase, start, end))
        self.pending = open_


def _no_watch(phase: str, step: int) -> None:
    pass


@dataclass
class Hooks:
    """What a caller plugs into a run: each hook is called with the run, and none is required but
    ``batches`` (for :func:`raymcn.train.build.run_epochs`).

    Attributes:
        batches: (run, epoch, first in-epoch step) -> (this rank's batches of that epoch from that
            step on, its data counters or None); the counters' ``as_metrics()`` (``bad_samples``,
            ``videos_read``) are reported, summed over ranks.
        evaluate: run -> retrieval metrics after each epoch (its wall time is ``time_eval_s``).
        before_step: run -> None before each step's compute, in order (fault injection,
            ``faults.install``, adds its hooks here only when a fault is asked for).
        after_backward: (run, the step's loss terms) -> None after its backward, before the
            update, in order (fault injection: a non-finite step).
        after_step: (run, the step's loss terms, its batch) -> None after each step, in order
            (mid-epoch checkpoints, progress lines, the step trace); their time is the
            ``checkpoint`` phase.
        after_epoch: (run, the epoch's metrics) -> None after each epoch, in order (checkpoint
            and report, a Tune report, fault injection).
        log: progress lines (rank 0 passes print).
        watch: (phase, global step) -> None as each phase starts: ``"data"`` (waiting for the
            batch), ``"step"`` (compute and collectives), ``"checkpoint"`` (the ``after_step``
            hooks), ``"evaluation"``, ``"report"`` (``watchdog.Watchdog.at``).
    """

    batches: Callable[[Run, int, int], tuple[Iterable[dict], Any]] | None = None
    evaluate: Callable[[Run], dict[str, float]] | None = None
    before_step: list[Callable[[Run], None]] = field(default_factory=list)
    after_backward: list[Callable[[Run, dict[str, torch.Tensor]], None]] = field(default_factory=list)
    after_step: list[Callable[[Run, dict[str, float], dict], None]] = field(default_factory=list)
    after_epoch: list[Callable[[Run, dict[str, float]], None]] = field(default_factory=list)
    log: Callable[[str], None] | None = None
    watch: Callable[[str, int], None] = _no_watch


@dataclass
class Run:
    """One rank's training run: built once (``build.assemble``) and carried whole through the
    epochs (``build.run_epochs``), the epoch (:func:`train_one_epoch`) and the step
    (:func:`forward_backward`).

    Attributes:
        model: what the loop trains (the DDP wrapper on several ranks); net: the bare MCN
            (checkpoints and evaluation use it).
        comm: this rank's collectives (rank and world): the objective's gathers and the metric means.
        state: what the loop has done (checkpointed).
        hooks: what the caller plugged in (:class:`Hooks`).
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

    def parts(self) -> dict[str, Any]:
        """What a checkpoint holds and restores, by name (``checkpoint.save/restore``)."""
        return {"model": self.net, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "objective": self.objective.cluster, "loop": self.state}


def train_one_epoch(run: Run, batches: Iterable[dict], data_stats: Any = None) -> dict[str, float]:
    """Run the rest of the current epoch (``run.state.epoch``) over ``batches``; returns the epoch's
    metrics over all its steps (:func:`epoch_metrics`: per-step means of every ``*_loss`` term and
    phase time, ``samples_per_s``, the data counters) and ``lr`` and ``stage`` after its last step.

    Everything accumulates in ``run.state.progress`` (:class:`EpochProgress`, checkpointed), so an
    epoch resumed after its step k reports what the uninterrupted epoch reports. The metrics are
    combined over ``run.comm``'s ranks (a collective at the epoch's end).

    Args:
        batches: dicts following the batch contract (video (b,4096), audio (b,40,T), nframes (b,),
            text (b,W,300), key); b = local videos × clips per video, video-major.
        data_stats: the epoch's data counters as they fill (``as_metrics()``), kept in
            ``run.state.progress`` after every step so a mid-epoch checkpoint holds them.

    Raises:
        NonFiniteLossError: more than ``cfg.optim.max_nonfinite_steps`` non-finite steps in a row.
    """
    run.model.train()
    epoch = _Epoch(run, data_stats)
    watch, after_step = run.hooks.watch, run.hooks.after_step
    for batch in batches:
        batch = to_device(batch, run.device)
        values = epoch.step(batch)
        if after_step:
            watch("checkpoint", run.state.step)
            for hook in after_step:
                hook(run, values, batch)
            epoch.timer.lap("checkpoint")
        watch("data", run.state.step)
    return epoch.finish()


class _Epoch:
    """One epoch's steps on one rank (:func:`train_one_epoch`): the run, what the epoch adds to it
    (its phase timer, the data counters already counted, the trained parameters and the step's
    gradient-caching chunk), and the step, the update and the bookkeeping as named pieces."""

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

    def step(self, batch: dict) -> dict[str, float]:
        """One training step on ``batch``: forward, loss, backward, the update, the bookkeeping;
        returns the step's loss terms."""
        run, state = self.run, self.run.state
        p = state.progress
        # Free last step's gradients before the forward: holding them through forward and loss
        # costs one copy of the parameters (0.9 GB at paper size; measured by bench/step.py).
        run.optimizer.zero_grad(set_to_none=True)
        active = active_modalities(run.cfg.schedule.stage_order, state.step, run.plan.switch_step)
        self.timer.lap("data")
        run.hooks.watch("step", state.step)
        if p.first_batch_s is None:  # the epoch's first batch: Ray Data starts the epoch (its own metric)
            p.first_batch_s = time.perf_counter() - self.waiting
        for hook in run.hooks.before_step:
            hook(run)
        terms = forward_backward(run, batch, active, self.chunk_clips, self.timer.lap)
        for hook in run.hooks.after_backward:
            hook(run, terms)
        values = self.update(terms)
        run.scheduler.step()
        state.step += 1
        self.timer.lap("optimizer")
        self.record(values, batch)
        return values

    def update(self, terms: dict[str, torch.Tensor]) -> dict[str, float]:
        """The optimizer step, unless the gradients are non-finite (skipped and counted; too many in
        a row end the run). Gradients are all-reduced, so every rank sees the same norm and takes
        the same decision. Returns the loss terms' values, read with the norm in the step's one
        host sync (:func:`read_values`)."""
        run, state = self.run, self.run.state
        norm = torch.nn.utils.clip_grad_norm_(self.params, run.cfg.optim.grad_clip or float("inf"))
        values, norm_value = read_values(terms, norm)
        if math.isfinite(norm_value):
            run.optimizer.step()
            state.nonfinite_streak = 0
            return values
        state.progress.skipped += 1
        state.skipped_steps += 1
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

    def record(self, values: dict[str, float], batch: dict) -> None:
        """The step's terms, clips and data counters into the epoch's progress, and the log line."""
        run, state = self.run, self.run.state
        p = state.progress
        self.timer.settle()  # the phases whose events have completed (never waits)
        for k, v in values.items():  # every key on every rank: metrics are combined across ranks by key
            p.add(f"sum:{k}", v if math.isfinite(v) else 0.0)
        p.steps += 1
        p.add("clips", float(batch["video"].shape[0]))
        self.count_data()
        if run.hooks.log and (state.step % run.cfg.run.log_every == 0):
            run.hooks.log(_progress_line(run, values))

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


def read_values(terms: dict[str, torch.Tensor], norm: torch.Tensor) -> tuple[dict[str, float], float]:
    """The loss terms' values and the gradient norm, read in one host sync (the step's only one:
    on a GPU each read waits for every kernel queued before it, and the queue runs dry while the
    host then queues the next ones). float64 holds every fp32 value exactly."""
    read = torch.stack([norm.detach().double(), *(v.detach().double() for v in terms.values())]).tolist()
    return dict(zip(terms, read[1:])), read[0]


def cache_chunk(cfg: Config, world: int) -> int:
    """Clips per gradient-caching chunk of a step (``scale.grad_cache_clips``), 0 for the plain step.

    One decision for every rank, from the largest share any rank holds (⌈B/world⌉ videos): ranks
    whose shares differ (a batch that does not divide by the world) must take the same path, or
    each waits in collectives the others never call. A smaller share is then one chunk."""
    largest = -(-cfg.data.batch_size // world) * cfg.data.clips_per_video
    return cfg.scale.grad_cache_clips if 0 < cfg.scale.grad_cache_clips < largest else 0


def forward_backward(run: Run, batch: dict, active: frozenset[str], chunk_clips: int,
                     lap: Callable[[str], None]) -> dict[str, torch.Tensor]:
    """Forward, objective and backward of one step of ``run`` (at ``run.state.step``); returns
    the loss terms. With ``chunk_clips`` > 0 the step runs with gradient caching in chunks of that
    many clips (:func:`raymcn.train.gradcache.cached_step`: the same terms and gradients, the
    activation memory of one chunk, a second forward per chunk timed as ``reforward``); with 0 in
    one piece. ``lap`` is called with each phase's name as it ends."""
    step = run.state.step
    if chunk_clips:
        return cached_step(run.model, run.objective, batch, active, step, chunk_clips,
                           forward_context=lambda: autocast(run.device), lap=lap)
    with autocast(run.device):
        out = run.model(batch, active)
    lap("forward")
    terms = run.objective(out, active, step)
    del out  # the embeddings and reconstructions are freed by the backward, not held through Adam
    lap("loss")
    terms["total_loss"].backward()  # DDP all-reduces gradients inside backward
    lap("backward")
    return terms


def _progress_line(run: Run, values: dict[str, float]) -> str:
    state, p = run.state, run.state.progress
    terms = " ".join(f"{k.removesuffix('_loss')}={v:.4g}" for k, v in values.items() if k != "total_loss")
    seconds = sum(v for k, v in p.live.items() if k.startswith("time:"))
    stage = stage_of(run.cfg.schedule.stage_order, state.step - 1, run.plan.switch_step)
    return (f"epoch {state.epoch + 1} step {state.step}/{run.plan.total_steps} stage {stage} "
            f"loss={values['total_loss']:.4g} [{terms}] {p.live.get('clips', 0.0) / max(seconds, 1e-9):.1f} clips/s")


@torch.no_grad()
def evaluate(model: nn.Module, eval_set, device: torch.device, chunk: int = 256,
             comm: Collectives | None = None) -> dict[str, float]:
    """Text-to-video retrieval on ``eval_set`` with all three branches; restores train mode after.

    With ``comm`` of several ranks the set is embedded sharded (:func:`embed_eval_set`), rank 0
    scores the whole set and broadcasts the metrics: each clip is embedded once instead of once per
    rank, and the metrics are those of one process scoring everything with rank 0's model (the one
    the epoch's checkpoint holds). Every rank must call it (collectives).

    Args:
        eval_set: object with arrays or tensors ``video`` (N,4096), ``audio`` (N,40,T),
            ``nframes`` (N,), ``text`` (N,W,300) and ``num_queries_total`` (R@K denominator).
        chunk: clips embedded at a time.
        comm: this rank's collectives (default: one process).
    """
    comm = comm or Collectives()
    everyone = embed_eval_set(model, eval_set, device, chunk, comm)
    n = everyone.shape[0]
    total = float(getattr(eval_set, "num_queries_total", None) or n)
    keys = [*RETRIEVAL_METRICS, "eval_size"]
    values = torch.zeros(len(keys), dtype=torch.float64, device=device)
    if comm.rank == 0:
        metrics = retrieval_metrics(ranks_of_matches(everyone[:, 0], everyone[:, 1]), int(total))
        metrics["eval_size"] = total
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
    return dict(zip(keys, comm.broadcast_from_rank0(values).tolist()))


@torch.no_grad()
def embed_eval_set(model: nn.Module, eval_set, device: torch.device, chunk: int = 256,
                   comm: Collectives | None = None) -> torch.Tensor:
    """Every clip of ``eval_set`` embedded by one model, in eval mode (train mode restored after):
    (N, 2, D) fp32, [:, 0] the text and [:, 1] the gallery (video + audio), in the set's order.

    With ``comm`` of several ranks each rank embeds its contiguous share of the clips (⌈N/world⌉,
    the last rank fewer) and the shares are all-gathered. One model on every rank: the ranks'
    buffers (BatchNorm's running statistics) are first made rank 0's. DDP copies rank 0's buffers to
    every rank before each forward and each rank then updates its own from its share, so after an
    epoch's last step they differ; scored with its own, each rank's share would come from another
    model, and the metrics would depend on the world size. The next training forward copies rank
    0's again, so training is unchanged."""
    net = getattr(model, "module", model)  # bypass DDP: evaluation needs no gradient sync
    comm = comm or Collectives()
    for buffer in net.buffers():
        comm.broadcast_from_rank0(buffer)
    was_training = net.training
    net.eval()
    try:
        n = eval_set.video.shape[0]
        start, end = comm.share(n)
        rows = torch.empty(end - start, 2, net.cfg.embed_dim, dtype=torch.float32, device=device)  # (text, gallery)
        for s in range(start, end, chunk):
            sl = slice(s, min(s + chunk, end))
            batch = to_device({k: torch.as_tensor(getattr(eval_set, k)[sl])
                               for k in ("video", "audio", "nframes", "text")}, device)
            with autocast(device):
                out = net.encode(batch)  # all three branches, no reconstruction heads
            rows[s - start:sl.stop - start, 0] = out["text"].float()
            rows[s - start:sl.stop - start, 1] = out["video"].float() + out["audio"].float()
        return comm.all_gather(rows, sizes=comm.share_sizes(n))  # (N, 2, D): every clip once, in order
    finally:
        net.train(was_training)
