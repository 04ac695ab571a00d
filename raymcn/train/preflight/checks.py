"""Preflight: every check that can fail a long run, done before Ray starts and reported together.

Three steps, each adding to one :class:`~raymcn.config.ConfigError`: the settings (``config``:
unknown keys, wrong values), the input files they name (:func:`resolved_inputs`: the shard folder,
its manifest, every listed shard at its recorded size and ``vocab.npy``, the eval set's file, the
word vectors), then the plan and what it needs (:func:`checked_plan`, on the run's plan,
``run_plan.py``: the inputs resolved, the counts derived; the one the trainer then receives). A
setting's problem does not hide an input file's: both are named in one message. The plan, the
memory estimate and the storage's room need valid settings and inputs, so they are checked once
those are: the model's parts named in its table (``raymcn/model/parts.py``, which the config
cannot read), the output folder writable and with room for the run's checkpoints
(``checkpoints/space.py``), the sweep's rungs against its warm-up, per-worker memory, the weights
a run starts from (``run.init_from``). The cluster's CPUs and GPUs are checked right after
``ray.init`` by ``on_ray/cluster.py``; every node's view, before a sweep, by ``raymcn doctor``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from raymcn.config import Config, ConfigError, default_storage_path, reason
from raymcn.train import inputs as run_inputs
from raymcn.train.inputs import RunInputs, shard_folder, shard_manifest
from raymcn.train.run_plan import RunPlan, make_plan, plan_of


def static_problems(cfg: Config, inputs: RunInputs, device_bytes: int | None = None,
                    notes: list[str] | None = None, *, trials: int = 1, held: int = 0) -> list[str]:
    """Problems found without starting Ray (empty list when the run can start).

    Args:
        inputs: the run's inputs, resolved (``train/inputs.py``).
        device_bytes: memory of one worker's device; default: this machine's RAM divided by the
            workers on CPU, or the local GPU's memory when ``scale.use_gpu`` and a GPU is visible.
        notes: if given, receives what the checks found that is not a problem (the memory estimate
            of a run that fits, with the convolution kernel path it assumed; the storage's room).
        trials: runs of ``cfg`` at once on the storage (a sweep's ``sweep.max_concurrent``).
        held: bytes the run's checkpoints hold in the storage already (a resumed run's).
    """
    notes = notes if notes is not None else []
    return (_settings_problems(cfg, notes, trials, held) + _shard_problems(cfg, inputs)
            + _eval_set_problems(cfg, inputs.eval_set) + _word_vector_problems(cfg)
            + _resource_problems(cfg, device_bytes, notes))


def _settings_problems(cfg: Config, notes: list[str], trials: int, held: int) -> list[str]:
    """The model's parts, and the storage: writable, with room for the checkpoints (a model of
    parts its table has)."""
    parts = model_part_problems(cfg)
    problems = parts + _storage_problems(cfg)
    if not parts and not problems:
        from raymcn.train.checkpoints.space import space_problems

        room, said = space_problems(cfg, trials, held)
        problems += room
        notes += said
    return problems


def _resource_problems(cfg: Config, device_bytes: int | None, notes: list[str]) -> list[str]:
    """Per-worker memory (the estimate builds the model: only from parts it has) and the weights
    the run starts from."""
    memory = _memory_problems(cfg, device_bytes, notes) if not model_part_problems(cfg) else []
    return memory + _init_from_problems(cfg)


def checked_plan(cfg: Config, inputs: RunInputs, device_bytes: int | None = None, log=None, *,
                 trials: int = 1, held: int = 0) -> RunPlan:
    """The run's plan over its resolved ``inputs`` (``plan.plan_of``, made here once), after every
    static problem of the config, the inputs and the plan was found: raises ConfigError listing
    them all. ``log`` (e.g. print) gets the notes; ``trials``, ``held``: :func:`static_problems`'."""
    notes: list[str] = []
    try:
        plan, problems = plan_of(cfg, inputs), []
    except ConfigError as e:
        plan, problems = None, list(e.problems)
    problems += static_problems(cfg, inputs, device_bytes, notes, trials=trials, held=held)
    if problems:
        raise ConfigError(problems)
    for note in notes if log else ():
        log(f"preflight: {note}")
    return plan


def resolved_inputs(cfg: Config, settings: list[str] | tuple = (), *, trials: int = 1, held: int = 0) -> RunInputs:
    """The run's inputs (``resolve_inputs``: the embedded default's generated into the cache), once
    ``cfg`` has no problem (``settings``: those its loading found, the wrong keys left at their
    defaults).

    Raises:
        ConfigError: one message naming every problem of the settings and of the input files they
            name (:func:`input_problems`); where the settings are valid but the inputs cannot be
            resolved, also what the storage, the memory and the start weights lack.
    """
    if settings:
        raise ConfigError([*settings, *input_problems(cfg)])
    try:
        return run_inputs.resolve_inputs(cfg)
    except ConfigError as e:
        found = input_problems(cfg) or list(e.problems)
        raise ConfigError([*found, *_settings_problems(cfg, [], trials, held),
                           *_resource_problems(cfg, None, [])]) from None


def input_problems(cfg: Config) -> list[str]:
    """Every problem of the input files ``cfg`` names, read as they are (nothing is generated: the
    embedded default's files are made once the settings are valid): the shard folder, its manifest,
    every listed shard at its recorded size and ``vocab.npy``; the eval set's file; the word vectors."""
    problems = []
    if cfg.data.shards:
        folder = shard_folder(cfg)
        try:
            manifest, _ = shard_manifest(cfg, folder)
            problems += _listed_shard_problems(cfg, folder, [(s["name"], int(s["bytes"])) for s in manifest["shards"]])
        except ConfigError as e:
            problems += e.problems
    kind, _, file = cfg.data.eval_set.partition(":")
    if kind in ("youcook", "msrvtt") and file:  # (another kind is the settings' problem)
        problems += _eval_set_problems(cfg, f"{kind}:{Path(file).expanduser().resolve()}")
    return problems + _word_vector_problems(cfg)


def model_part_problems(cfg: Config) -> list[str]:
    """Every model part the run names, and every one its sweep's space may draw, is a class of the
    model's table (``raymcn/model/parts.py``): the config, left of the model, cannot check that."""
    from raymcn.model.parts import PARTS, name_problem

    found = [p for s in PARTS if (p := name_problem(s, getattr(cfg.model, s)))]
    for key, spec in cfg.sweep.space.items():
        setting = key.removeprefix("model.")
        if key.startswith("model.") and setting in PARTS and isinstance(spec, dict):
            values = next(iter(spec.values()), [])
            found += [f"sweep.space.{key}: {p}" for v in (values if isinstance(values, list) else [])
                      if (p := name_problem(setting, v))]
    return found


def _storage_problems(cfg: Config) -> list[str]:
    """The storage path (a folder or a bucket URI) accepts a file: written, then removed (its room
    for the checkpoints: :func:`_settings_problems`)."""
    from raymcn import storage

    where = storage.normalize(default_storage_path(cfg))
    probe = storage.join(where, f".raymcn-write-test-{os.getpid()}")
    try:
        storage.write_text(probe, "")
        fs, path = storage.filesystem(probe)
        fs.delete_file(path)
    except Exception as e:  # noqa: BLE001 - OSError locally; pyarrow raises OSError/ArrowException for buckets
        return [f"run.storage_path={where!r} is not writable: {reason(e)}"]
    return []


def _shard_problems(cfg: Config, inputs: RunInputs) -> list[str]:
    """The run's shards as its inputs name them (:func:`_listed_shard_problems`); then the sweep's
    rungs against its warm-up."""
    listed = list(zip(inputs.index.shard_names, inputs.shard_bytes))
    return _listed_shard_problems(cfg, Path(inputs.shards_dir), listed) + _rung_problems(cfg, inputs.videos)


def _listed_shard_problems(cfg: Config, root: Path, listed: list[tuple[str, int]]) -> list[str]:
    """Every shard the manifest lists (name, bytes) present in ``root`` with the recorded size, and vocab.npy."""
    where = f"data.shards={cfg.data.shards!r}"
    problems = []
    for name, size in listed:
        path = root / name
        if not path.is_file():
            problems.append(f"{where}: shard {name} listed in the manifest is missing")
        elif path.stat().st_size != size:
            problems.append(f"{where}: shard {name} has {path.stat().st_size} bytes, the manifest "
                            f"says {size} (truncated or rewritten; rerun `raymcn shards`)")
    if not (root / "vocab.npy").is_file():
        problems.append(f"{where}: vocab.npy is missing")
    return problems


# The sweep keys that change how many epochs the warm-up lasts.
_WARMUP_KEYS = ("data.batch_size", "optim.warmup_videos", "optim.warmup_steps", "schedule.steps_per_epoch")


def _rung_problems(cfg: Config, videos: int) -> list[str]:
    """An asha/bohb sweep compares trials at its first rung (``sweep.grace_epochs`` budget epochs
    after the stage switch); every trial must have finished its LR warm-up by then, or the rung
    compares runs at different points of their schedules. Checked for every value (choices, ends of
    ranges) of the swept keys that move the warm-up's end."""
    import itertools

    sw = cfg.sweep
    if sw.algorithm not in ("asha", "bohb"):
        return []
    axes = {k: list(next(iter(sw.space[k].values()))) for k in _WARMUP_KEYS if k in sw.space}
    for combo in itertools.product(*axes.values()):
        trial = cfg.replace(dict(zip(axes, combo))) if axes else cfg
        try:
            plan = make_plan(trial, videos)
        except ConfigError:
            continue  # too few videos for that batch: reported for the trial configs elsewhere
        first_rung = plan.budget_offset + sw.grace_epochs  # epochs trained when the first rung compares
        if plan.warmup_epochs > first_rung:
            where = ", ".join(f"{k}={v}" for k, v in zip(axes, combo))
            return [f"the LR warm-up ({plan.warmup_steps} steps = {plan.warmup_epochs:.3g} epochs"
                    f"{f' for {where}' if where else ''}) ends after the first rung of the {sw.algorithm} sweep "
                    f"(epoch {first_rung}: stage 1 {plan.budget_offset} + sweep.grace_epochs {sw.grace_epochs}), "
                    "which would compare trials still warming up: raise sweep.grace_epochs or lower "
                    "optim.warmup_videos"]
    return []


def _eval_set_problems(cfg: Config, eval_set: str) -> list[str]:
    """The eval set's file (``eval_set``: ``KIND:FILE``, the file absolute) exists and lists clips."""
    kind, _, file = eval_set.partition(":")
    if not Path(file).is_file():
        return [f"data.eval_set={cfg.data.eval_set!r}: file {file} does not exist"]
    from raymcn.data.evalsets import EvalSetError, load_eval_list

    try:
        load_eval_list(Path(file))
    except (EvalSetError, OSError, ValueError) as e:
        return [f"data.eval_set={cfg.data.eval_set!r}: {e}"]
    return []


def _word_vector_problems(cfg: Config) -> list[str]:
    """``data.word_vectors``, when given, is a file (the eval captions' words come from it)."""
    words = cfg.data.word_vectors
    if words and not Path(words).expanduser().is_file():
        return [f"data.word_vectors={words!r}: file {Path(words).expanduser().resolve()} does not exist"]
    return []


def _init_from_problems(cfg: Config) -> list[str]:
    if not cfg.run.init_from and "run.init_from" not in cfg.sweep.space:
        return []
    from raymcn.train.checkpoints import init_from  # imports torch: only when the run starts from weights

    return init_from.problems(cfg)


def _memory_problems(cfg: Config, device_bytes: int | None, notes: list[str]) -> list[str]:
    from raymcn.train.preflight.footprint import fits

    where = ""
    if device_bytes is None:
        device_bytes, where = _device_bytes(cfg)
    if device_bytes is None:  # a GPU run planned on a machine without one (e.g. a CPU head node)
        from raymcn.train.preflight.footprint import estimate_worker_memory, format_estimate

        notes.append(f"GPU memory not checked here: {where or 'this machine sees no GPU'}; each worker checks its own "
                     f"GPU's free memory when it starts (estimate per worker: "
                     f"{format_estimate(estimate_worker_memory(cfg), top=3)})")
        return []
    ok, message, _ = fits(cfg, device_bytes)
    if ok:
        notes.append(f"memory {message}{where}")
    return [] if ok else [message + where]


def _device_bytes(cfg: Config) -> tuple[int | None, str]:
    """One worker's memory and where it was read: the least free memory over this machine's GPUs
    (a worker may land on any of them; another process may hold part of one), read through NVML
    (``gpus.py``: this process opens no CUDA context), or this machine's RAM shared by the workers
    on CPU. (None, "") for a GPU run on a machine that sees no GPU, (None, why) where NVML failed."""
    if cfg.scale.use_gpu:
        from raymcn.train.preflight.gpus import GpuQueryError, visible_gpus

        try:
            gpus = visible_gpus()
        except GpuQueryError as e:
            return None, f"this machine's GPUs could not be read ({e})"
        if not gpus:
            return None, ""
        least = min(gpus, key=lambda g: g.free)
        sharing = max(1, math.floor(1 / cfg.scale.gpus_per_worker + 1e-9))  # workers Ray may place on one GPU
        return least.free // sharing, (f" (free memory of GPU {least.index}, the least free of this machine's "
                                       f"{len(gpus)}, read through NVML" + (f", shared by {sharing} workers"
                                                                           if sharing > 1 else "") + ")")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(1, cfg.scale.max_workers), ""  # as many workers as may share this machine


def device_problems(cfg: Config, device) -> list[str]:
    """The memory check on a worker's own GPU, at its start (the driver may have seen none, or other
    GPUs): the estimate against the free memory of ``device``. [] on CPU."""
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return []
    from raymcn.train.preflight.footprint import fits

    free, total = torch.cuda.mem_get_info(device)  # this worker's context exists by now: it is not free
    ok, message, _ = fits(cfg, free, held=("cuda_context",))
    if ok:
        return []
    return [f"{message} (free memory of {device} on this worker: {free / 2**30:.2f} of {total / 2**30:.2f} GiB)"]
