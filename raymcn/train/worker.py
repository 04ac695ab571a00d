"""The Ray side of training: ``train_func_per_worker`` runs once on every Ray Train worker.

One worker per GPU (or per CPU slot). It assembles the run (``build.assemble``, the same assembly
the benchmarks use) and plugs Ray into the epoch loop's hooks: this rank's batches from Ray Data,
the evaluation, and after every epoch a checkpoint and ``ray.train.report``, which every rank
calls once per epoch.
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import ray.train
import ray.train.torch

from raymcn.config import Config
from raymcn.data import reader
from raymcn.data.evalsets import load_eval_set
from raymcn.data.words import load_vocab
from raymcn.losses import Collectives
from raymcn.train import checkpoint, faults, init_from
from raymcn.train.build import EpochHooks, Run, assemble, run_epochs
from raymcn.train.console import epoch_line, tagged
from raymcn.train.loop import evaluate
from raymcn.train.plan import RunPlan


def train_func_per_worker(loop_config: dict[str, Any]) -> dict[str, float]:
    """Train MCN for the plan's epochs; returns the last epoch's metrics.

    ``loop_config``: ``config`` (a resolved ``Config.to_dict()``), ``plan`` (``RunPlan.to_dict()``,
    made on the driver) and ``epoch_clock`` (the name of the run's ``reader.EpochClock``).
    """
    cfg, plan = Config.from_dict(loop_config["config"]), RunPlan.from_dict(loop_config["plan"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if not (plan.min_workers <= world <= max(1, plan.max_workers)):
        raise RuntimeError(f"Ray Train started {world} workers, outside scale.num_workers "
                           f"[{plan.min_workers}, {plan.max_workers}]")
    device = ray.train.torch.get_device()
    log = print if rank == 0 else None  # progress lines: the console log (shown with --verbose)
    # Lines for the terminal (train/console.py): rank 0 only, marked; the driver shows each once.
    say = (lambda line: print(tagged(line), flush=True)) if rank == 0 else None

    # [1] Data: this rank's share of the shards through Ray Data (disjoint across ranks), the
    # memory-mapped vocabulary, and the held-out eval set.
    vocab = load_vocab(plan.shards_dir)
    # Rank 0 tells the datasource which epoch it asks for (the shard order follows the trainer's
    # epochs, also after a restart); each next epoch is requested while this one ends.
    announce = functools.partial(reader.announce_epoch, loop_config["epoch_clock"]) if rank == 0 else None
    # This rank's videos at each global step: the global batch stays data.batch_size whatever the
    # world (an elastic group may have resized), each rank taking its rotating share.
    stream = reader.RankStream(ray.train.get_dataset_shard("train"), cfg, rank,
                               functools.partial(plan.share, rank, world), plan.steps_per_epoch, vocab,
                               epochs=plan.epochs, announce=announce)
    eval_set = load_eval_set(cfg.data.eval_set, word_vectors=cfg.data.word_vectors or (
                                 None if cfg.data.eval_set == "synthetic" else vocab),
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

    # [3] Resume: the latest checkpoint of this run name, if any (after a crash or --resume).
    if ckpt is not None:
        payload, path = checkpoint.load_latest_good(ckpt.path, warn=print, filesystem=ckpt.filesystem)
        checkpoint.restore(payload, **run.parts())
        if say:
            say(f"resumed from {path} at epoch {run.state.epoch}, global step {run.state.step}")

    # [4] Epochs: train, evaluate, checkpoint, report (every rank reports; Ray keeps rank 0's).
    def checkpoint_and_report(run: Run, metrics: dict[str, float]) -> None:
        with tempfile.TemporaryDirectory() as d:
            ck = None
            if rank == 0:  # one writer; the payload is identical on every rank
                checkpoint.save(d, **run.parts(), config=cfg.to_dict(), metrics=metrics)
                ck = ray.train.Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=ck)
        if say:
            say(epoch_line(run.state.epoch, plan.epochs, metrics, workers=world))
        faults.after_epoch(run.state.epoch)

    # The eval set's embedding is sharded over the ranks; rank 0 scores it once and broadcasts.
    return run_epochs(run, EpochHooks(batches=stream.epoch,
                                      evaluate=lambda r: evaluate(r.model, eval_set, r.device, comm=r.comm),
                                      after_epoch=checkpoint_and_report, log=log))
