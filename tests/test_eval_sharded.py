"""Evaluation sharded over the ranks equals one process scoring the whole set.

Every rank embeds its contiguous share of the eval clips (⌈N/world⌉, the last rank fewer), the
shares are gathered and rank 0 scores once (``raymcn.train.loop.evaluate`` with ``comm``). With 2
and 3 gloo ranks and a set that does not divide evenly, every rank must return the metrics of one
process over the whole set, and the model must be back in training mode.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench.gloo import gloo_ranks
from bench.readers import random_eval_set
from raymcn.collectives import Collectives
from raymcn.config import RETRIEVAL_METRICS, ModelConfig
from raymcn.model import MCN
from raymcn.train.loop import evaluate

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
    assert set(alone) == {*RETRIEVAL_METRICS, "eval_size"} and alone["eval_size"] == CLIPS + 2
    for metrics in per_rank:  # every rank returns rank 0's scores of the whole set
        assert metrics == pytest.approx(alone, abs=1e-9), (metrics, alone)
