"""The whole config (:class:`Config`: its eight sections and the values derived from them) and how
one is built: YAML + dotted overrides, every value typed against its field, every section checked
(``checks.py``), then the checks across sections (:func:`validate`). Every problem found is
collected and reported in one :class:`~raymcn.config.errors.ConfigError`.

A run YAML and a sweep YAML are one format: a sweep file adds a ``sweep:`` section on top of the
run keys.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raymcn.config.checks import field_problems, validate_sweep
from raymcn.config.errors import ConfigError
from raymcn.config.names import COLLECTIVE_TIMEOUT_FACTOR, COLLECTIVE_TIMEOUT_MIN_FACTOR, EVAL_SET_KINDS
from raymcn.config.sections import (
    SECTIONS,
    DataConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RunSection,
    ScaleConfig,
    ScheduleConfig,
    SweepConfig,
    all_keys,
    coerce,
    did_you_mean,
    field_types,
    workers_ok,
)


@dataclass(frozen=True)
class Config:
    """A run's (and a sweep's) whole configuration: its eight sections. Build one with
    :func:`load_config`, :meth:`replace` or :meth:`from_dict`: each types and checks every value."""

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


def _apply_overrides(raw: dict[str, dict[str, Any]], overrides: dict[str, Any], problems: list[str]) -> None:
    keys = all_keys()
    for dotted, value in overrides.items():
        section, _, name = dotted.partition(".")
        if section not in SECTIONS or name not in field_types(SECTIONS[section]):
            problems.append(f"unknown key '{dotted}'{did_you_mean(dotted, keys)}")
            continue
        raw.setdefault(section, {})[name] = value


def _build(raw: dict[str, Any], problems: list[str], lenient: bool = False) -> Config:
    """The Config of ``raw``'s sections; ``problems`` gets every unknown key and wrong value, and
    raises ConfigError listing them (``lenient``: returns the config, the bad keys at their
    defaults, for the checks that follow to add their problems to the same message)."""
    sections = {}
    for section, values in raw.items():
        if section not in SECTIONS:
            problems.append(f"unknown section '{section}'{did_you_mean(section, list(SECTIONS))}")
            continue
        if values is None:
            values = {}
        if not isinstance(values, dict):
            problems.append(f"{section}: expected a mapping of keys, got {values!r}")
            continue
        types = field_types(SECTIONS[section])
        kwargs = {}
        for name, value in values.items():
            key = f"{section}.{name}"
            if name not in types:
                problems.append(f"unknown key '{key}'{did_you_mean(key, all_keys())}")
                continue
            coerced = coerce(key, value, types[name], problems)
            if coerced is not None:
                kwargs[name] = coerced
        sections[section] = SECTIONS[section](**kwargs)
    cfg = Config(**sections)
    problems.extend(validate(cfg))
    if problems and not lenient:
        raise ConfigError(problems)
    return cfg


def validate(cfg: Config) -> list[str]:
    """Bounds of every field, then the cross-field checks; returns the problems (empty when valid)."""
    p = [msg for name in SECTIONS if name != "sweep" for msg in field_problems(name, getattr(cfg, name))]

    def need(ok: bool, msg: str) -> None:
        if not ok:
            p.append(msg)

    d, lo, sc = cfg.data, cfg.loss, cfg.scale
    if d.batch_size >= 1 and workers_ok(sc.num_workers):
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
    need(sc.use_gpu is False or (workers_ok(sc.num_workers) and sc.min_workers >= 1),
         "scale.use_gpu=true needs scale.num_workers >= 1 (one worker per GPU)")
    # Workers sharing a GPU talk over gloo (NCCL cannot join two ranks on one GPU), and torch's gloo
    # has no send/recv for CUDA tensors (torch.distributed's table of backends), which the ring uses.
    need(not (sc.ring_contrastive and sc.use_gpu and sc.gpus_per_worker < 1),
         f"scale.ring_contrastive=true with scale.gpus_per_worker={sc.gpus_per_worker:g}: workers that share a GPU "
         "talk over gloo, which cannot send CUDA tensors from rank to rank as the ring does; turn the ring off, or "
         "give each worker a GPU of its own (scale.gpus_per_worker=1)")
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
    cfg, problems = load_config_lenient(path, overrides)
    if problems:
        raise ConfigError(problems)
    return cfg


def load_config_lenient(path: str | os.PathLike | None = None,
                        overrides: list[str] | dict[str, Any] | None = None) -> tuple[Config, list[str]]:
    """:func:`load_config`'s config and its problems, without raising for them: every key that
    loaded (an unknown key left out, a value of the wrong type at its default), so that the checks
    after it (the input files it names) add theirs to one message.

    Raises:
        ConfigError: the file is missing or is not a YAML mapping (nothing to build).
    """
    if path is None:
        text, source = "", "the config"
    else:
        try:
            text, source = Path(path).expanduser().read_text(), str(path)
        except FileNotFoundError:
            raise ConfigError([f"config file {path} does not exist"]) from None
    problems: list[str] = []
    return _build(_raw(text, overrides, source, problems), problems, lenient=True), problems


def load_config_text(text: str, overrides: list[str] | dict[str, Any] | None = None,
                     source: str = "the config") -> Config:
    """:func:`load_config` of YAML ``text`` (read from ``source``, named in error messages)."""
    problems: list[str] = []
    return _build(_raw(text, overrides, source, problems), problems)


def _raw(text: str, overrides: list[str] | dict[str, Any] | None, source: str, problems: list[str]) -> dict:
    """The sections of YAML ``text`` with the dotted ``overrides`` applied; ``problems`` gets the
    unknown keys and unreadable overrides. Raises ConfigError when ``text`` is no YAML mapping."""
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
    return raw


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


def default_storage_path(cfg: Config) -> str:
    """Where runs and sweeps are written: a path (``~`` allowed) or a URI such as ``s3://bucket/prefix``."""
    return cfg.run.storage_path or os.environ.get("RAYMCN_RESULTS") or str(Path.home() / "raymcn_results")
