"""``raymcn doctor``: every node checked for a config before a sweep (``checkup.py``), and with
``--rehearse`` the sweep file in miniature on the connected cluster (``rehearse.py``)."""

from __future__ import annotations

import argparse
import json

from raymcn.config import Config, ConfigError, load_config, preset_path
from raymcn.doctor import checkup
from raymcn.train.monitor.console import Console, console_log
from raymcn.train.preflight import checks as preflight


def run(args: argparse.Namespace) -> int:
    """The command: the table of every node's checks; status 1 when a check fails."""
    from raymcn.train.on_ray.cluster import ray_session

    cfg = load_config(args.config or preset_path(), args.overrides)
    problems = preflight.model_part_problems(cfg)  # before Ray: the model itself is built on every node
    if problems:
        raise ConfigError(problems)
    with ray_session(args.address, args.env.variables()):
        report = checkup.diagnose(cfg, step=args.step, step_time=args.step_time, step_timeout=args.step_timeout,
                                  trial_overhead_s=args.trial_overhead, venv=args.env.venv)
        if args.rehearse:
            _rehearse(cfg, report, args.verbose)
    print(checkup.render(report, cfg.scale.use_gpu))
    if args.json:
        print(json.dumps(checkup.as_json(report)), flush=True)
    return 1 if checkup.failed(report) else 0


def _rehearse(cfg: Config, report: dict, verbose: bool) -> None:
    """``doctor --rehearse``: the sweep file in miniature on the connected cluster, its lines on
    the console as a sweep's, its rows into the report's head column (``doctor/rehearse.py``)."""
    import ray

    from raymcn import phases
    from raymcn.doctor import rehearse

    mini, where = rehearse.miniature(cfg, cpus=ray.cluster_resources().get("CPU", 1.0))
    log = console_log(where, mini)
    with Console(log, verbose=verbose) as console:
        console.say(f"rehearsal {where}:\n  {phases.describe(mini)}\nRay's output: {log}")
        rows = rehearse.rehearse(mini, where, console)
    rehearse.rows_in_head_column(report, rows)
