"""The eight sections of a config, one frozen dataclass per concern, each setting with its default,
its bounds (:func:`setting`) and its meaning in the comment at the field (``raymcn config
--reference`` prints them: docs/settings.md); and how a value from YAML or the command line is
typed against its field (:func:`coerce`)."""

from __future__ import annotations

import difflib
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

from raymcn.config.metrics import DEFAULT_OBJECTIVE, objective_choices
from raymcn.config.names import COLLECTIVE_TIMEOUT_FACTOR, SEARCH_ALGORITHMS, STAGE_ORDERS, TRACKERS


def setting(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None, choices: tuple | Callable[[], tuple] | None = None, check: Any = None,
            why: str = "", part: bool = False) -> Any:
    """A config field with its bounds declared where it is defined (read by ``checks.field_problems``).

    ``ge``/``gt``/``le``/``lt`` bound a number, ``choices`` lists the allowed values (or is a
    function returning them, read at each check: a list kept elsewhere), ``check`` is a predicate
    with ``why`` as its message. ``part``: the value names a model part, a class of
    ``raymcn/model/parts.py``'s table, which the config (left of the model) cannot read: the
    preflight checks it before Ray starts. Adding a setting is one line.
    """
    meta = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices, check=check, why=why).items()
            if v not in (None, "")}
    if part:
        meta["part"] = True
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def allowed_values(meta: Any) -> tuple | None:
    """The ``choices`` a field's :func:`setting` declares, as a tuple (None when it declares none)."""
    choices = meta.get("choices")
    return tuple(choices()) if callable(choices) else choices


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


def workers_ok(v: Workers) -> bool:
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
    # The model's parts: each names a class of raymcn/model/parts.py's table, which the preflight checks
    # before Ray starts (docs/development.md says how to add a part).

    video_encoder: str = setting("gated", part=True)  # the video branch: GU(video_dim -> embed_dim), the original's
    # the audio branch: DAVEnet, a masked mean over time, GU at its width, Linear to embed_dim (the original's)
    audio_encoder: str = setting("davenet", part=True)
    # the text branch: per-word Linear + ReLU, max over the words, GU (the original's; padding unmasked)
    text_encoder: str = setting("gated", part=True)
    # each modality's reconstruction head: embed_dim -> recon_hidden -> its target, a ReLU after each Linear
    recon_head: str = setting("mlp", part=True)


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
    # steps per epoch at most; 0 = videos // batch_size, the most an epoch can take in any case (it reads
    # each video at most once): a larger value is capped, and the run says so
    steps_per_epoch: int = setting(0, ge=0)


@dataclass(frozen=True)
class ScaleConfig:
    # Ray Train workers (one per GPU); 0 = in-process, no Ray workers; [min, max] = an elastic group
    # that runs on the workers that can be placed and grows back when capacity returns
    num_workers: Workers = setting(2, check=workers_ok,
                                   why="needs a count >= 0, or [min, max] with 1 <= min <= max (elastic)")
    use_gpu: bool = False  # one GPU per worker (DDP over NCCL, bf16 autocast); false = CPU workers (gloo)
    cpus_per_worker: float = setting(1.0, gt=0)  # CPUs a worker reserves (the read tasks reserve none)
    # The share of a GPU a worker reserves with use_gpu: 1 = a GPU of its own (DDP over NCCL); below 1,
    # ⌊1/share⌋ workers share each GPU (a model that leaves room; how a 1-GPU machine runs several
    # ranks). NCCL cannot join two ranks on one GPU, so such a group runs over gloo, without
    # scale.ring_contrastive (gloo cannot send CUDA tensors from rank to rank).
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
    # (docs/memory.md, "On a GPU so far"; the lab guide's step 11 measures both).
    matmul_precision: str = setting("highest", choices=("highest", "high"))
    # torch.compile of the model under DDP, its forward and backward (the objective stays eager: its
    # collectives and k-means would only break the graph). Off until a GPU measures it: on a 2-core
    # CPU it compiled for 111 s at paper dims and then ran at 0.69x eager. A stage switch, ranks
    # holding ⌊B/N⌋ or ⌈B/N⌉ videos and a resized group each compile once more (at most 8 per
    # code path, then eager); the counts and seconds are in the epoch metrics. Compiled kernels are
    # cached on each node's disk (/tmp/torchinductor_<user>), so a sweep's later trials compile faster.
    compile: bool = False
    # How DAVEnet's convolutions run, on the same weights (checkpoints load either way), equal to
    # "nchw" within the precision's tolerance: "nchw" (torch's default), "channels_last" (the 2-D
    # convolutions in channels-last memory format), "1d" (as the 1-D convolutions over time they are).
    # Which is fastest is for a GPU to say: `python -m bench.gpu_smoke --compare`.
    davenet_layout: str = setting("nchw", choices=("nchw", "channels_last", "1d"))


@dataclass(frozen=True)
class RunSection:
    name: str = ""  # "" = a unique name per fresh run (a reused name silently resumes)
    storage_path: str = ""  # "" = $RAYMCN_RESULTS or ~/raymcn_results; a folder or a bucket URI
    seed: int = 1  # model initialisation, data order (epoch permutation, each rank's share, clips), k-means
    checkpoints_to_keep: int = setting(2, ge=1)  # the best by sweep.metric among epoch ends; the latest is kept too
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
    # Where else a `raymcn train` run's per-epoch metrics go besides metrics.csv, written on the
    # driver's machine (a bucket run's in its cache); a sweep logs every trial to them. tensorboard:
    # event files written by tensorboardX, which comes with Ray Tune (the viewer: the extra
    # raymcn[tensorboard]); mlflow, wandb: the extras raymcn[mlflow], raymcn[wandb]; "" = none.
    trackers: str = setting("tensorboard", check=lambda v: all(t in TRACKERS for t in v.split(",") if t),
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
    # What the sweep optimizes: a metric of the table in docs/sweeps.md ("Choosing the metric"), as
    # best_NAME (a trial counts by its best epoch) or NAME (by its last). The table's direction (lower
    # is better for the ranks) steers the search, early stopping, confirmation, answer and tables.
    metric: str = setting(DEFAULT_OBJECTIVE, choices=objective_choices)
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




SECTIONS: dict[str, type] = {"data": DataConfig, "model": ModelConfig, "loss": LossConfig, "optim": OptimConfig,
                             "schedule": ScheduleConfig, "scale": ScaleConfig, "run": RunSection,
                             "sweep": SweepConfig}  # section name -> dataclass, in the config's order


def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def all_keys() -> list[str]:
    return [f"{s}.{k}" for s, cls in SECTIONS.items() for k in field_types(cls)]


def did_you_mean(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def coerce(key: str, value: Any, typ: Any, problems: list[str]) -> Any:
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

