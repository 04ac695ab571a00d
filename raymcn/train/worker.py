"""The Ray side of training: ``train_func_per_worker`` runs once on every Ray Train worker.

One worker per GPU (or per CPU slot). It assembles the run (``build.assemble``, the same assembly
the benchmarks use) and plugs Ray into the epoch loop's hooks: this rank's batches from its own
Ray Data stream, the evaluation, a checkpoint and ``ray.train.report`` after every epoch and every
``run.checkpoint_every`` inside one (every rank reports each time), and the in-epoch progress.
"""

from __future__ import annotations

import functools
import secrets
import tempfile
from typing import Any

import ray.train
import ray.train.torch
import torch

from raymcn.config import METRICS_FILE, MID_EPOCH_KEY, PRIMARY_METRIC, Config, ConfigError
from raymcn.data import reader
from raymcn.data.evalsets import load_eval_set
from raymcn.losses import Collectives
from raymcn.train import checkpoint, faults, history, init_from, preflight, trackers
from raymcn.train.build import EpochHooks, Run, assemble, run_epochs
from raymcn.train.console import ALERT_TAG, PROGRESS_TAG, epoch_line, tagged
from raymcn.train.loop import evaluate, fold_progress
from raymcn.train.plan import RunPlan
from raymcn.train.progress import Progress, read_mark
from raymcn.train.watchdog import Watchdog

MID_EPOCH_SCORE = -1.0  # the primary metric a mid-epoch checkpoint reports


def train_func_per_worker(loop_config: dict[str, Any]) -> dict[str, float]:
    """Train MCN for the plan's epochs; returns the last epoch's metrics.

    ``loop_config``: ``config`` (a resolved ``Config.to_dict()``), ``plan`` (``RunPlan.to_dict()``,
    made on the driver), ``index`` (the shards' ``order.VideoIndex``), ``run_dir`` (where the
    progress marker goes) and ``label`` (names the run's progress lines in a sweep).
    """
    cfg, plan = Config.from_dict(loop_config["config"]), RunPlan.from_dict(loop_config["plan"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if not (plan.min_workers <= world <= max(1, plan.max_workers)):
        raise RuntimeError(f"Ray Train started {world} workers, outside scale.num_workers "
                           f"[{plan.min_workers}, {plan.max_workers}]")
    device = ray.train.torch.get_device()
    problems = preflight.device_problems(cfg, device)  # this worker's own GPU (the driver may see none)
    if problems:
        raise ConfigError(problems)
    log = print if rank == 0 else None  # progress lines: the console log (shown with --verbose)
    # Lines for the terminal (train/console.py): rank 0 only, marked; the driver shows each once.
    say = (lambda line: print(tagged(line), flush=True)) if rank == 0 else None

    # [1] Data: this rank's part of every step, read by its own Ray Data stream (the steps' videos
    # are fixed by seed, epoch and step: the same at any world size and after any restart).
    stream = reader.RankStream(plan.shards_dir, loop_config["index"], cfg, rank, world,
                               steps_per_epoch=plan.steps_per_epoch, epochs=plan.epochs,
                               node_id=ray.get_runtime_context().get_node_id())
    eval_set = load_eval_set(cfg.data.eval_set, word_vectors=cfg.data.word_vectors or (
                                 None if cfg.data.eval_set == "synthetic" else _vocab(plan.shards_dir)),
                             max_words=cfg.data.max_words, audio_frames_override=cfg.data.eval_audio_frames, cfg=cfg)
    if say and eval_set.note:
        say(eval_set.note)

    # [2] The run, its model wrapped in DDP. Staged orders leave a branch without gradient in stage 1.
    ckpt = ray.train.get_checkpoint()

    def start_weights(net) -> None:  # weights only, before the wrap; a resumed run takes its checkpoint
        if ckpt is None and cfg.run.init_from:
            source = init_from.load_weights(net, cfg.run.init_from)
            if say:
                say(f"initialised the model from {source} (optimizer, LR schedule, queue and centroids start fresh)")

    wrap = functools.partial(ray.train.torch.prepare_model, parallel_strategy_kwargs={
        "find_unused_parameters": cfg.schedule.stage_order != "joint" and cfg.scale.find_unused_parameters,
        "gradient_as_bucket_view": True})  # gradients live in DDP's buckets, not a second copy (0.9 GB)
    run = assemble(cfg, plan, device=device, comm=Collectives(rank, world), wrap=wrap, prepare=start_weights)
    progress = Progress(loop_config["run_dir"] if rank == 0 else None, steps_per_epoch=plan.steps_per_epoch,
                        epochs=plan.epochs, clips_per_step=plan.clips_per_step, every_s=cfg.run.progress_every,
                        say=(lambda line: print(PROGRESS_TAG + line, flush=True)) if rank == 0 else None,
                        label=loop_config.get("label", ""))

    # [3] Resume: the latest checkpoint of this run name, if any (after a crash, a reboot or --resume),
    # possibly taken inside an epoch: the run continues at the step after it.
    if ckpt is not None:
        payload, path = checkpoint.load_latest_good(ckpt.path, warn=print, filesystem=ckpt.filesystem)
        checkpoint.restore(payload, **run.parts())
        if say:
            say(resume_line(path, run, read_mark(loop_config["run_dir"])))
    progress.restart_clock(run.state.step)

    # [4] Epochs: train, checkpoint inside epochs and at their ends, evaluate, report (every rank
    # reports every time; Ray keeps rank 0's).
    def save_and_report(run: Run, metrics: dict[str, float]) -> None:
        ck = None
        if rank == 0:  # one writer; the payload is identical on every rank
            # Not a context manager: the upload runs in Ray's background thread (ASYNC), which
            # deletes the folder once it is in the run's storage.
            directory = tempfile.mkdtemp(prefix="raymcn-checkpoint-")
            checkpoint.save(directory, **run.parts(), config=cfg.to_dict(), metrics=metrics)
            ck = ray.train.Checkpoint.from_directory(directory)
        # Serialising stays on the step's path (measured: bench/checkpoint.py); the copy into the
        # run's storage (a local folder, NFS or a bucket) does not.
        ray.train.report(metrics, checkpoint=ck, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)
        schedule.done()
        progress.write(run.state.step)

    schedule = checkpoint.CheckpointSchedule(cfg.run.checkpoint_every, plan.steps_per_epoch,
                                             broadcast=functools.partial(_broadcast, run), check_every=cfg.run.log_every)

    def after_step(run: Run) -> None:
        progress.step(run.state.step)
        if schedule.due(run.state.step):
            fold_progress(run.state.progress, run.comm, run.device)  # every rank: the sums over all ranks
            save_and_report(run, {MID_EPOCH_KEY: 1.0, "epoch": float(run.state.epoch),
                                  "global_step": float(run.state.step),
                                  # below any real score (R@10 >= 0): Ray's retention keeps it only
                                  # while it is the latest. Finite: Ray's run snapshot stores the
                                  # metrics as JSON, where -inf becomes null and breaks its sort.
                                  PRIMARY_METRIC: MID_EPOCH_SCORE})

    tracked = trackers.Trackers(cfg, loop_config["run_dir"], say=say or print) if rank == 0 else None

    def after_epoch(run: Run, metrics: dict[str, float]) -> None:
        save_and_report(run, metrics)
        if rank == 0:  # metrics.csv beside the checkpoints (one row per epoch), and run.trackers
            try:
                history.record_epoch(loop_config["run_dir"], metrics)
            except OSError as e:  # a table of convenience: never worth ending the run for
                print(f"warning: could not write {METRICS_FILE} in {loop_config['run_dir']}: {e}")
            tracked.log(run.state.epoch, metrics)
            if run.state.epoch == plan.epochs:
                tracked.close()
        if say:
            say(epoch_line(run.state.epoch, plan.epochs, metrics, workers=world))
        faults.after_epoch(run.state.epoch)
        progress.restart_clock(run.state.step)  # the rate leaves out the evaluation and the checkpoint

    def batches(epoch: int, start: int):
        rows, stats = stream.epoch(epoch, start)
        return faults.stalling(rows, epoch * plan.steps_per_epoch + start, rank), stats

    # [5] Every rank's watchdog: a stall (no progress for run.stall_timeout_s) is named on the
    # terminal and ends this attempt, so Ray Train restarts it; should the process group's timeout
    # (the backstop, 2x the setting) fire first, its error is named with the step instead.
    named = f"{loop_config['label']}: " if loop_config.get("label") else ""  # a sweep's trial
    attempt = format(int(_broadcast(run, float(secrets.randbits(48)))), "012x")  # rank 0's, on every rank
    dog = Watchdog(cfg.run.stall_timeout_s, rank, loop_config["run_dir"], attempt=attempt,
                   say=lambda line: print(f"{ALERT_TAG}{named}{line}", flush=True)).start()
    try:
        # The eval set's embedding is sharded over the ranks; rank 0 scores it once and broadcasts.
        metrics = run_epochs(run, EpochHooks(batches=batches,
                                             evaluate=lambda r: evaluate(r.model, eval_set, r.device, comm=r.comm),
                                             after_epoch=after_epoch, after_step=after_step, log=log, watch=dog.at))
    except Exception as e:
        stall = dog.named(e)
        if stall is e:
            raise
        raise stall from e
    finally:
        dog.stop()
    progress.flush()
    return metrics


def resume_line(path: str, run: Run, mark: dict[str, Any] | None) -> str:
    """``resumed from PATH at epoch E, global step S (step k/N of the epoch); R steps replayed ...``.

    Epochs are counted from 1, as in the epoch lines; the replayed steps are those the interrupted
    attempt had run past the checkpoint, by its last progress mark (written every few seconds, so
    a lower bound: the steps after that mark are replayed too and not counted)."""
    state, steps = run.state, run.plan.steps_per_epoch
    line = (f"resumed from {path} at epoch {state.epoch + 1}, global step {state.step} "
            f"(step {state.step_in_epoch(steps)}/{steps} of the epoch done)")
    if mark is not None and int(mark.get("global_step", -1)) >= state.step:
        replayed = int(mark["global_step"]) - state.step
        line += f"; {replayed} steps replayed (the interrupted attempt had reached step {int(mark['global_step'])})"
    return line


def _broadcast(run: Run, value: float) -> float:
    """Rank 0's ``value`` on every rank (the checkpoint schedule's decision)."""
    return float(run.comm.broadcast_from_rank0(torch.tensor([value], dtype=torch.float64, device=run.device)).item())


def _vocab(shards_dir: str):
    from raymcn.data.words import load_vocab

    return load_vocab(shards_dir)
