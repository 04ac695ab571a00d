"""The Ray side of training: ``train_func_per_worker`` runs once on every Ray Train worker.

One worker per GPU (or per CPU slot). It wires the plain loop (``loop.py``) to the per-rank data,
to checkpoints and to ``ray.train.report``, which every rank calls once per epoch.
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import ray.train
import ray.train.torch
import torch

from raymcn.config import Config
from raymcn.data import reader
from raymcn.data.evalsets import load_eval_set
from raymcn.data.words import load_vocab
from raymcn.losses import MCNObjective
from raymcn.losses.gather import all_reduce_mean
from raymcn.model import MCN
from raymcn.train import checkpoint, faults, init_from
from raymcn.train.loop import LoopState, build_optimizer, build_scheduler, evaluate, train_one_epoch
from raymcn.train.stages import budget_epoch, switch_step


def train_func_per_worker(loop_config: dict[str, Any]) -> dict[str, float]:
    """Train MCN for ``cfg.schedule.epochs`` epochs; returns the last epoch's metrics.

    ``loop_config["config"]`` is a resolved ``Config.to_dict()``.
    """
    cfg = Config.from_dict(loop_config["config"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    log = print if rank == 0 else None

    # [1] Data: this rank's share of the shards through Ray Data (disjoint across ranks), the
    # memory-mapped vocabulary, and the held-out eval set.
    shards_dir, steps_per_epoch = loop_config["shards_dir"], loop_config["steps_per_epoch"]
    vocab = load_vocab(shards_dir)
    # Rank 0 tells the datasource which epoch it asks for (the shard order follows the trainer's
    # epochs, also after a restart); each next epoch is requested while this one ends.
    announce = functools.partial(reader.announce_epoch, loop_config["epoch_clock"]) if rank == 0 else None
    stream = reader.RankStream(ray.train.get_dataset_shard("train"), cfg, rank, world, steps_per_epoch, vocab,
                               epochs=cfg.schedule.epochs, announce=announce)
    eval_set = load_eval_set(cfg.data.eval_set, word_vectors=cfg.data.word_vectors or (
                                 None if cfg.data.eval_set == "synthetic" else vocab),
                             max_words=cfg.data.max_words, audio_frames_override=cfg.data.eval_audio_frames, cfg=cfg)
    if log and eval_set.note:
        log(eval_set.note)
    total_steps = steps_per_epoch * cfg.schedule.epochs
    switch = switch_step(cfg.schedule.stage_order, cfg.schedule.stage1_fraction, total_steps)

    # [2] Model, wrapped in DDP. Staged orders leave a branch without gradient in stage 1.
    torch.manual_seed(cfg.run.seed)
    staged = cfg.schedule.stage_order != "joint"
    mcn = MCN(cfg.model)
    ckpt = ray.train.get_checkpoint()
    if ckpt is None and cfg.run.init_from:
        # Weights only, on every rank before the wrap; a resumed run takes its own checkpoint instead.
        source = init_from.load_weights(mcn, cfg.run.init_from)
        if log:
            log(f"initialised the model from {source} (optimizer, LR schedule, queue and centroids start fresh)")
    model = ray.train.torch.prepare_model(
        mcn, parallel_strategy_kwargs={
            "find_unused_parameters": staged and cfg.scale.find_unused_parameters,
            # gradients live in DDP's buckets instead of a second copy (0.9 GB at paper size)
            "gradient_as_bucket_view": True})
    net = getattr(model, "module", model)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    objective = MCNObjective(cfg, cfg.model.embed_dim, device)
    state = LoopState()

    # [3] Resume: the latest checkpoint of this run name, if any (after a crash or --resume).
    if ckpt is not None:
        payload, path = checkpoint.load_latest_good(ckpt.path, warn=print, filesystem=ckpt.filesystem)
        checkpoint.restore(payload, model=net, optimizer=optimizer, scheduler=scheduler, objective=objective,
                           loop=state)
        if log:
            log(f"resumed from {path} at epoch {state.epoch}, global step {state.step}")

    # [4] Epochs: train, evaluate, checkpoint, report (every rank reports; Ray keeps rank 0's).
    metrics: dict[str, float] = {}
    for epoch in range(state.epoch, cfg.schedule.epochs):
        state.epoch = epoch
        batches, stats = stream.epoch(epoch)
        train_metrics = train_one_epoch(model, objective, optimizer, scheduler, batches, cfg=cfg, state=state,
                                        device=device, switch=switch, log=log, total_steps=total_steps)
        state.epoch = epoch + 1
        train_metrics["bad_samples"] = float(stats.bad_samples)
        keys = sorted(train_metrics)
        averaged = all_reduce_mean(torch.tensor([train_metrics[k] for k in keys], dtype=torch.float64,
                                                device=device))
        metrics = dict(zip(keys, averaged.tolist()))
        # damaged samples skipped this epoch, summed over ranks (a metric, never a silent drop)
        metrics["bad_samples"] *= world
        metrics.update(evaluate(model, eval_set, device))
        metrics.update(epoch=float(state.epoch), global_step=float(state.step),
                       budget_epoch=float(budget_epoch(state.epoch, cfg.schedule.stage1_fraction, cfg.schedule.epochs)))
        if log:
            log(f"epoch {state.epoch}/{cfg.schedule.epochs} " + " ".join(
                f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith("text_to_video") or k == "total_loss"))
        with tempfile.TemporaryDirectory() as d:
            ck = None
            if rank == 0:  # one writer; the payload is identical on every rank
                checkpoint.save(d, model=net, optimizer=optimizer, scheduler=scheduler, objective=objective,
                                loop=state, config=cfg.to_dict(), metrics=metrics)
                ck = ray.train.Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=ck)
        faults.after_epoch(state.epoch)
    return metrics
