"""Evaluation sharded over the ranks equals one process scoring the whole set.

Every rank embeds its contiguous share of the eval clips (⌈N/world⌉, the last rank fewer), the
shares are gathered and rank 0 scores once (``raymcn.train.evaluate.evaluate`` with ``comm``). With 2
and 3 gloo ranks and a set that does not divide evenly, every rank must return the metrics of one
process over the whole set, and the model must be back in training mode. After a DDP training
step, whose forward leaves each rank with BatchNorm statistics of its own share, the sharded
evaluation must still be that of one model: rank 0's, the one its checkpoint holds.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench.gloo import gloo_ranks
from bench.readers import random_eval_set
from raymcn.collectives import Collectives
from raymcn.config import MODALITIES, ModelConfig, metric_names
from raymcn.model import MCN
from raymcn.train.evaluate import embed_eval_set, evaluate

pytestmark = pytest.mark.dist

CLIPS, FRAMES, WORDS = 23, 32, 6  # 23 clips: shares of 12 + 11 and 8 + 8 + 7
MODEL = ModelConfig(video_dim=16, word_dim=12, embed_dim=24, audio_channels=(4, 4, 8, 8, 8), audio_blocks=1,
                    mel_bins=8, recon_hidden=8)


def _eval_set() -> SimpleNamespace:
    # two absent clips count as misses, as MSR-VTT's
    return random_eval_set(CLIPS, MODEL.video_dim, MODEL.mel_bins, FRAMES, WORDS, MODEL.word_dim, seed=5,
                           least_frames=8, queries=CLIPS + 2)


def _model() -> MCN:
    torch.manual_seed(0)
    return MCN(MODEL).train()


def _score(comm: Collectives) -> dict:
    model = _model()
    metrics = evaluate(model, _eval_set(), torch.device("cpu"), chunk=5, comm=comm)
    assert model.training  # restored after evaluation
    return metrics


def _score_on_rank(rank: int, world: int) -> dict:
    return _score(Collectives(rank, world))


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_evaluation_equals_one_process(tmp_path, world):
    per_rank = gloo_ranks(_score_on_rank, world)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (restored: later tests must not inherit it)
    try:
        alone = _score(Collectives())
    finally:
        torch.set_num_threads(threads)
    assert set(alone) == {*metric_names(), "eval_size"} and alone["eval_size"] == CLIPS + 2
    for metrics in per_rank:  # every rank returns rank 0's scores of the whole set
        assert metrics == pytest.approx(alone, abs=1e-9), (metrics, alone)


def _batch(seed: int) -> dict:
    """A training batch of the batch contract: 6 clips of the eval set's kind, drawn with ``seed``."""
    clips = random_eval_set(6, MODEL.video_dim, MODEL.mel_bins, FRAMES, WORDS, MODEL.word_dim, seed=seed)
    return {k: torch.as_tensor(getattr(clips, k)) for k in ("video", "audio", "nframes", "text")}


def _stepped_then_scored(rank: int, world: int) -> dict:
    """One DDP forward in training mode on this rank's own batch (DDP first copies rank 0's buffers
    to every rank, then each rank's BatchNorm updates its running statistics from its own share),
    then the sharded evaluation."""
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    out = ddp(_batch(seed=10 + rank), frozenset(MODALITIES))
    sum(v.sum() for k, v in out.items() if k in MODALITIES).backward()
    statistics = torch.cat([b.flatten().double() for b in model.buffers() if b.is_floating_point()])
    comm = Collectives(rank, world)
    embedded = embed_eval_set(model, _eval_set(), torch.device("cpu"), chunk=5, comm=comm)
    return {"statistics": statistics, "embedded": embedded,
            "metrics": evaluate(model, _eval_set(), torch.device("cpu"), chunk=5, comm=comm),
            "rank0_model": model.state_dict() if rank == 0 else None}


def test_after_a_ddp_step_the_sharded_evaluation_scores_rank_0s_model():
    first, second = gloo_ranks(_stepped_then_scored, 2)
    assert not torch.equal(first["statistics"], second["statistics"])  # the ranks' BatchNorm statistics differed
    model = _model()
    model.load_state_dict(first["rank0_model"])  # what the epoch's checkpoint holds
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (restored: later tests must not inherit it)
    try:
        alone = embed_eval_set(model, _eval_set(), torch.device("cpu"), chunk=5)
        metrics = evaluate(model, _eval_set(), torch.device("cpu"), chunk=5)
    finally:
        torch.set_num_threads(threads)
    for rank in (first, second):
        torch.testing.assert_close(rank["embedded"], alone, rtol=0, atol=1e-6)
        similarities = rank["embedded"][:, 0] @ rank["embedded"][:, 1].T
        torch.testing.assert_close(similarities, alone[:, 0] @ alone[:, 1].T, rtol=0, atol=1e-6)
        assert rank["metrics"] == metrics
