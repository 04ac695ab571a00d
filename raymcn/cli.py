"""Command line: ``raymcn train | sweep | doctor | config | synth | shards | eval | import-original | table |
reproduce | watch | boot | drain``.

Every command is ``main(argv) -> int`` so tests call it in-process. Configuration problems exit
with status 2 before Ray starts; with ``--json`` the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from raymcn.config import (
    CONSOLE_LOG_FILE,
    SWEEP_CONFIG_FILE,
    Config,
    ConfigError,
    RayUnavailable,
    load_config_lenient,
    preset_path,
)
from raymcn.environment import Environment
from raymcn.train.monitor.console import Console, console_log, final_summary
from raymcn.train.preflight import checks as preflight

LATEST = "latest"  # --resume latest


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="run or sweep YAML (default: the embedded tiny synthetic preset)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. --set optim.lr=3e-4 (repeatable)")
    p.add_argument("--num-workers", metavar="N|MIN-MAX",
                   help="shortcut for --set scale.num_workers=N (MIN-MAX: an elastic group)")
    p.add_argument("--json", action="store_true", help="print the final metrics as one JSON line last")
    p.add_argument("--address", help="the Ray instance to join: HOST:PORT, or auto (the one running on this machine: "
                   "a cluster's server, where ~/.raymcn_env sets RAY_ADDRESS=auto); default: RAY_ADDRESS, else a new "
                   "local instance of this command's own (never one already running here)")
    p.add_argument("--init-from", metavar="DIR", help="start from the model weights of this checkpoint (e.g. from "
                   "`raymcn import-original`) with a fresh optimizer and schedule; = --set run.init_from=DIR")
    p.add_argument("--verbose", action="store_true", help="show everything Ray prints (by default it goes to "
                   f"{CONSOLE_LOG_FILE} in the run's or sweep's folder; errors are always shown)")
    _add_rehearse_arg(p)


def _add_rehearse_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rehearse", action="store_true", help="the config in miniature, in minutes on this machine's "
                   "CPUs: the synthetic corpus (unless --set names data.shards, data.eval_set or data.word_vectors), "
                   "tiny sizes, fewer epochs and trials; its algorithm, scheduler, stage split, swept keys and "
                   "confirmation kept (raymcn/sweep/rehearsal.py says what changes)")


def resolve_config(args: argparse.Namespace) -> Config:
    cfg, problems = loaded_config(args)
    if problems:
        raise ConfigError(problems)
    return cfg


def loaded_config(args: argparse.Namespace) -> tuple[Config, list[str]]:
    """The command line's config and its problems (``load_config_lenient``), for the preflight to add its own."""
    overrides = list(args.overrides)
    if args.num_workers is not None:
        overrides.append(f"scale.num_workers={args.num_workers}")
    if args.init_from:
        overrides.append(f"run.init_from={args.init_from}")
    cfg, problems = load_config_lenient(args.config or preset_path(), overrides)
    if problems:
        return cfg, problems
    if getattr(args, "rehearse", False):  # the command line's own inputs kept (a practice run on one's shards)
        from raymcn.config import parse_override
        from raymcn.sweep.rehearsal import shrink

        cfg = shrink(cfg, cpus=os.cpu_count() or 1, inputs=dict(parse_override(o) for o in args.overrides))
    if cfg.run.init_from:  # workers may run elsewhere: give them this shell's meaning of a relative path
        cfg = cfg.replace({"run.init_from": str(Path(cfg.run.init_from).expanduser().resolve())})
    return cfg, []


def _has_sweep_section(path: str | None) -> bool:
    import yaml

    if not path or not Path(path).exists():
        return False
    loaded = yaml.safe_load(Path(path).read_text())
    return isinstance(loaded, dict) and "sweep" in loaded


def ray_session(address: str | None, env: Environment, say=print):
    """Ray for one command (``on_ray/cluster.ray_session``): connected, or a local instance this
    command starts and shuts down; yields whether it started one. The command's ``RAYMCN_*``
    settings (``env``) reach every process of its job; ``say`` shows which instance and why."""
    from raymcn.train.on_ray.cluster import ray_session as session

    return session(address, env.variables(), say=say)


def _resource_waits_named(cfg: Config, console):
    """A worker group Ray cannot place is named on the console (``on_ray/waits.py``)."""
    from raymcn.train.on_ray import waits

    return waits.watched(waits.naming_limit_s(cfg.run.stall_timeout_s, cfg.scale.worker_start_timeout_s), console.say)


def _say_capped_steps(cfg: Config, plan) -> None:
    """A ``schedule.steps_per_epoch`` above what the corpus fills is named, with what the run takes."""
    from raymcn.train.run_plan import capped_steps_note

    if note := capped_steps_note(cfg, plan):
        print(f"note: {note}")


def _check_cluster(cfg: Config) -> None:
    """The requested workers and GPUs exist (Ray would otherwise wait for them forever)."""
    from raymcn.train.on_ray.cluster import cluster_problems

    problems = cluster_problems(cfg)
    if problems:
        raise ConfigError(problems)


def _resume_target(args: argparse.Namespace, latest) -> str | None:
    """``--resume DIR`` as given, or for ``--resume latest`` the newest run or sweep under the
    storage path of the given config (or the embedded default's, i.e. $RAYMCN_RESULTS) that a boot
    would continue (``latest``: the config -> the folder and the line naming it and the newer ones
    skipped), said."""
    if args.resume != LATEST:
        return args.resume
    found, said = latest(resolve_config(args))
    print(f"resuming the latest: {said}")
    return found


def _failed(command: str, error: BaseException, resume_hint: str, explain=str) -> int:
    """A run that failed: what happened, and (unless a restart cannot cure it) how to resume; status 1.
    ``explain``: a storage error's message for a person (``space.explained``)."""
    from raymcn.config import doctor_hint, is_storage_error, permanent_cause

    cause = permanent_cause(error)
    if isinstance(error, RayUnavailable):
        print(f"raymcn {command}: nothing ran: {error}", file=sys.stderr)
    elif is_storage_error(cause):  # no restart makes room; once there is room, it resumes
        print(f"raymcn {command}: stopped at once, not retried (its storage cannot take what it writes): "
              f"{explain(cause)}\n{resume_hint}", file=sys.stderr)
    elif cause is not None:
        hint = doctor_hint(cause)
        print(f"raymcn {command}: the run failed and was not retried (a restart cannot cure this): "
              f"{type(cause).__name__}: {cause}" + (f"\n({hint})" if hint else ""), file=sys.stderr)
    else:
        print(f"raymcn {command}: the run failed after its restarts (scale.max_failures): "
              f"{type(error).__name__}: {error}\n"
              f"{resume_hint}", file=sys.stderr)
    return 1


def cmd_train(args: argparse.Namespace) -> int:
    """One run: its folder decided and its inputs resolved here, once; the preflight and the
    trainer receive its one plan."""
    from raymcn.train import run_record
    from raymcn.train.on_ray import launch

    if args.resume:
        run_dir = _resume_target(args, launch.latest_run_dir)
        cfg, problems = launch.saved_config(run_dir, args.overrides), []
    else:
        cfg, problems = loaded_config(args)
        if _has_sweep_section(args.config):
            print(f"note: {args.config} has a sweep section; `train` uses only the run keys and ignores it")
        run_dir = launch.new_run_dir(cfg)  # named here so an interruption can say where it is
    # The embedded default is generated here, once; everything that can be checked before Ray
    # starts is reported at once, and the plan the preflight made is the trainer's.
    held = launch.checkpoints_held(run_dir) if args.resume else 0
    inputs = preflight.resolved_inputs(cfg, problems, held=held)
    entry = run_record.driver_entry(cfg, inputs)  # a resume on other code, environment or data says so first
    for line in run_record.notes(run_dir, entry, "run"):
        print(line)
    plan = preflight.checked_plan(cfg, inputs, log=print, held=held)
    _say_capped_steps(cfg, plan)
    if args.rehearse and not args.resume:
        from raymcn.servers import sweeps as marks

        marks.mark_rehearsal(run_dir)  # never what `--resume latest` continues
    log = console_log(run_dir, cfg)
    try:
        # The console owns the terminal only while Ray runs; errors are printed after it let go.
        with Console(log, verbose=args.verbose, show_tagged=True) as console:
            console.say(f"run {run_dir} (Ray's output: {log})")
            # in-process (0 workers) runs need no Ray; a local instance's shutdown flushes the workers' logs
            with ray_session(args.address, args.env, console.say) if cfg.scale.max_workers > 0 else contextlib.nullcontext(False) as started:
                if started and not args.resume:
                    _check_cluster(cfg)
                with _resource_waits_named(cfg, console) if cfg.scale.max_workers > 0 else contextlib.nullcontext():
                    result = launch.fit(cfg, run_dir, plan=plan, env=args.env, entry=entry)
    except KeyboardInterrupt:
        print(f"\ninterrupted: checkpoints up to the last finished epoch are kept in {run_dir}\n"
              f"resume with: raymcn train --resume {run_dir}", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - reported, with how to go on
        from raymcn.train.checkpoints import space

        return _failed("train", e, f"checkpoints up to the last finished epoch are kept in {run_dir}\n"
                                   f"resume with: raymcn train --resume {run_dir}\nRay's output: {log}",
                       explain=lambda cause: space.explained(cause, run_dir, cfg))
    summary = final_summary(result.metrics, result.run_dir)
    print("\nfinal metrics (" + str(result.run_dir) + "):")
    for k, v in summary.items():
        print(f"  {k:32s} {v}")
    print(f"resume or extend with: raymcn train --resume {result.run_dir}")
    if args.json:
        print(json.dumps(summary), flush=True)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    """A sweep: the search, then (``sweep.confirm``) its confirmation; ``--resume`` continues
    whichever phase was interrupted, ``--confirm EXP`` confirms a finished search."""
    from raymcn import phases, storage
    from raymcn.config import default_storage_path
    from raymcn.provenance import record
    from raymcn.servers import sweeps as marks
    from raymcn.sweep import tuner
    from raymcn.train import run_record

    if args.stop:
        return _stop_sweep(args)
    if args.resume and args.confirm:
        raise ConfigError(["--resume and --confirm: give one (--resume also continues a confirmation)"])
    resume = _resume_target(args, lambda c: marks.latest_sweep(default_storage_path(c))) if args.resume else None
    existing = resume or (storage.normalize(args.confirm) if args.confirm else None)
    cfg, problems = ((tuner.sweep_config(resume, "--resume"), []) if resume else
                     (_confirm_config(args, existing), []) if existing else loaded_config(args))
    if resume and (note := resume_differences(args, cfg, resume)):
        print(note, file=sys.stderr)
    if not cfg.sweep.space and not existing:
        problems = [*problems, f"{args.config or preset_path()}: the sweep section has an empty space"]
    trials = cfg.sweep.max_concurrent  # each with its checkpoints on the storage
    inputs = preflight.resolved_inputs(cfg, problems, trials=trials)  # once, for every trial of both phases
    if not resume:  # each trial plans from the inputs
        _say_capped_steps(cfg, preflight.checked_plan(cfg, inputs, log=print, trials=trials))
    exp_dir = existing or tuner.default_experiment_dir(cfg)
    entry = run_record.driver_entry(cfg, inputs)  # a resume on other code, environment or data says so first
    for line in run_record.notes(exp_dir, entry, "sweep"):
        print(line)
    if existing:
        marks.clear_marks(existing)  # running again: unfinished until it ends, and no longer stopped
    elif args.rehearse:
        marks.mark_rehearsal(exp_dir)  # never what a boot or `--resume latest` continues
    log = console_log(exp_dir, cfg)
    try:
        with Console(log, verbose=args.verbose) as console:
            what = (f"sweep {exp_dir}:\n  {phases.describe(cfg)}" if not existing else
                    f"{'resuming' if resume else 'confirming'} sweep {exp_dir}")
            console.say(f"{what}\nRay's output: {log}")
            with ray_session(args.address, args.env, console.say), _resource_waits_named(cfg, console):
                if not resume:
                    _check_cluster(cfg)
                # in the sweep's record before its trials start: each carries the commit and patch from it
                record.append(exp_dir, entry, "resume" if resume else "confirm" if existing else "start")
                if resume:
                    result = phases.resume(resume, console, inputs, env=args.env)
                elif existing:
                    result = phases.confirm(cfg, existing, console, inputs, env=args.env)
                else:
                    result = phases.search_then_confirm(cfg, exp_dir, console, inputs, env=args.env)
    except KeyboardInterrupt:
        result = None
    except Exception as e:  # noqa: BLE001 - a storage the driver itself cannot write to is named; others raise
        from raymcn.config import storage_cause
        from raymcn.train.checkpoints import space

        if storage_cause(e) is None:
            raise
        return _failed("sweep", e, f"resume with: raymcn sweep --resume {exp_dir}",
                       explain=lambda cause: space.explained(cause, exp_dir, cfg))
    if result is None or result.num_unfinished:
        # Tune saves the experiment state on Ctrl-C; finished trials are kept, the others resume.
        print(f"\nsweep {'stopped' if result and result.stopped else 'interrupted'}; resume with: "
              f"raymcn sweep --resume {exp_dir}", file=sys.stderr)
        if result is None or result.stopped:
            return 130 if result is None else 1
    print()
    print(phases.summary(exp_dir), end="")
    if not result.num_unfinished:
        marks.mark_finished(exp_dir)  # a boot never continues it (servers/sweeps.py)
    if args.json:
        print(json.dumps({"experiment_dir": str(exp_dir), "best_config": result.best_config,
                          "best_metrics": result.best_metrics}, default=str), flush=True)
    return 0


def resume_differences(args: argparse.Namespace, saved: Config, exp_dir: str) -> str | None:
    """What ``raymcn sweep --resume EXP`` says when the sweep file (and ``--set``) given with it resolve
    to another config than the one the sweep saved (``EXP/raymcn_sweep.yaml``), naming every key that
    differs; None when they agree or nothing was given. A restored sweep runs its saved copy: Tune
    restores the trials and the search with the settings they started with."""
    from raymcn import storage

    if not (args.config or args.overrides or args.num_workers is not None):
        return None
    differences = resolve_config(args).differences(saved)
    if not differences:
        return None

    def shown(value) -> str:
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."

    given = " and ".join(filter(None, [args.config, "--set" if args.overrides else "",
                                       "--num-workers" if args.num_workers is not None else ""]))
    keys = "; ".join(f"{k}: {shown(a)} given, {shown(b)} saved" for k, (a, b) in differences.items())
    return (f"raymcn sweep --resume: the settings given ({given}) differ from the sweep's saved copy "
            f"({storage.join(exp_dir, SWEEP_CONFIG_FILE)}) in {len(differences)} key(s): {keys}. "
            f"The resumed sweep runs its saved copy; to run the changed file, start a new sweep.")


def _stop_sweep(args: argparse.Namespace) -> int:
    """``--stop EXP|latest``: mark the sweep as stopped on purpose, so that a boot never continues it
    (``latest``: the newest sweep neither finished, stopped nor a rehearsal: the one a boot would continue)."""
    from raymcn import storage
    from raymcn.config import SWEEP_CONFIG_FILE, default_storage_path
    from raymcn.servers import sweeps as marks

    if args.resume or args.confirm:
        raise ConfigError(["--stop marks a sweep; --resume and --confirm run one: give one of them"])
    if args.stop == LATEST:
        location = default_storage_path(resolve_config(args))
        unfinished = marks.unfinished_sweeps(location)
        if not unfinished:
            raise ConfigError([f"--stop latest: no sweep under {location} is unfinished and not stopped"])
        target = unfinished[0]
    else:
        target = storage.normalize(args.stop)
        if SWEEP_CONFIG_FILE not in storage.files(target):
            raise ConfigError([f"--stop {args.stop}: no {SWEEP_CONFIG_FILE} there; is it a raymcn sweep?"])
    marks.mark_stopped(target)
    print(f"sweep {target} marked as stopped on purpose: a boot of the cluster never continues it "
          f"(a running driver goes on until Ctrl-C in its tmux session).\n"
          f"continue it by hand with: raymcn sweep --resume {target} (that clears the mark)")
    return 0


def _confirm_config(args: argparse.Namespace, experiment_dir: str) -> Config:
    """``--confirm EXP``: the sweep's own config, with the command line's ``--set`` on top."""
    from raymcn.config import parse_override
    from raymcn.sweep import tuner

    cfg = tuner.sweep_config(experiment_dir, "--confirm")
    return cfg.replace(dict(parse_override(o) for o in args.overrides)) if args.overrides else cfg


def cmd_table(args: argparse.Namespace) -> int:
    """``raymcn table EXP``: EXP may be a bucket URI, read through a local copy in the cache."""
    from raymcn import storage
    from raymcn.config import default_cache_dir
    from raymcn.results import table

    if storage.is_uri(args.experiment_dir):
        cache = default_cache_dir(Config()) / "experiments"
        args.experiment_dir = str(storage.local_copy(args.experiment_dir, cache, skip=storage.CHECKPOINTS))
        print(f"(a local copy of the experiment: {args.experiment_dir})", file=sys.stderr)
    return table.run_table(args)


def cmd_shards(args: argparse.Namespace) -> int:
    """``raymcn shards``: local processes, or with ``--ray`` Ray actors on every node of a cluster."""
    from raymcn.data import commands

    if args.ray is None or args.dry_run:
        return commands.run_shards(args)
    from raymcn.data.write.ray_writers import RayWriters

    with ray_session(args.ray or None, args.env):
        return commands.run_shards(args, writer=RayWriters(args.workers or 0))


def cmd_eval(args: argparse.Namespace) -> int:
    """Zero-shot retrieval of a checkpoint (``train/evaluate.py``, imported here: it needs torch)."""
    from raymcn.train import evaluate

    return evaluate.run(args)


DESCRIPTION = ("raymcn: train the Multimodal Clustering Network (video, audio and text in one space) with DDP "
               "on Ray Train, sweep it with Ray Tune, and answer which modality-stage order learns best.")
EPILOG = ("The lab's path (docs/lab-guide.md): raymcn shards (features -> shards), raymcn doctor (every node "
          "checked, the sweep's duration), raymcn sweep (the stage-order question), raymcn table (the answer). "
          "`raymcn COMMAND --help` for each.")


def cmd_config(args: argparse.Namespace) -> int:
    if args.reference:
        from raymcn.model.parts import part_names
        from raymcn.reference import reference

        print(reference(part_names()), end="")
        return 0
    args.num_workers = args.init_from = None
    print(resolve_config(args).dump_text(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raymcn", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    p = sub.add_parser("train", help="train one MCN run on Ray Train")
    _add_config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR (a path or URI) from its latest "
                   "checkpoint; 'latest': the newest run under the storage path neither finished nor a rehearsal")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("sweep", help="sweep hyper-parameters with Ray Tune (each trial a Ray Train run)")
    _add_config_args(p)
    p.add_argument("--resume", metavar="EXPERIMENT_DIR", help="restore an interrupted sweep (a path or URI), "
                   "its search or its confirmation; 'latest': the newest sweep under the storage path neither "
                   "finished, stopped nor a rehearsal (the one a boot continues)")
    p.add_argument("--confirm", metavar="EXPERIMENT_DIR", help="confirm a finished search: its best configuration "
                   "per stage order (or sweep.confirm's per/top) over fresh seeds at the full budget, into the "
                   "same folder")
    p.add_argument("--stop", metavar="EXPERIMENT_DIR", help="mark a sweep as stopped on purpose: a boot of the "
                   "cluster (raymcn boot) never continues it; 'latest': the newest sweep neither finished, stopped nor "
                   "a rehearsal")
    p.set_defaults(func=cmd_sweep)
    from raymcn.doctor import checkup as doctor
    from raymcn.doctor import command

    p = sub.add_parser("doctor", help="check every node of the Ray cluster for a config before a sweep, and "
                       "estimate the sweep's duration")
    doctor.add_arguments(p)
    p.set_defaults(func=command.run)
    p = sub.add_parser("config", help="print the resolved configuration of a run, or every setting (--reference)")
    p.add_argument("--config", help="run or sweep YAML (default: the embedded tiny synthetic preset)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. --set optim.lr=3e-4 (repeatable)")
    p.add_argument("--reference", action="store_true",
                   help="every key with its default, bounds and meaning, as Markdown (docs/settings.md)")
    _add_rehearse_arg(p)
    p.set_defaults(func=cmd_config)
    _add_data_and_results_commands(sub)
    _add_server_commands(sub)
    return parser


def _add_server_commands(sub) -> None:
    """The lab's servers: Ray and the unfinished sweep after a boot, a node drained before a reboot."""
    from raymcn.servers import boot, drain

    p = sub.add_parser("boot", help="after a server boots: Ray as `ray up` started it, and on the head the newest "
                       "unfinished sweep (the opt-in service of cluster.yaml; --install, --unit, --record)")
    boot.add_arguments(p)
    p.set_defaults(func=boot.run)
    p = sub.add_parser("drain", help="before a planned reboot: drain this server's Ray node, wait for its Ray Train "
                       "workers to checkpoint and leave (or the deadline), then --reboot")
    drain.add_arguments(p)
    p.set_defaults(func=drain.run)


def _add_data_and_results_commands(sub) -> None:
    """The commands around runs: corpora and shards, evaluation, the original's weights, results."""
    from raymcn.data import commands
    from raymcn.results import table

    p = sub.add_parser("synth", help="write a synthetic corpus in the original HowTo100M feature layout")
    commands.add_synth_arguments(p)
    p.set_defaults(func=commands.run_synth)
    p = sub.add_parser("shards", help="convert the original feature layout into shuffled tar shards")
    commands.add_shards_arguments(p)
    p.set_defaults(func=cmd_shards)
    p = sub.add_parser("eval", help="zero-shot text-to-video retrieval of a checkpoint")
    p.add_argument("--checkpoint", required=True, help="a checkpoint directory (or its state.pt)")
    p.add_argument("--eval-set", help="synthetic | youcook:FILE | msrvtt:FILE (default: the run's)")
    p.add_argument("--word-vectors", help="word2vec .bin for the eval captions (default: the shards' vocabulary)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to score (auto: the GPU if there is one, in bf16; cpu: fp32)")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON line last")
    p.set_defaults(func=cmd_eval)
    from raymcn.train.checkpoints import importer

    p = sub.add_parser("import-original", help=importer.HELP)
    importer.add_arguments(p)
    p.set_defaults(func=importer.run)
    p = sub.add_parser("table", help="results table and plots of a finished or running sweep")
    table.add_table_arguments(p)
    p.set_defaults(func=cmd_table)
    from raymcn import reproduce

    p = sub.add_parser("reproduce", help=reproduce.HELP)
    reproduce.add_arguments(p)
    p.set_defaults(func=reproduce.run)
    from raymcn.results import watch

    p = sub.add_parser("watch", help="live view of a sweep: table, statistics and plots refreshed every few seconds")
    watch.add_watch_arguments(p)
    p.set_defaults(func=watch.run_watch)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.env = Environment.read()  # the process's RAYMCN_* settings, read once here and passed down
    from raymcn.train.monitor import timeline

    timeline.start(args.env.timeline)
    if getattr(args, "resume", None) and getattr(args, "init_from", None):
        print(f"raymcn {args.command}: --init-from starts a new run; --resume continues one from its own "
              "checkpoint. Use one of them.", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"raymcn {args.command}: {e}", file=sys.stderr)
        return 2
    except RayUnavailable as e:
        print(f"raymcn {args.command}: nothing ran: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
