"""Preflight: every check that can fail a long run, done before Ray starts and reported together.

It runs on the run's plan (``run_plan.py``: the config's inputs resolved, the counts derived), the one
the trainer then receives. ``static_problems`` needs no Ray (the config is validated when it is
loaded): the model's parts named in its table (``raymcn/model/parts.py``, which the config cannot
read), output folder writable, every shard the manifest lists present at its size, the
vocabulary, the eval-set file, per-worker memory, the weights a run starts from
(``run.init_from``). The cluster's CPUs and GPUs are checked right after ``ray.init`` by
``on_ray/cluster.py``; every node's view, before a sweep, by ``raymcn doctor``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from raymcn.config import Config, ConfigError, default_storage_path, reason
from raymcn.train.inputs import RunInputs
from raymcn.train.run_plan import RunPlan, make_plan, plan_of


def static_problems(cfg: Config, inputs: RunInputs, device_bytes: int | None = None,
                    notes: list[str] | None = None) -> list[str]:
    """Problems found without starting Ray (empty list when the run can start).

    Args:
        inputs: the run's inputs, resolved (``train/inputs.py``).
        device_bytes: memory of one worker's device; default: this machine's RAM divided by the
            workers on CPU, or the local GPU's memory when ``scale.use_gpu`` and a GPU is visible.
        notes: if given, receives what the checks found that is not a problem (the memory estimate
            of a run that fits, with the convolution kernel path it assumed).
    """
    parts = model_part_problems(cfg)
    problems = parts + _storage_problems(cfg)
    problems += _shard_problems(cfg, inputs)
    problems += _eval_set_problems(cfg, inputs)
    if not parts:  # the memory estimate builds the model: only from parts it has
        problems += _memory_problems(cfg, device_bytes, notes if notes is not None else [])
    problems += _init_from_problems(cfg)
    return problems


def checked_plan(cfg: Config, inputs: RunInputs, device_bytes: int | None = None, log=None) -> RunPlan:
    """The run's plan over its resolved ``inputs`` (``plan.plan_of``, made here once), after every
    static problem of the config, the inputs and the plan was found: raises ConfigError listing
    them all. ``log`` (e.g. print) gets the notes."""
    notes: list[str] = []
    try:
        plan, problems = plan_of(cfg, inputs), []
    except ConfigError as e:
        plan, problems = None, list(e.problems)
    problems += static_problems(cfg, inputs, device_bytes, notes)
    if problems:
        raise ConfigError(problems)
    for note in notes if log else ():
        log(f"preflight: {note}")
    return plan


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
    """The storage path (a folder or a bucket URI) accepts a file: written, then removed."""
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
    """The run's shards as its inputs name them: every shard the manifest lists present with the
    recorded size, and vocab.npy; then the sweep's rungs against its warm-up."""
    where = f"data.shards={cfg.data.shards!r}"
    root = Path(inputs.shards_dir)
    problems = []
    for name, size in zip(inputs.index.shard_names, inputs.shard_bytes):
        path = root / name
        if not path.is_file():
            problems.append(f"{where}: shard {name} listed in the manifest is missing")
        elif path.stat().st_size != size:
            problems.append(f"{where}: shard {name} has {path.stat().st_size} bytes, the manifest "
                            f"says {size} (truncated or rewritten; rerun `raymcn shards`)")
    if not (root / "vocab.npy").is_file():
        problems.append(f"{where}: vocab.npy is missing")
    return problems + _rung_problems(cfg, inputs.videos)


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


def _eval_set_problems(cfg: Config, inputs: RunInputs) -> list[str]:
    kind, _, file = inputs.eval_set.partition(":")
    if not Path(file).is_file():
        return [f"data.eval_set={cfg.data.eval_set!r}: file {file} does not exist"]
    from raymcn.data.evalsets import EvalSetError, load_eval_list

    try:
        load_eval_list(Path(file))
    except (EvalSetError, OSError, ValueError) as e:
        return [f"data.eval_set={cfg.data.eval_set!r}: {e}"]
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
