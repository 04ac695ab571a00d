"""Run and sweep configuration: one frozen dataclass per concern, built from YAML + dotted overrides.

Owns every setting name (``optim.lr``, ``data.batch_size`` ...), the metric names, and the checks
that must fail *before* Ray starts. Imports nothing from the rest of raymcn.

A run YAML and a sweep YAML are one format: a sweep file adds a ``sweep:`` section on top of the
run keys. Every problem found is collected and reported in one :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tempfile
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# --- names declared once -------------------------------------------------------------------------
MODALITIES = ("video", "audio", "text")
STAGE_ORDERS = ("AV_T", "VT_A", "AT_V", "joint")
SEARCH_ALGORITHMS = ("bohb", "asha", "optuna", "random", "grid")
METRIC_PREFIX = "text_to_video"
RETRIEVAL_METRICS = tuple(f"{METRIC_PREFIX}_{m}" for m in ("R@1", "R@5", "R@10", "MedR"))
PRIMARY_METRIC = f"{METRIC_PREFIX}_R@10"
PRIMARY_MODE = "max"
TRACKERS = ("mlflow", "wandb", "tensorboard")  # run.trackers
SEARCH_DOMAINS = ("loguniform", "uniform", "choice", "randint", "grid")
EVAL_SET_KINDS = ("synthetic", "youcook", "msrvtt")
RUN_CONFIG_FILE = "raymcn_config.yaml"  # the resolved config beside a run's checkpoints or an imported checkpoint
SWEEP_CONFIG_FILE = "raymcn_sweep.yaml"  # the resolved base config in a sweep's folder
CONFIRM_DIR = "confirm"  # in a sweep's folder: the confirmation phase's own Tune experiment (sweep.confirm)
CONFIRM_PLAN_FILE = "confirm_plan.yaml"  # in CONFIRM_DIR: what is confirmed and why, written before its first trial
TRIAL_ERRORS_DIR = "raymcn_trial_errors"  # in a sweep's folder: <trial id>.txt for a trial ended by a permanent error
CONSOLE_LOG_FILE = "raymcn_console.log"  # in a run's or sweep's folder: everything Ray printed (train/monitor/console.py)
PROGRESS_FILE = "raymcn_progress.json"  # in a run's folder: rank 0's latest in-epoch progress (train/monitor/in_epoch.py)
METRICS_FILE = "metrics.csv"  # in a run's folder: one row per epoch of every reported metric (train/monitor/history.py)
# In a sweep's folder, written by raymcn, never by Tune: a ".json" name there would be replaced by
# the driver's older copy when a restored sweep's Tune uploads what it synced down at the restore.
DECISIONS_FILE = "raymcn_decisions.jsonl"  # what an early-stopping scheduler decided, and when
# Every trial's status as a Tune run of the sweep ended: Tune's own saved state still calls a trial
# that HyperBand stopped while it was paused PAUSED.
TRIAL_STATUS_FILE = "raymcn_trial_status.jsonl"
# In a machine's temp folder: <pid> for each Ray Train worker there whose drain checkpoint is registered,
# JSON {"step", "rank", "time"} (train/drain.py writes it; `raymcn drain` reads it to reboot then,
# not at the deadline)
DRAIN_MARKS_DIR = "raymcn-drained"
MID_EPOCH_KEY = "mid_epoch"  # in the metrics of a mid-epoch checkpoint's report; such reports are not Tune results
# The process group's timeout (run.collective_timeout_s) against the watchdogs' limit (run.stall_timeout_s):
# its default, and the least it may be, in multiples of the watchdogs' limit (docs/faults.md, "Stalls")
COLLECTIVE_TIMEOUT_FACTOR = 2
COLLECTIVE_TIMEOUT_MIN_FACTOR = 1.5


def reason(error: BaseException) -> str:
    """What a user is shown of ``error``: its class and the first line of its message (a Ray task's
    error, ``RayTaskError(RuntimeError)``, is named by the class of the error inside it), never a
    guess at the cause."""
    cause = getattr(error, "cause", None) if type(error).__name__.startswith("RayTaskError") else None
    shown = cause if isinstance(cause, BaseException) else error
    lines = [line.strip() for line in str(shown).strip().splitlines() if line.strip()]
    return f"{type(shown).__name__}: {lines[0]}" if lines else type(shown).__name__


class PermanentError(Exception):
    """An error a restart from the last checkpoint cannot cure: a bad setting, a missing or damaged
    input, a diverged loss. Such a run fails at once instead of being retried
    ``scale.max_failures`` times (``launch.FailFastOnPermanentErrors``); a sweep trial that hits one
    ends as errored without a retry. Lost processes and nodes are not permanent: they are retried."""


def permanent_cause(error: BaseException | None) -> BaseException | None:
    """The :class:`PermanentError` (or ``FileNotFoundError``) that caused ``error``, if any.

    Follows ``__cause__``/``__context__`` and the ``cause`` Ray's task and Train errors carry, so it
    finds a worker's error inside what the Train controller or Tune hands on.
    """
    stack, seen = [error], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (PermanentError, FileNotFoundError)):
            return e
        stack += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return None


class RayUnavailable(RuntimeError):
    """Ray could not be started or reached (``train/on_ray/cluster.py``): the command ran nothing;
    the message says which instance, why that one, what failed and what to do."""


class NodeInputError(Exception):
    """An error about what a node reads or runs with (its shards, samples, eval set, config), one
    ``raymcn doctor`` checks on every node before a sweep (:func:`doctor_hint`)."""


def doctor_hint(cause: BaseException) -> str:
    """A pointer to ``raymcn doctor`` when ``cause`` is one it checks on every node before a sweep
    (a missing or unreadable file or mount, another node's software); "" otherwise."""
    if isinstance(cause, (OSError, ImportError, NodeInputError)):
        return ("`raymcn doctor --config ...` checks every node's shards, eval set, word vectors, storage and "
                "versions before a sweep")
    return ""


class ConfigError(ValueError, PermanentError, NodeInputError):
    """A configuration problem; the message lists every problem found, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(self.problems))


# --- sections --------------------------------------------------------------------------------------
def setting(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None, choices: tuple | None = None, check: Any = None, why: str = "") -> Any:
    """A config field with its bounds declared where it is defined (read by :func:`field_problems`).

    ``ge``/``gt``/``le``/``lt`` bound a number, ``choices`` lists the allowed values, ``check`` is a
    predicate with ``why`` as its message. Adding a setting is one line.
    """
    meta = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices, check=check, why=why).items()
            if v not in (None, "")}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def _five_widths(v: tuple[int, ...]) -> bool:
    return len(v) == 5 and all(c >= 1 for c in v)


Workers = int | tuple[int, int]  # a fixed count, or an elastic (min, max) range

_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_interval(text: str) -> tuple[str, float] | None:
    """``run.checkpoint_every``: ``"500"`` -> ("steps", 500), ``"30m"`` -> ("seconds", 1800), ``"2h"``,
    ``"90s"``; ``"0"`` or ``""`` -> None (checkpoints at epoch ends only). Raises ValueError."""
    text = str(text).strip().lower()
    if text in ("", "0"):
        return None
    if text[-1] in _DURATION_UNITS:
        value = float(text[:-1])
        if not (math.isfinite(value) and value > 0):
            raise ValueError(text)
        return "seconds", value * _DURATION_UNITS[text[-1]]
    steps = int(text)
    if steps < 0:
        raise ValueError(text)
    return ("steps", float(steps)) if steps else None


def _interval_ok(text: str) -> bool:
    try:
        parse_interval(text)
    except ValueError:
        return False
    return True


def _workers_ok(v: Workers) -> bool:
    if isinstance(v, tuple):
        return len(v) == 2 and 1 <= v[0] <= v[1]
    return v >= 0


@dataclass(frozen=True)
class DataConfig:
    batch_size: int = setting(128, ge=1)  # videos per optimizer step, global (shared by the workers)
    clips_per_video: int = setting(32, ge=1)  # n_pair: clips drawn from each video per step
    min_time: float = setting(10.0, ge=0)  # captions are merged until a clip spans at least this many seconds
    audio_frames: int = setting(1000, ge=1)  # spectrogram frames per training clip (100 frames/s)
    max_words: int = setting(20, ge=1)  # tokens per caption
    # Batches fetched ahead of the step in a background thread (on CUDA also pinned and copied to
    # the GPU on a side stream), so the step does not wait for its data; 0 = fetched in the step.
    prefetch_batches: int = setting(1, ge=0, le=8)
    shards: str = ""  # directory of tar shards (~ allowed); "" = the synthetic corpus (generated once, cached)
    eval_set: str = "synthetic"  # synthetic | youcook:FILE | msrvtt:FILE
    word_vectors: str = ""  # word2vec .bin for eval captions; "" = the shards' vocabulary
    eval_audio_frames: int = setting(0, ge=0)  # 0 = the length the eval set prescribes (YouCook2 5120, MSR-VTT 3072)
    cache_dir: str = ""  # "" = $RAYMCN_CACHE or ~/.cache/raymcn
    synthetic_videos: int = setting(256, ge=1)  # size of the synthetic training corpus
    synthetic_eval_clips: int = setting(256, ge=1)  # size of the held-out synthetic evaluation split
    synthetic_topics: int = setting(8, ge=1)  # latent topics of the synthetic corpus (what retrieval can learn)


@dataclass(frozen=True)
class ModelConfig:
    video_dim: int = setting(4096, ge=1)  # 2048 (2D ResNet-152) + 2048 (3D ResNeXt-101)
    word_dim: int = setting(300, ge=1)  # word2vec GoogleNews
    embed_dim: int = setting(6144, ge=1)  # the shared space
    audio_channels: tuple[int, ...] = setting((128, 128, 256, 512, 1024), check=_five_widths,  # conv1, layer1..4
                                              why="needs 5 positive widths (conv1, layer1..layer4)")
    audio_blocks: int = setting(2, ge=1)  # residual blocks per DAVEnet layer
    mel_bins: int = setting(40, ge=1)  # log-mel bins of the spectrogram
    recon: bool = True  # build the reconstruction heads
    recon_hidden: int = setting(1024, ge=1)  # hidden width of each reconstruction head
    # SyncBatchNorm in DAVEnet: batch statistics over the global batch, so the forward does not depend
    # on how many workers share it (false keeps per-rank statistics, as DataParallel had)
    sync_batchnorm: bool = False


@dataclass(frozen=True)
class LossConfig:
    margin: float = setting(0.001, ge=0)  # subtracted from the target logit (MMS diagonal, cluster CE target)
    num_clusters: int = setting(256, ge=1)  # K of the cosine k-means
    queue_steps: int = setting(20, ge=1)  # queue length in steps' worth of rows
    queue_clip_fraction: float = setting(0.5, gt=0, le=1)  # share of each video's clips pushed per step
    refresh_every: int = setting(20, ge=1)  # steps between full k-means refits (independent of the queue length)
    kmeans_iters: int = setting(100, ge=1)  # Lloyd iterations of a refit at most
    kmeans_tol: float = setting(1e-4, ge=0)  # a refit stops once the centroids move less (sum of squared shifts)
    queue_dtype: str = setting("float32", choices=("float32", "bfloat16"))  # bfloat16 halves the queue's memory
    cluster_weight: float = setting(1.0, ge=0)  # weight of the clustering term in the total loss
    cluster_on: str = setting("modalities", choices=("modalities", "fused"))  # mean of CE(v), CE(a), CE(t) | CE(mean)
    recon_weight: float = setting(50.0, ge=0)  # weight of the reconstruction term (the paper's 50)
    detach_recon_targets: bool = False  # the original lets gradient flow into audio/text targets


@dataclass(frozen=True)
class OptimConfig:
    lr: float = setting(1e-4, gt=0)  # Adam's peak learning rate (after the warm-up, then a half cosine to 0)
    # Warm-up length in videos seen (all ranks together): the run warms up for
    # ceil(warmup_videos / data.batch_size) steps, so runs at different batch sizes end their warm-up
    # after the same share of an epoch, and a sweep's rungs compare them at the same point of the
    # LR schedule. 640 000 = the paper's 5000 steps at its batch of 128 videos.
    warmup_videos: int = setting(640_000, ge=0)
    warmup_steps: int = setting(0, ge=0)  # > 0: a fixed step count instead, whatever the batch
    weight_decay: float = setting(0.0, ge=0)  # Adam's L2 penalty
    grad_clip: float = setting(0.0, ge=0)  # 0 = off
    max_nonfinite_steps: int = setting(3, ge=0)  # consecutive non-finite steps skipped before the run stops


@dataclass(frozen=True)
class ScheduleConfig:
    epochs: int = setting(30, ge=1)  # passes over the training corpus
    stage_order: str = setting("joint", choices=STAGE_ORDERS)  # modalities per stage: AV_T = audio+video, then text too
    stage1_fraction: float = setting(0.5, ge=0, lt=1)  # share of the run's steps spent in stage 1 (0: no stage 1)
    steps_per_epoch: int = setting(0, ge=0)  # 0 = videos // batch_size


@dataclass(frozen=True)
class ScaleConfig:
    # Ray Train workers (one per GPU); 0 = in-process, no Ray workers; [min, max] = an elastic group
    # that runs on the workers that can be placed and grows back when capacity returns
    num_workers: Workers = setting(2, check=_workers_ok,
                                   why="needs a count >= 0, or [min, max] with 1 <= min <= max (elastic)")
    use_gpu: bool = False  # one GPU per worker (DDP over NCCL, bf16 autocast); false = CPU workers (gloo)
    cpus_per_worker: float = setting(1.0, gt=0)  # CPUs a worker reserves (the read tasks reserve none)
    # The share of a GPU a worker reserves with use_gpu: 1 = a GPU of its own (DDP over NCCL); below 1,
    # ⌊1/share⌋ workers share each GPU (a model that leaves room; how a 1-GPU machine runs several
    # ranks). NCCL cannot join two ranks on one GPU, so such a group runs over gloo.
    gpus_per_worker: float = setting(1.0, gt=0, le=1)
    # torch threads per worker (and its OMP_NUM_THREADS), set on every rank; 0 = max(1, ⌊cpus_per_worker⌋),
    # Ray's own rule, made explicit: Ray applies it only where OMP_NUM_THREADS is unset, torchrun sets 1
    threads_per_worker: int = setting(0, ge=0)
    max_failures: int = setting(3, ge=0)  # worker-group restarts from the latest checkpoint (lost worker or node)
    # restarts after a drained node (`raymcn drain`), apart from max_failures; -1 = any number
    max_preemption_failures: int = setting(-1, ge=-1)
    find_unused_parameters: bool = True  # needed by staged orders: inactive branches get no grad
    elastic_resize_interval_s: float = setting(60.0, gt=0)  # how often a running elastic group checks for capacity
    # How long a worker group's start waits for its resources before Ray Train decides again (then
    # retried without limit; Ray's default 60 s). After a lost node Ray first retries at the old size,
    # because the lost node's resources still count for a moment: an elastic group shrinks only
    # after this wait (measured: tests/test_elastic.py, docs/faults.md).
    worker_start_timeout_s: float = setting(20.0, gt=0)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        """The most workers a step is shared by (local mode: 0)."""
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def workers_text(self) -> str:
        """``num_workers`` for messages: ``4``, or ``3-4 (an elastic group starts with at least 3)``."""
        lo, hi = self.min_workers, self.max_workers
        return f"{lo}-{hi} (an elastic group starts with at least {lo})" if lo != hi else str(lo)

    @property
    def torch_threads(self) -> int:
        """The threads every worker computes with (``threads_per_worker``, its 0 resolved)."""
        return self.threads_per_worker or max(1, math.floor(self.cpus_per_worker))

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple) and self.num_workers[0] < self.num_workers[1]
    # Exact gradient caching: each worker embeds its share in chunks of this many clips (whole videos)
    # and re-runs each chunk's forward with the loss's cached gradient (train/gradcache.py); 0 = off.
    grad_cache_clips: int = setting(0, ge=0)
    # Score the contrastive pairs against the other workers' embeddings one worker's at a time,
    # passed around a ring (losses/ring.py), instead of all-gathering them: the same loss; a worker
    # holds at most two workers' embeddings and the cluster term's gathered fused rows (1·B·D floats)
    # instead of 3·B·D gathered ones; twice the traffic, the similarity products computed twice.
    ring_contrastive: bool = False
    # fp32 matrix products on GPU (the losses' similarity slabs, k-means, the cluster logits; the
    # model runs under bf16 autocast): "highest" = full fp32, "high" = TF32 on Ampere and later. On
    # the lab's A100s at paper dims a rank's step does 0.66-0.82 TFLOP of them beside 25.7 TFLOP of
    # bf16 model work: >= 34 ms at fp32's 19.5 TFLOPS peak, >= 4 ms at TF32's 156 (estimates). TF32
    # would change no similarity logit (the embeddings are bf16 values, which TF32 holds exactly),
    # only the fp32 gradient factors, k-means and the cluster logits, by 2^-11 relative, 8x below the
    # bf16 rounding the embeddings already carry. "highest" (the original's fp32 numerics) stays the
    # default until a server measures both: the one GPU run so far used "highest" only
    # (docs/memory.md, "On a GPU so far"; its checklist measures both).
    matmul_precision: str = setting("highest", choices=("highest", "high"))


@dataclass(frozen=True)
class RunSection:
    name: str = ""  # "" = a unique name per fresh run (a reused name silently resumes)
    storage_path: str = ""  # "" = $RAYMCN_RESULTS or ~/raymcn_results; a folder or a bucket URI
    seed: int = 1  # model initialisation, data order (epoch permutation, each rank's share, clips), k-means
    checkpoints_to_keep: int = setting(2, ge=1)  # the best by R@10 among epoch ends; the latest is always kept too
    # Checkpoints inside an epoch as well as at every epoch end: a step count ("500") or a duration
    # ("30m", "2h", "90s"); "0" = epoch ends only. A HowTo100M epoch lasts hours and the lab's
    # servers rebooted about an hour into runs: a reboot then costs at most this much training.
    # 30m keeps checkpointing under 1 % of training while a checkpoint stalls the steps under 18 s
    # (`python -m bench.checkpoint` measures it on the lab's disk; docs/faults.md, "Checkpoints").
    checkpoint_every: str = setting("30m", check=_interval_ok,
                                    why='needs a step count ("500"), a duration ("30m", "2h", "90s") or "0"')
    # Steps between asking whether a node of the run is drained (`raymcn drain`; a barrier over the
    # ranks, its cost in docs/faults.md); at the first yes the run checkpoints at once. 0 = never
    drain_check_every: int = setting(10, ge=0)
    log_every: int = setting(10, ge=1)  # steps between progress lines in the console log
    progress_every: float = setting(120.0, ge=0)  # seconds between in-epoch lines on the terminal; 0 = none
    # A rank with no progress this long (or 10x its longest step so far, when longer) is named on
    # the terminal and its attempt ended: a restart from the latest checkpoint, and the same stall
    # twice ends the run. The process group's timeout (run.collective_timeout_s) is a backstop
    # behind the watchdogs. 600 s: far above the stall a checkpoint may cause at the default interval
    # (docs/faults.md, "Checkpoints"); a hang costs minutes, not the night.
    stall_timeout_s: float = setting(600.0, ge=10)
    # The process group's timeout: a collective that waits longer fails (gloo raises; on NCCL its
    # own watchdog aborts the communicators and the next collective raises; both are named as a
    # stall). 0 = 2 x run.stall_timeout_s (Ray's default: 30 min). At least 1.5 x
    # run.stall_timeout_s: the ranks' watchdogs (their limits capped below it) must act first,
    # naming the rank that holds the others up rather than the ranks waiting for it.
    collective_timeout_s: float = setting(0.0, ge=0)
    # A raymcn checkpoint (directory or its state.pt) whose model weights start a fresh run:
    # optimizer, LR schedule, step, queue and centroids start anew. Read by every worker, so on
    # several nodes it must be on a shared path; "" = random initialisation.
    init_from: str = ""
    # Where else a `raymcn train` run's per-epoch metrics go besides metrics.csv (extras
    # raymcn[mlflow|wandb|tensorboard]), written on the driver's machine (a bucket run's in its
    # cache); a sweep logs every trial to them.
    trackers: str = setting("", check=lambda v: all(t in TRACKERS for t in v.split(",") if t),
                            why=f"a comma-separated subset of {', '.join(TRACKERS)} (or \"\")")
    wandb_project: str = "raymcn"  # the W&B project of run.trackers' wandb
    wandb_entity: str = ""  # the W&B team or user; "" = your default entity
    wandb_mode: str = setting("offline", choices=("offline", "online", "disabled"))  # offline: `wandb sync` uploads

    @property
    def collective_timeout(self) -> float:
        """The process group's timeout in seconds (``collective_timeout_s``, its 0 resolved)."""
        return self.collective_timeout_s or COLLECTIVE_TIMEOUT_FACTOR * self.stall_timeout_s


@dataclass(frozen=True)
class SweepConfig:
    algorithm: str = setting("random", choices=SEARCH_ALGORITHMS)  # the search (bohb, asha: early stopping by budget)
    suggest: str = setting("random", choices=("random", "optuna"))  # asha only: where new configs come from
    num_samples: int = setting(4, ge=1)  # configurations the search draws (a grid: repeats of the whole grid)
    max_concurrent: int = setting(1, ge=1)  # = total GPUs // GPUs per trial
    grace_epochs: int = setting(1, ge=1)  # first rung of ASHA / HyperBand, in budget epochs (after the stage switch)
    reduction_factor: int = setting(3, ge=2)  # ASHA / HyperBand: 1 in this many trials goes on at each rung
    seed: int = 0  # the search's own random state (which configurations are drawn)
    space: dict = setting({})  # dotted key -> {loguniform: [lo, hi]} | {choice: [...]} ...
    max_trial_failures: int = setting(2, ge=0)  # retries of a trial whose driver or node died (permanent errors: none)
    # Every configuration the search proposes is trained this many times, with run.seed, run.seed + 1, ...
    # (the seed is written into each trial's config, so the results table pairs trials by it).
    repeats: int = setting(1, ge=1)
    status_every: float = setting(120.0, ge=0)  # seconds between the console's status tables; 0 = none
    # Search, then confirm: {per: KEY, top: 1, repeats: 5}. When the search ends, the best `top`
    # configurations of each value of KEY are trained again over `repeats` fresh seeds (the same
    # seeds for every group) at the full budget; the table then answers from those runs. {} = off.
    confirm: dict = setting({})


@dataclass(frozen=True)
class Config:
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    scale: ScaleConfig = ScaleConfig()
    run: RunSection = RunSection()
    sweep: SweepConfig = SweepConfig()

    # --- derived values of the config alone (one definition each; the run plan holds the rest) ---
    @property
    def clips_per_step(self) -> int:
        """Global clips per step, B = batch_size · clips_per_video."""
        return self.data.batch_size * self.data.clips_per_video

    @property
    def queue_clips_per_video(self) -> int:
        return max(1, int(round(self.data.clips_per_video * self.loss.queue_clip_fraction)))

    @property
    def queue_rows(self) -> int:
        """Global FIFO rows: queue_steps · batch_size · queue_clips_per_video."""
        return self.loss.queue_steps * self.data.batch_size * self.queue_clips_per_video

    @property
    def stage1_epochs(self) -> int:
        """Epochs of stage 1, rounded up (``schedule.stage1_fraction`` x ``schedule.epochs``): the
        sweep schedulers' clock starts after them, for every trial of a sweep, ``joint`` included."""
        return math.ceil(self.schedule.stage1_fraction * self.schedule.epochs)

    @property
    def budget_epochs(self) -> int:
        """Epochs on the sweep schedulers' clock (``max_t``): the run's epochs after stage 1."""
        return self.schedule.epochs - self.stage1_epochs

    def steps_per_epoch(self, videos: int) -> int:
        """Steps every rank runs per epoch over ``videos``: videos // data.batch_size, capped by
        schedule.steps_per_epoch. Raises ValueError when they cannot fill one step."""
        steps = videos // self.data.batch_size
        if self.schedule.steps_per_epoch:
            steps = min(steps, self.schedule.steps_per_epoch)
        if steps < 1:
            raise ValueError(f"{videos} videos are fewer than one step of data.batch_size={self.data.batch_size}")
        return steps

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: _section_to_dict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_flat(self, include_sweep: bool = False) -> dict[str, Any]:
        """Dotted ``section.key`` -> value (the form Tune's param_space and the results table use)."""
        out = {}
        for section, values in self.to_dict().items():
            if section == "sweep" and not include_sweep:
                continue
            for k, v in values.items():
                out[f"{section}.{k}"] = v
        return out

    def differences(self, other: Config) -> dict[str, tuple[Any, Any]]:
        """``section.key`` -> (this config's value, ``other``'s) for every setting that differs, the
        sweep section included (its space as one value)."""
        mine, theirs = self.to_flat(include_sweep=True), other.to_flat(include_sweep=True)
        return {k: (mine.get(k), theirs.get(k)) for k in sorted(mine.keys() | theirs.keys()) if mine.get(k) != theirs.get(k)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Config:
        """Rebuild (and re-validate) a config from ``to_dict()`` output."""
        return _build({k: dict(v) for k, v in raw.items()}, [])

    def replace(self, overrides: dict[str, Any]) -> Config:
        """A validated copy with dotted overrides applied."""
        raw = self.to_dict()
        problems: list[str] = []
        _apply_overrides(raw, overrides, problems)
        return _build(raw, problems)

    def dump_text(self) -> str:
        """The resolved config as YAML (what ``load_config_text`` reads back)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def dump(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.dump_text())


def _section_to_dict(section: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else (dict(v) if isinstance(v, dict) else v)
    return out


SECTIONS: dict[str, type] = typing.get_type_hints(Config)  # section name -> dataclass


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def all_keys() -> list[str]:
    return [f"{s}.{k}" for s, cls in SECTIONS.items() for k in _field_types(cls)]


def _did_you_mean(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(key: str, value: Any, typ: Any, problems: list[str]) -> Any:
    """Convert YAML / command-line values to the field's type; record a problem if impossible."""
    origin = typing.get_origin(typ)
    try:
        if typ == Workers:  # 3, "3", [1, 2], "1-2", "[1, 2]"
            if isinstance(value, str):
                value = value.strip()
                value = [int(v) for v in value.split("-")] if "-" in value[1:] else yaml.safe_load(value)
            if isinstance(value, (list, tuple)):
                if len(value) != 2 or any(isinstance(v, bool) for v in value):
                    raise TypeError
                lo, hi = int(value[0]), int(value[1])
                return (lo, hi) if lo != hi else lo
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise TypeError
            return int(value)
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            raise TypeError
        if typ is int:
            if isinstance(value, bool):
                raise TypeError
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, (int, str)):
                return int(value)
            raise TypeError
        if typ is float:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if typ is str:
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                return str(value)
            raise TypeError
        if origin is tuple:
            if isinstance(value, str):
                value = yaml.safe_load(value)
            if not isinstance(value, (list, tuple)):
                raise TypeError
            return tuple(int(v) for v in value)
        if typ is dict or origin is dict:
            if value is None or value == "":  # `confirm:` with nothing under it, or `--set sweep.confirm=`
                return {}
            if not isinstance(value, dict):
                raise TypeError
            return dict(value)
    except (TypeError, ValueError):
        pass
    tname = "a count, or [min, max] / MIN-MAX" if typ == Workers else getattr(typ, "__name__", str(typ))
    problems.append(f"{key}: expected {tname}, got {value!r}")
    return None


def _apply_overrides(raw: dict[str, dict[str, Any]], overrides: dict[str, Any], problems: list[str]) -> None:
    keys = all_keys()
    for dotted, value in overrides.items():
        section, _, name = dotted.partition(".")
        if section not in SECTIONS or name not in _field_types(SECTIONS[section]):
            problems.append(f"unknown key '{dotted}'{_did_you_mean(dotted, keys)}")
            continue
        raw.setdefault(section, {})[name] = value


def _build(raw: dict[str, Any], problems: list[str]) -> Config:
    sections = {}
    for section, values in raw.items():
        if section not in SECTIONS:
            problems.append(f"unknown section '{section}'{_did_you_mean(section, list(SECTIONS))}")
            continue
        if values is None:
            values = {}
        if not isinstance(values, dict):
            problems.append(f"{section}: expected a mapping of keys, got {values!r}")
            continue
        types = _field_types(SECTIONS[section])
        kwargs = {}
        for name, value in values.items():
            key = f"{section}.{name}"
            if name not in types:
                problems.append(f"unknown key '{key}'{_did_you_mean(key, all_keys())}")
                continue
            coerced = _coerce(key, value, types[name], problems)
            if coerced is not None:
                kwargs[name] = coerced
        sections[section] = SECTIONS[section](**kwargs)
    cfg = Config(**sections)
    problems.extend(validate(cfg))
    if problems:
        raise ConfigError(problems)
    return cfg


def _num(x: float) -> str:
    return f"{x:g}"


def _bound_problem(key: str, value: Any, meta: dict[str, Any]) -> str | None:
    """The message for ``value`` against the bounds declared at its field (None when it is in them)."""
    shown = list(value) if isinstance(value, tuple) else value
    if "choices" in meta and value not in meta["choices"]:
        return f"{key}={value!r}: allowed values are {', '.join(map(str, meta['choices']))}"
    if "check" in meta and not meta["check"](value):
        return f"{key}={shown}: {meta['why']}"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    ge, gt, le, lt = (meta.get(k) for k in ("ge", "gt", "le", "lt"))
    ok = math.isfinite(value) and (ge is None or value >= ge) and (gt is None or value > gt) and (
        le is None or value <= le) and (lt is None or value < lt)
    if ok:
        return None
    if gt is not None and lt is not None:
        return f"{key}={value}: must lie strictly between {_num(gt)} and {_num(lt)}"
    low, high = (gt, ge)[gt is None], (lt, le)[lt is None]
    if low is not None and high is not None:
        return (f"{key}={value}: must lie in {'(' if gt is not None else '['}{_num(low)}, "
                f"{_num(high)}{')' if lt is not None else ']'}")
    if gt == 0:
        return f"{key}={value}: must be a positive number"
    if low is None:
        return f"{key}={value}: must be {'<' if lt is not None else '<='} {_num(high)}"
    return f"{key}={value}: must be {'>' if gt is not None else '>='} {_num(low)}"


def field_problems(section_name: str, section: Any) -> list[str]:
    """Every field of ``section`` against the bounds its :func:`setting` declares, in field order."""
    problems = []
    for f in dataclasses.fields(section):
        msg = _bound_problem(f"{section_name}.{f.name}", getattr(section, f.name), f.metadata)
        if msg:
            problems.append(msg)
    return problems


def validate(cfg: Config) -> list[str]:
    """Bounds of every field, then the cross-field checks; returns the problems (empty when valid)."""
    p = [msg for name in SECTIONS if name != "sweep" for msg in field_problems(name, getattr(cfg, name))]

    def need(ok: bool, msg: str) -> None:
        if not ok:
            p.append(msg)

    d, lo, sc = cfg.data, cfg.loss, cfg.scale
    if d.batch_size >= 1 and _workers_ok(sc.num_workers):
        # Ranks share a step's videos (⌊B/N⌋ or ⌈B/N⌉ each): every rank needs at least one.
        need(d.batch_size >= sc.max_workers,
             f"data.batch_size={d.batch_size} is smaller than scale.num_workers={sc.max_workers}: "
             f"every worker needs at least one video per step (allowed: >= {sc.max_workers})")
    if d.batch_size >= 1 and d.clips_per_video >= 1 and lo.num_clusters >= 1:
        # k-means first runs on the very first batch alone (the queue is still empty).
        need(lo.num_clusters <= cfg.clips_per_step,
             f"loss.num_clusters={lo.num_clusters} is larger than the {cfg.clips_per_step} clips k-means "
             f"sees at its first refit (data.batch_size x data.clips_per_video): allowed 1..{cfg.clips_per_step}")
    if sc.grad_cache_clips > 0 and d.clips_per_video >= 1:
        need(sc.grad_cache_clips % d.clips_per_video == 0,
             f"scale.grad_cache_clips={sc.grad_cache_clips} is not a multiple of data.clips_per_video="
             f"{d.clips_per_video}: a chunk holds whole videos; allowed 0 (off) or {d.clips_per_video}, "
             f"{2 * d.clips_per_video}, {3 * d.clips_per_video}, ...")
    need(not (sc.grad_cache_clips > 0 and cfg.model.sync_batchnorm),
         f"scale.grad_cache_clips={sc.grad_cache_clips} with model.sync_batchnorm=true: gradient caching normalises "
         "each chunk by its own statistics, sync_batchnorm by the global batch's (a collective per forward, which "
         "chunks would call a different number of times per rank); choose one")
    kind, _, path = d.eval_set.partition(":")
    need(kind in EVAL_SET_KINDS and (kind == "synthetic") == (path == ""),
         f"data.eval_set={d.eval_set!r}: allowed values are synthetic, youcook:FILE, msrvtt:FILE")
    need(sc.use_gpu is False or (_workers_ok(sc.num_workers) and sc.min_workers >= 1),
         "scale.use_gpu=true needs scale.num_workers >= 1 (one worker per GPU)")
    r = cfg.run
    least = COLLECTIVE_TIMEOUT_MIN_FACTOR * r.stall_timeout_s
    need(not r.collective_timeout_s or r.collective_timeout_s >= least,
         f"run.collective_timeout_s={r.collective_timeout_s:g} is shorter than {COLLECTIVE_TIMEOUT_MIN_FACTOR:g} x "
         f"run.stall_timeout_s={r.stall_timeout_s:g}: a collective would time out before the watchdogs act, naming "
         f"the ranks that wait in it instead of the rank that holds them up; allowed 0 (= "
         f"{COLLECTIVE_TIMEOUT_FACTOR} x run.stall_timeout_s) or >= {least:g}")
    sw = cfg.sweep
    need(not (cfg.optim.warmup_steps and sw.algorithm in ("asha", "bohb") and "data.batch_size" in sw.space),
         f"optim.warmup_steps={cfg.optim.warmup_steps} fixes the warm-up in steps, so {sw.algorithm}'s rungs would "
         "compare small-batch trials past their warm-up with large-batch trials still in it: set "
         "optim.warmup_steps=0 and give the warm-up in videos (optim.warmup_videos)")
    p.extend(validate_sweep(cfg.sweep))
    p.extend(_budget_problems(cfg))
    if not p:
        p.extend(_validate_trial_configs(cfg))
    return p


def _budget_problems(cfg: Config) -> list[str]:
    """An early-stopping sweep (asha, bohb) needs its clock, the epochs after stage 1, to reach its
    first rung (``sweep.grace_epochs``) before the run ends."""
    sw, s = cfg.sweep, cfg.schedule
    if sw.algorithm not in ("asha", "bohb") or not (s.epochs >= 1 and 0 <= s.stage1_fraction < 1):
        return []
    budget = cfg.budget_epochs
    where = (f"schedule.epochs={s.epochs} with schedule.stage1_fraction={s.stage1_fraction:g} leaves "
             f"{budget} epoch{'s' * (budget != 1)} after stage 1 ({cfg.stage1_epochs} epochs), the {sw.algorithm} "
             "sweep's clock")
    if budget < 1:
        return [f"{where}: no rung could ever compare trials; train longer or lower schedule.stage1_fraction"]
    if sw.grace_epochs > budget:
        return [f"sweep.grace_epochs={sw.grace_epochs}: {where}, so its first rung lies past the end of every "
                f"trial and nothing would be stopped early; allowed 1..{budget}"]
    return []


def _validate_trial_configs(cfg: Config, limit: int = 512) -> list[str]:
    """Every trial config the sweep can draw must itself be valid (e.g. each batch-size choice
    divisible by the workers, K <= clips at the smallest batch). Choices and the ends of ranges
    are combined exhaustively (up to ``limit`` combinations)."""
    import itertools

    if not cfg.sweep.space:
        return []
    keys, axes = [], []
    for key, spec in cfg.sweep.space.items():
        keys.append(key)
        axes.append(list(next(iter(spec.values()))))  # choice/grid values, or [low, high] of a range
    problems: list[str] = []
    base = cfg.to_dict()
    for combo in itertools.islice(itertools.product(*axes), limit):
        raw = {k: dict(v) for k, v in base.items()}
        raw["sweep"] = {}  # checked above; avoid recursing into the sweep section
        sub: list[str] = []
        _apply_overrides(raw, dict(zip(keys, combo)), sub)
        try:
            _build(raw, sub)
        except ConfigError as e:
            where = ", ".join(f"{k}={v!r}" for k, v in zip(keys, combo))
            problems.extend(f"sweep.space: the trial {{{where}}} is invalid: {m}" for m in e.problems)
            break  # one failing combination is enough to explain the problem
    return problems


def validate_sweep(sw: SweepConfig) -> list[str]:
    """Checks of the ``sweep:`` section: its fields' bounds and every search-space entry."""
    p = field_problems("sweep", sw)
    keys = [k for k in all_keys() if not k.startswith("sweep.")]
    types = {f"{s}.{k}": t for s, cls in SECTIONS.items() for k, t in _field_types(cls).items()}
    for key, spec in sw.space.items():
        where = f"sweep.space.{key}"
        if key not in keys:
            p.append(f"{where}: unknown key '{key}'{_did_you_mean(key, keys)}")
            continue
        if not (isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in SEARCH_DOMAINS):
            p.append(f"{where}: expected one of {{{', '.join(SEARCH_DOMAINS)}: ...}}, got {spec!r}")
            continue
        domain, args = next(iter(spec.items()))
        if sw.algorithm in ("asha", "bohb") and key in ("schedule.epochs", "schedule.stage1_fraction"):
            p.append(f"{where}: cannot be swept with {sw.algorithm}: the early-stopping clock is measured from "
                     "the stage switch, which must be the same for every trial (set it in the run keys)")
            continue
        if domain in ("loguniform", "uniform", "randint"):
            ok = isinstance(args, list) and len(args) == 2 and all(
                isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
            if not ok or args[0] >= args[1] or (domain == "loguniform" and args[0] <= 0):
                p.append(f"{where}: {domain} needs [low, high] with {'0 < ' if domain == 'loguniform' else ''}"
                         f"low < high, got {args!r}")
                continue
            values = list(args)
        else:
            if not isinstance(args, list) or not args:
                p.append(f"{where}: {domain} needs a non-empty list of values, got {args!r}")
                continue
            values = args
        # every candidate value must itself be a valid setting for the key
        for v in values:
            sub: list[str] = []
            _coerce(key, v, types[key], sub)
            p.extend(f"{where}: {msg}" for msg in sub)
    if sw.algorithm == "bohb" and any(next(iter(s)) == "grid" for s in sw.space.values() if isinstance(s, dict)):
        p.append("sweep.space: bohb does not accept grid domains; use choice")
    if sw.repeats > 1 and "run.seed" in sw.space:
        p.append(f"sweep.repeats={sw.repeats} sets run.seed per repeat; run.seed is also in sweep.space: "
                 "use one of them")
    drawn = [k for k, s in sw.space.items() if isinstance(s, dict) and next(iter(s), None) in ("loguniform", "uniform",
                                                                                               "randint")]
    gridded = [k for k, s in sw.space.items() if isinstance(s, dict) and next(iter(s), None) == "grid"]
    if sw.repeats > 1 and sw.algorithm not in ("grid", "bohb") and gridded:
        p.append(f"sweep.repeats={sw.repeats} with {sw.algorithm}: {', '.join(gridded)} is a grid domain, which only "
                 "the grid algorithm enumerates (a repeated search draws configurations): use choice, or "
                 "sweep.algorithm=grid")
    p.extend(_confirm_problems(sw))
    if sw.repeats > 1 and sw.algorithm == "grid" and drawn:
        p.append(f"sweep.repeats={sw.repeats} with the grid algorithm repeats grid cells, but {', '.join(drawn)} "
                 "would be drawn anew for every seed, so the repeats would not repeat a configuration: give "
                 "them as choice/grid values, or use another algorithm")
    return p


CONFIRM_KEYS = {"per": "the swept key whose groups are compared, e.g. schedule.stage_order",
                "top": "configurations per group (default 1)", "repeats": "fresh seeds per configuration, >= 2"}


def _confirm_problems(sw: SweepConfig) -> list[str]:
    """Checks of ``sweep.confirm`` (empty = no confirmation phase)."""
    c = sw.confirm
    if not c:
        return []
    p = [f"sweep.confirm.{k}: unknown (allowed: {', '.join(CONFIRM_KEYS)})" for k in c if k not in CONFIRM_KEYS]
    per = c.get("per")
    if per is None:
        p.append(f"sweep.confirm: needs per ({CONFIRM_KEYS['per']})")
    elif per not in sw.space:
        p.append(f"sweep.confirm.per={per!r}: not a swept key (swept: {', '.join(sw.space) or 'none'})")
    for key, low in (("top", 1), ("repeats", 2)):
        value = c.get(key, 1 if key == "top" else None)
        if value is None:
            p.append(f"sweep.confirm: needs {key} ({CONFIRM_KEYS[key]})")
        elif isinstance(value, bool) or not isinstance(value, int) or value < low:
            p.append(f"sweep.confirm.{key}={value!r}: must be a whole number >= {low}")
    return p


# --- loading ---------------------------------------------------------------------------------------
def parse_override(text: str) -> tuple[str, Any]:
    """``'optim.lr=3e-4'`` -> ``('optim.lr', '3e-4')``; values are typed later against the field."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError([f"--set {text!r}: expected KEY=VALUE, e.g. optim.lr=3e-4"])
    value = value.strip()
    parsed = yaml.safe_load(value) if value else ""
    # YAML 1.1 reads '3e-4' as a string; keep strings for _coerce to type against the field.
    return key.strip(), parsed if isinstance(parsed, (list, dict, bool)) else value


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Config:
    """Build a validated Config from an optional YAML file plus dotted overrides.

    Raises:
        ConfigError: listing every unknown key, wrong type and impossible value, or an unreadable file.
    """
    if path is None:
        return load_config_text("", overrides)
    try:
        text = Path(path).expanduser().read_text()
    except FileNotFoundError:
        raise ConfigError([f"config file {path} does not exist"]) from None
    return load_config_text(text, overrides, source=str(path))


def load_config_text(text: str, overrides: list[str] | dict[str, Any] | None = None,
                     source: str = "the config") -> Config:
    """:func:`load_config` of YAML ``text`` (read from ``source``, named in error messages)."""
    problems: list[str] = []
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError([f"config file {source} is not valid YAML: {e}"]) from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError([f"config file {source}: expected a mapping of sections, got {type(loaded).__name__}"])
    raw = _sections(loaded, source, problems)
    if isinstance(overrides, dict):
        pairs = dict(overrides)
    else:
        pairs = {}
        for text in overrides or []:
            try:
                k, v = parse_override(text)
                pairs[k] = v
            except ConfigError as e:
                problems.extend(e.problems)
    _apply_overrides(raw, pairs, problems)
    return _build(raw, problems)


def _sections(loaded: dict[str, Any], source: str, problems: list[str]) -> dict[str, dict[str, Any]]:
    """The file's sections as mappings: a section with nothing under it (or only comments, which
    YAML reads as null) is an empty one; any other value that is not a mapping is a problem naming
    the file and the section, and the section is left out."""
    raw = {}
    for section, values in loaded.items():
        if values is None:
            values = {}
        if not isinstance(values, dict):
            problems.append(f"config file {source}: section '{section}' must be a mapping of keys "
                            f"(key: value lines indented under it), got {values!r}")
            continue
        raw[section] = dict(values)
    return raw


def default_cache_dir(cfg: Config) -> Path:
    return Path(cfg.data.cache_dir or os.environ.get("RAYMCN_CACHE") or Path.home() / ".cache" / "raymcn")


def drain_marks_dir() -> Path:
    """This machine's folder of drain marks (``DRAIN_MARKS_DIR``)."""
    return Path(tempfile.gettempdir()) / DRAIN_MARKS_DIR


def default_storage_path(cfg: Config) -> str:
    """Where runs and sweeps are written: a path (``~`` allowed) or a URI such as ``s3://bucket/prefix``."""
    return cfg.run.storage_path or os.environ.get("RAYMCN_RESULTS") or str(Path.home() / "raymcn_results")
