"""Evaluation: zero-shot text-to-video retrieval of a model on an eval set, its metrics, and
``raymcn eval`` (:func:`run`: a checkpoint's). No Ray.

Every clip is embedded once (sharded over the ranks, :func:`embed_eval_set`) by one model, rank 0's,
and rank 0 scores the whole set: ``M = t · (v + a)ᵀ``, chunked, in fp32. The rank of query i is the
number of gallery items scoring *strictly* higher than its own match, so ties never push a correct
match down (the original's ``np.where`` equality search misaligns on ties).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from raymcn.collectives import Collectives
from raymcn.config import Config, ConfigError, metric_names, retrieval_values
from raymcn.data.evalsets import EvalSetError
from raymcn.model import MCN
from raymcn.train import optim
from raymcn.train.checkpoints import payload as checkpoint
from raymcn.train.feed import to_device
from raymcn.train.inputs import eval_set_of
from raymcn.train.monitor.console import final_summary


@torch.no_grad()
def evaluate(model: nn.Module, eval_set, device: torch.device, chunk: int = 256,
             comm: Collectives | None = None) -> dict[str, float]:
    """Text-to-video retrieval on ``eval_set`` with all three branches; restores train mode after.

    With ``comm`` of several ranks the set is embedded sharded (:func:`embed_eval_set`), rank 0
    scores the whole set and broadcasts the metrics: each clip is embedded once instead of once per
    rank, and the metrics are those of one process scoring everything with rank 0's model (the one
    the epoch's checkpoint holds). Every rank must call it (collectives).

    Args:
        eval_set: object with arrays or tensors ``video`` (N,4096), ``audio`` (N,40,T),
            ``nframes`` (N,), ``text`` (N,W,300) and ``num_queries_total`` (the protocol's query
            count).
        chunk: clips embedded at a time.
        comm: this rank's collectives (default: one process).
    """
    comm = comm or Collectives()
    everyone = embed_eval_set(model, eval_set, device, chunk, comm)
    n = everyone.shape[0]
    total = float(getattr(eval_set, "num_queries_total", None) or n)
    keys = [*metric_names(), "eval_size"]
    values = torch.zeros(len(keys), dtype=torch.float64, device=device)
    if comm.rank == 0:
        metrics = retrieval_metrics(ranks_of_matches(everyone[:, 0], everyone[:, 1]), int(total))
        metrics["eval_size"] = total
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
    return dict(zip(keys, comm.broadcast_from_rank0(values).tolist()))


@torch.no_grad()
def embed_eval_set(model: nn.Module, eval_set, device: torch.device, chunk: int = 256,
                   comm: Collectives | None = None) -> torch.Tensor:
    """Every clip of ``eval_set`` embedded by one model, in eval mode (train mode restored after):
    (N, 2, D) fp32, [:, 0] the text and [:, 1] the gallery (video + audio), in the set's order.

    With ``comm`` of several ranks each rank embeds its contiguous share of the clips (⌈N/world⌉,
    the last rank fewer) and the shares are all-gathered. One model on every rank: the ranks'
    buffers (BatchNorm's running statistics) are first made rank 0's. DDP copies rank 0's buffers to
    every rank before each forward and each rank then updates its own from its share, so after an
    epoch's last step they differ; scored with its own, each rank's share would come from another
    model, and the metrics would depend on the world size. The next training forward copies rank
    0's again, so training is unchanged."""
    net = getattr(model, "module", model)  # bypass DDP: evaluation needs no gradient sync
    comm = comm or Collectives()
    for buffer in net.buffers():
        comm.broadcast_from_rank0(buffer)
    was_training = net.training
    net.eval()
    try:
        n = eval_set.video.shape[0]
        start, end = comm.share(n)
        rows = torch.empty(end - start, 2, net.cfg.embed_dim, dtype=torch.float32, device=device)  # (text, gallery)
        for s in range(start, end, chunk):
            sl = slice(s, min(s + chunk, end))
            batch = to_device({k: torch.as_tensor(getattr(eval_set, k)[sl])
                               for k in ("video", "audio", "nframes", "text", "nwords")}, device)
            with optim.autocast(device):
                out = net.encode(batch)  # all three branches, no reconstruction heads
            rows[s - start:sl.stop - start, 0] = out["text"].float()
            rows[s - start:sl.stop - start, 1] = out["video"].float() + out["audio"].float()
        return comm.all_gather(rows, sizes=comm.share_sizes(n))  # (N, 2, D): every clip once, in order
    finally:
        net.train(was_training)


def ranks_of_matches(queries: torch.Tensor, gallery: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """0-based rank of each query's own gallery item (the diagonal).

    Args:
        queries: (N, D) query embeddings (text).
        gallery: (N, D) gallery embeddings (video + audio); row i matches query i.
        chunk: queries scored at a time, so peak memory is chunk × N scores, not N × N.

    Returns:
        (N,) int64: number of gallery items with a strictly greater score than the match.
    """
    q = queries.float()
    g = gallery.float()
    out = torch.empty(q.shape[0], dtype=torch.long)
    for start in range(0, q.shape[0], chunk):
        scores = q[start:start + chunk] @ g.T  # (c, N) fp32
        idx = torch.arange(start, start + scores.shape[0])
        own = scores[torch.arange(scores.shape[0]), idx].unsqueeze(1)
        out[start:start + scores.shape[0]] = (scores > own).sum(dim=1).cpu()
    return out


def retrieval_metrics(ranks: torch.Tensor, num_queries_total: int | None = None) -> dict[str, float]:
    """Every metric of the table (``config/metrics.py``) from 0-based ranks, by reported name.

    Args:
        ranks: (N,) 0-based ranks of the queries that are present.
        num_queries_total: the protocol's query count (default N). MSR-VTT's protocol fixes it at
            1000 although only 968 clips have audio; each metric of the table says whether it is
            over all of them (the missing ones count as misses) or over the present ones.
    """
    r = ranks.cpu().numpy()
    return retrieval_values(r, num_queries_total or len(r))


# --- `raymcn eval`: a checkpoint's retrieval ------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """``raymcn eval``: zero-shot retrieval of a checkpoint on an eval set, its model scored as a
    run scores it; the same JSON keys as ``train --json``."""
    path = Path(args.checkpoint)
    try:
        payload = checkpoint.load(path if path.is_dir() else path.parent)
    except checkpoint.CheckpointError as e:
        raise ConfigError([str(e)]) from None
    cfg = Config.from_dict(payload["config"])
    if args.eval_set:
        cfg = cfg.replace({"data.eval_set": args.eval_set})
    if args.word_vectors:
        cfg = cfg.replace({"data.word_vectors": args.word_vectors})
    try:
        eval_set = eval_set_of(cfg)  # the eval pickle and its words, as a run of this config reads them
    except (EvalSetError, OSError) as e:
        raise ConfigError([f"--eval-set {cfg.data.eval_set}: {e}"]) from None
    if eval_set.note:
        print(eval_set.note)
    model = MCN(cfg.model)
    model.load_state_dict(payload["model"])
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    metrics = evaluate(model.to(device), eval_set, device)
    metrics.update({k: v for k, v in payload.get("metrics", {}).items() if k.endswith("_loss")})
    metrics["epoch"] = payload["loop"]["epoch"]
    summary = final_summary(metrics, path if path.is_dir() else path.parent)
    for k, v in summary.items():
        print(f"  {k:32s} {v}")
    if args.json:
        print(json.dumps(summary), flush=True)
    return 0
