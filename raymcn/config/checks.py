"""The checks of one section: every field against the bounds its :func:`~raymcn.config.sections.setting`
declares, and the ``sweep:`` section's search space and confirmation. (The checks across sections
run where a whole config is built: ``loading.validate``.)"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from raymcn.config.names import SEARCH_DOMAINS
from raymcn.config.sections import SECTIONS, SweepConfig, all_keys, allowed_values, coerce, did_you_mean, field_types


def _num(x: float) -> str:
    return f"{x:g}"


def _bound_problem(key: str, value: Any, meta: dict[str, Any]) -> str | None:
    """The message for ``value`` against the bounds declared at its field (None when it is in them)."""
    shown = list(value) if isinstance(value, tuple) else value
    choices = allowed_values(meta)
    if choices is not None and value not in choices:
        return f"{key}={value!r}: allowed values are {', '.join(map(str, choices))}"
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



def validate_sweep(sw: SweepConfig) -> list[str]:
    """Checks of the ``sweep:`` section: its fields' bounds and every search-space entry."""
    p = field_problems("sweep", sw)
    keys = [k for k in all_keys() if not k.startswith("sweep.")]
    types = {f"{s}.{k}": t for s, cls in SECTIONS.items() for k, t in field_types(cls).items()}
    for key, spec in sw.space.items():
        where = f"sweep.space.{key}"
        if key not in keys:
            p.append(f"{where}: unknown key '{key}'{did_you_mean(key, keys)}")
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
            coerce(key, v, types[key], sub)
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


