"""The Ray side of training: ``train_func_per_worker`` runs once on every Ray Train worker.

One worker per GPU (or per CPU slot), computing with ``scale.torch_threads`` threads. It assembles
the run (``build.assemble``, the same assembly the benchmarks use) and plugs Ray into the epoch
loop's hooks: this rank's batches from its own Ray Data stream, the evaluation, the in-epoch
progress, and the checkpoint: a folder and ``ray.train.report`` (every rank reports each time)
after every epoch and whenever the run's ``checkpoints.policy.CheckpointPolicy`` asks, which Ray
tells when a node of the run is drained (``preemption.py``).
A rank only reads files: its plan, made on the driver, names them.
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import ray.train
import ray.train.torch
import torch

from raymcn.collectives import Collectives
from raymcn.config import (
    METRICS_FILE,
    MID_EPOCH_KEY,
    Config,
    ConfigError,
    StorageError,
    is_storage_error,
    objective,
    reason,
)
from raymcn.data.evalsets import EvalSet, load_eval_set
from raymcn.data.formats.batch import Batch
from raymcn.data.formats.words import load_vocab
from raymcn.data.read import datasource
from raymcn.environment import Environment
from raymcn.model.parts import text_in_bf16
from raymcn.train import faults, probes, run_record
from raymcn.train.build import assemble
from raymcn.train.checkpoints import init_from, persist, space
from raymcn.train.checkpoints import payload as checkpoint
from raymcn.train.checkpoints.policy import CheckpointPolicy, mark_registered
from raymcn.train.evaluate import evaluate
from raymcn.train.loop import run_epochs
from raymcn.train.monitor import history, trackers
from raymcn.train.monitor.console import ALERT_TAG, PROGRESS_TAG, epoch_line, tagged, write_line
from raymcn.train.monitor.in_epoch import Progress, read_mark
from raymcn.train.monitor.watchdog import Watchdog
from raymcn.train.on_ray import preemption
from raymcn.train.optim import apply_precision
from raymcn.train.preflight import checks as preflight
from raymcn.train.run import Hooks, Run
from raymcn.train.run_plan import RunPlan

# How long a rank waits for Ray Train to register a drain's checkpoint: past any deadline `raymcn
# drain` gives (by then Ray Train restarts the group anyway); it takes the upload and a poll
DRAIN_REGISTER_TIMEOUT_S = 600.0


def train_func_per_worker(loop_config: dict[str, Any]) -> dict[str, float]:
    """Train MCN for the plan's epochs; returns the last epoch's metrics.

    ``loop_config``: ``config`` (the resolved ``Config``), ``plan`` (the driver's ``RunPlan``,
    inputs and video index included), ``run_dir`` (where checkpoints and the progress marker go)
    and ``label`` (names the run's progress lines in a sweep).
    """
    environment = Environment.read()  # this process's start: what the driver handed it (runtime_env)
    cfg, plan, run_dir = loop_config["config"], loop_config["plan"], loop_config["run_dir"]
    rank, world = _rank_in(plan)
    out = Printer(rank, loop_config.get("label", ""))
    _set_threads(cfg, out)
    apply_precision(cfg)  # process-wide torch flags, once
    probes.rank_started(environment, rank)  # the benchmarks' timeline, when asked for
    device = _checked_device(cfg)
    # [0] Every rank's watchdog, from the group's start: a rank that makes no progress for
    # run.stall_timeout_s (waiting for a peer in the start's collectives, DDP's first broadcast
    # among them, in the step loop, the evaluation or a report) is named on the terminal and
    # ends this attempt, so Ray Train restarts it; its limit stays below the process group's
    # timeout (run.collective_timeout_s, the backstop), and should that fire anyway (gloo, or NCCL
    # with its error handling set by launch.worker_env) its error is named with the step. (A start
    # whose own reading takes longer than the limit is named too: its peers wait for it.)
    dog = Watchdog(cfg.run.stall_timeout_s, rank, run_dir, attempt=group_attempt(), say=out.alert,
                   collective_s=cfg.run.collective_timeout)
    dog.at("start", 0)
    dog.start()
    try:
        run, reports = _start(cfg, plan, run_dir, out, device, Collectives(rank, world), dog)
        faults.install(run, environment)  # the tests' faults, when asked for
        probes.install(run, environment)  # the tests' trace and the benchmarks' timeline, when asked for
        metrics = run_epochs(run)
    except Exception as e:
        stall = dog.named(e)
        if stall is e:
            raise
        raise stall from e
    finally:
        dog.stop()
    reports.progress.flush()
    return metrics


def ray_data_stream(cfg: Config, plan: RunPlan, rank: int, world: int) -> datasource.RankStream:
    """This rank's part of every step, read by its own Ray Data stream (the steps' videos are fixed
    by seed, epoch and step: the same at any world size and after any restart)."""
    return datasource.RankStream(plan.shards_dir, plan.inputs.index, cfg, rank, world,
                                 steps_per_epoch=plan.steps_per_epoch, epochs=plan.epochs,
                                 node_id=ray.get_runtime_context().get_node_id(),
                                 text_bf16=text_in_bf16(cfg.model, cfg.scale.use_gpu))


def _start(cfg: Config, plan: RunPlan, run_dir: str, out: Printer, device: torch.device, comm: Collectives,
           dog: Watchdog) -> tuple[Run, Reports]:
    """This rank's run, ready for its epochs: its data, the model wrapped in DDP, resumed from the
    latest checkpoint of ``run_dir`` if any, and Ray plugged into the loop's hooks."""
    # [1] Data: this rank's part of every step.
    stream = ray_data_stream(cfg, plan, comm.rank, comm.world)
    eval_set = _eval_set(cfg, plan, out)
    # [2] The run, its model wrapped in DDP; [3] resumed from the latest checkpoint of this run dir,
    # if any (after a crash, a reboot or --resume), possibly one taken inside an epoch.
    ckpt = ray.train.get_checkpoint()
    run = assemble(cfg, plan, device=device, comm=comm, wrap=_ddp(cfg),
                   prepare=functools.partial(_start_weights, cfg, fresh=ckpt is None, out=out))
    if ckpt is not None:
        _resume(run, ckpt, run_dir, out)
    # [4] Epochs: train, evaluate, checkpoint and report at their ends and when the policy asks
    # inside them (every rank reports every time; Ray keeps rank 0's).
    reports = Reports(run, run_dir, out)
    _record_nodes(run_dir, comm, device, out)
    run.hooks = Hooks(batches=lambda r, epoch, start: stream.epoch(epoch, start),
                      evaluate=lambda r: evaluate(r.model, eval_set, r.device, comm=r.comm), save=reports.save,
                      after_epoch=[reports.after_epoch], after_step=[reports.after_step], log=out.log, watch=dog.at)
    # run.checkpoint_every, and at once when a node of the run is drained (run.drain_check_every)
    run.checkpoints = CheckpointPolicy(cfg.run.checkpoint_every, plan.steps_per_epoch, check_every=cfg.run.log_every,
                                       broadcast=functools.partial(_broadcast, run),
                                       drain_every=cfg.run.drain_check_every, ask=preemption.drain_question(),
                                       say=out.say)
    return run, reports


def _record_nodes(run_dir: str, comm: Collectives, device: torch.device, out: Printer) -> None:
    """Every rank says what its node runs (``run_record.node_part``); rank 0 adds the nodes to the run's
    record and names those that differ. A record that cannot be written is said, never worth ending
    the run for (the driver's entry, written before, holds the code and the data)."""
    parts = comm.all_gather_object(run_record.node_part(comm.rank, device))
    if comm.rank != 0:
        return
    try:
        lines = run_record.record_nodes(run_dir, parts)
    except OSError as e:
        lines = [f"warning: could not add the nodes to the run's record in {run_dir} ({reason(e)})"]
    for line in lines:
        out.say(line)


def group_attempt() -> str:
    """This worker group's id, the same on every rank and new for every group Ray Train starts,
    known before any collective (so a stall in the group's start is recorded under it): the
    address of the group's process-group rendezvous, rank 0's host and a port that was free when
    Ray Train started the group (``MASTER_ADDR``/``MASTER_PORT``, set on every worker by its
    TorchConfig), hashed to a file name's characters. A port a later group happens to reuse only
    merges two attempts' records: the repeated-stall rule then allows one more restart. A random
    id without them (one process)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return hashlib.sha1(f"{addr}:{port}".encode()).hexdigest()[:12] if addr and port else secrets.token_hex(6)


@dataclass(frozen=True)
class Printer:
    """A rank's one print channel. Everything goes to its stdout, which Ray sends to the driver's
    console (``monitor/console.py``); rank 0's lines are tagged by what they are for, the other
    ranks print nothing but their thread count (to the console log) and stall alerts.

    ``log``: the console log only (shown with --verbose); ``each``: the console log only, from
    every rank, prefixed with the rank; ``say``: the terminal; ``progress``: the in-epoch progress
    lines; ``alert``: a stall, from any rank, prefixed with the trial's name.
    """

    rank: int
    label: str = ""

    def _print(self, text: str) -> None:
        write_line(text)

    def log(self, line: str) -> None:
        if self.rank == 0:
            self._print(line)

    def each(self, line: str) -> None:
        self._print(f"rank {self.rank}: {line}")

    def say(self, line: str) -> None:
        if self.rank == 0:
            self._print(tagged(line))

    def progress(self, line: str) -> None:
        if self.rank == 0:
            self._print(PROGRESS_TAG + line)

    def alert(self, line: str) -> None:
        self._print(f"{ALERT_TAG}{self.label + ': ' if self.label else ''}{line}")


def _rank_in(plan: RunPlan) -> tuple[int, int]:
    """(rank, world) of this worker, the world checked against the plan's worker range."""
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if not (plan.min_workers <= world <= max(1, plan.max_workers)):
        raise RuntimeError(f"Ray Train started {world} workers, outside scale.num_workers "
                           f"[{plan.min_workers}, {plan.max_workers}]")
    return rank, world


def _set_threads(cfg: Config, out: Printer) -> None:
    """Every rank computes with the same, explicit thread count (``scale.torch_threads``), logged:
    Ray derives OMP_NUM_THREADS from the CPU reservation only where it is unset, and a torch
    imported before it was set keeps its own."""
    threads = cfg.scale.torch_threads
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    out.each(f"{torch.get_num_threads()} torch thread(s), OMP_NUM_THREADS={threads}")


def _checked_device(cfg: Config) -> torch.device:
    """This worker's device, its memory checked against the run's estimate (the driver may see none)."""
    device = ray.train.torch.get_device()
    problems = preflight.device_problems(cfg, device)
    if problems:
        raise ConfigError(problems)
    return device


def _eval_set(cfg: Config, plan: RunPlan, out: Printer) -> EvalSet:
    """The eval set the plan names; its captions' words come from its word vectors, else the shards' vocabulary."""
    inputs = plan.inputs
    eval_set = load_eval_set(inputs.eval_set, word_vectors=inputs.word_vectors or load_vocab(plan.shards_dir),
                             max_words=cfg.data.max_words, audio_frames_override=inputs.eval_audio_frames)
    if eval_set.note:
        out.say(eval_set.note)
    return eval_set


def _ddp(cfg: Config):
    """Ray Train's DDP wrap. Staged orders leave a branch without gradient in stage 1."""
    return functools.partial(ray.train.torch.prepare_model, parallel_strategy_kwargs={
        "find_unused_parameters": cfg.schedule.stage_order != "joint" and cfg.scale.find_unused_parameters,
        "gradient_as_bucket_view": True})  # gradients live in DDP's buckets, not a second copy (0.9 GB)


def _start_weights(cfg: Config, net: torch.nn.Module, *, fresh: bool, out: Printer) -> None:
    """``run.init_from``'s weights into the bare model, before the wrap; a resumed run takes its checkpoint's."""
    if fresh and cfg.run.init_from:
        source = init_from.load_weights(net, cfg.run.init_from)
        out.say(f"initialised the model from {source} (optimizer, LR schedule, queue and centroids start fresh)")


def _resume(run: Run, ckpt, run_dir: str, out: Printer) -> None:
    payload, path = checkpoint.load_latest_good(ckpt.path, warn=out.log, filesystem=ckpt.filesystem)
    checkpoint.restore(payload, **run.parts())
    out.say(resume_line(path, run, read_mark(run_dir)))
    skipped = persist.unregistered_after(ckpt.filesystem, ckpt.path)
    if skipped:
        out.say(f"skipped {', '.join(skipped)}: newer than the latest checkpoint Ray Train registered, which the "
                "run ended before (never read; delete them to free their space)")


class Reports:
    """What a rank does with a checkpoint, after a step and after an epoch: the checkpoint's folder
    and ``ray.train.report`` (every rank, every time: it is a barrier), the in-epoch progress, and
    on rank 0 metrics.csv and the epoch line. (``run.trackers`` log the reports on Ray Train's
    controller, ``launch.TrackersOnController``, except in a run without workers: Ray Train's local
    mode calls no callback, so its in-process rank feeds them.)"""

    def __init__(self, run: Run, run_dir: str, out: Printer):
        cfg, plan = run.cfg, run.plan
        self.run_dir, self.out, self.rank = run_dir, out, run.comm.rank
        self.progress = Progress(run_dir if self.rank == 0 else None, plan, every_s=cfg.run.progress_every,
                                 say=out.progress if self.rank == 0 else None, label=out.label)
        self.progress.restart_clock(run.state.step)
        self.table = history.EpochTable(run_dir) if self.rank == 0 else None
        in_process = bool(cfg.run.trackers) and plan.max_workers == 0
        self.compile_said = False  # scale.compile: what compiling cost is said once, after its first epoch
        self.tracked = trackers.EpochReports(cfg, run_dir, plan.epochs, say=out.say) if in_process else None

    def save(self, run: Run, metrics: dict[str, float] | None) -> None:
        """The run's checkpoint with the epoch's ``metrics`` (None: inside an epoch) reported to Ray."""
        if metrics is None:
            # worse than any real score of the metric Ray's retention ranks by (launch.py): it
            # keeps a mid-epoch checkpoint only while it is the latest
            ranked = objective(run.cfg.sweep.metric).metric
            metrics = {MID_EPOCH_KEY: 1.0, "epoch": float(run.state.epoch), "global_step": float(run.state.step),
                       ranked.name: ranked.worst}
        ck = None
        if self.rank == 0:  # one writer; the payload is identical on every rank
            ck = ray.train.Checkpoint.from_directory(self.serialised(run, metrics))
        # Serialising stays on the step's path (measured: bench/checkpoint.py); the copy into the
        # run's storage (a local folder, NFS or a bucket) does not: Ray's background thread runs
        # it (ASYNC), whole or not at all (checkpoints/persist.py), and deletes the local folder
        # once it is there.
        ray.train.report(metrics, checkpoint=ck, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                         checkpoint_upload_fn=self.uploader(run) if ck is not None else None)
        if run.checkpoints.pending:  # the checkpoint a drain asked for (every rank alike)
            self.mark_drain_checkpoint(run)
        self.progress.write(run.state.step)

    def serialised(self, run: Run, metrics: dict[str, float]) -> str:
        """The run's checkpoint in a new local temp folder (not a context manager: the upload
        deletes it); a temp folder that cannot take it is named like a full storage and ends the run."""
        directory = tempfile.mkdtemp(prefix="raymcn-checkpoint-")
        try:
            checkpoint.save(directory, **run.parts(), config=run.cfg.to_dict(), metrics=metrics)
        except OSError as e:
            shutil.rmtree(directory, ignore_errors=True)
            if is_storage_error(e):
                raise space.storage_error(e, directory, run.cfg, what="serialising a checkpoint into this "
                                          "worker's temp folder", fix="Free space there, or point TMPDIR (in "
                                          "the environment Ray starts with) at a larger disk") from e
            raise
        return directory

    def uploader(self, run: Run):
        """Ray Train's ``checkpoint_upload_fn``: the local checkpoint into the run's storage through
        ``persist.persist``, as the ``ray.train.Checkpoint`` Ray registers. A storage that cannot
        take it also loses the local copy (Ray deletes that only after an upload that succeeded)."""
        copy, cfg, shown = run.hooks.copy_checkpoint or persist.copy_files, run.cfg, self.run_dir

        def upload(local: ray.train.Checkpoint, name: str) -> ray.train.Checkpoint:
            where = ray.train.get_context().get_storage()  # Ray's own view of the run's folder
            try:
                path = persist.persist(local.path, where.storage_filesystem, where.experiment_fs_path, name, cfg,
                                       shown=shown, copy=copy)
            except StorageError:
                shutil.rmtree(local.path, ignore_errors=True)
                raise
            return ray.train.Checkpoint(path=path, filesystem=where.storage_filesystem)

        return upload

    def mark_drain_checkpoint(self, run: Run) -> None:
        """Wait until Ray Train has registered the drain's checkpoint, then mark it on this machine
        (``checkpoints/policy.py``), so that ``raymcn drain`` lets the server go now, not at the
        deadline. The wait holds this rank (the steps it would train are thrown away by the restart
        anyway)."""
        run.checkpoints.registered = True
        try:
            # At its timeout Ray returns what is registered so far, without an error: the drain's
            # checkpoint is registered when one of them is at this step.
            reported = ray.train.get_all_reported_checkpoints(
                consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED, timeout_s=DRAIN_REGISTER_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - unmarked, the server goes at the deadline, as without a mark
            self.out.say(f"warning: could not learn whether the drain's checkpoint is registered ({reason(e)}): "
                         "the drained server goes at the deadline")
            return
        if not any(float((c.metrics or {}).get("global_step", -1)) == run.state.step for c in reported):
            self.out.say(f"warning: the drain's checkpoint (global step {run.state.step}) was not registered within "
                         f"{DRAIN_REGISTER_TIMEOUT_S:.0f} s: the drained server goes at the deadline")
            return
        try:
            mark_registered(run.state.step, self.rank)
        except OSError as e:  # (e.g. another user's folder): the server goes at the deadline instead
            self.out.say(f"warning: could not mark the drain's checkpoint for `raymcn drain` ({reason(e)})")
            return
        if self.rank == 0:
            self.out.say(f"the drain's checkpoint (global step {run.state.step}) is registered: `raymcn drain` "
                         "lets the drained server go now")

    def after_step(self, run: Run, values: dict[str, float], batch: Batch) -> None:
        self.progress.step(run.state.step)

    def after_epoch(self, run: Run, metrics: dict[str, float]) -> None:
        if self.rank == 0:  # metrics.csv beside the checkpoints (one row per epoch)
            try:
                self.table.record(metrics)
            except OSError as e:  # never worth ending the run for: the next epoch writes this row too
                self.out.log(f"warning: could not write {METRICS_FILE} in {self.run_dir} (kept for the next "
                             f"epoch's write): {e}")
        if self.tracked is not None:
            self.tracked.report(metrics)
        self.out.say(epoch_line(run.state.epoch, run.plan.epochs, metrics, objective(run.cfg.sweep.metric).metric,
                                workers=run.comm.world))
        if self.rank == 0 and metrics.get("compiled_graphs") and not self.compile_said:  # once per attempt
            self.compile_said = True
            self.out.say(f"torch.compile: {metrics['compiled_graphs']:.0f} graph(s) compiled in "
                         f"{metrics['time_compile_s']:.1f} s in epoch {run.state.epoch}; every epoch's in "
                         f"{METRICS_FILE} (compiled_graphs, time_compile_s)")
        self.progress.restart_clock(run.state.step)  # the rate leaves out the evaluation and the checkpoint


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
    """Rank 0's ``value`` on every rank (the checkpoint policy's decision)."""
    return float(run.comm.broadcast_from_rank0(torch.tensor([value], dtype=torch.float64, device=run.device)).item())
