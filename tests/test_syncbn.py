"""model.sync_batchnorm: BatchNorm over the global batch, on CPU workers (gloo) too.

Three gloo ranks holding unequal shares of a batch (2, 1 and 1 of 4 samples) run DAVEnet's
BatchNorm converted to GlobalBatchNorm2d; its outputs, the input and parameter gradients (summed
over ranks, as DDP's average times the world) and the running statistics equal one process
running plain BatchNorm2d on the whole batch. Checkpoints keep their keys.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from bench.gloo import gloo_ranks
from raymcn.model.syncbn import GlobalBatchNorm2d, global_batchnorm

SHARES = (2, 1, 1)
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _batch() -> torch.Tensor:
    return torch.randn(sum(SHARES), 6, 1, 9, generator=torch.Generator().manual_seed(7)) * 3 + 1


def _bn(cls=nn.BatchNorm2d) -> nn.Module:
    torch.manual_seed(0)
    bn = cls(6)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def _step(bn: nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    y = bn(x)
    (y * upstream).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": bn.weight.grad.clone(), "db": bn.bias.grad.clone(),
            "mean": bn.running_mean.clone(), "var": bn.running_var.clone()}


def _rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    start = sum(SHARES[:rank])
    rows = slice(start, start + SHARES[rank])
    x, upstream = _batch(), torch.randn(sum(SHARES), 6, 1, 9, generator=torch.Generator().manual_seed(8))
    result = _step(_bn(GlobalBatchNorm2d), x[rows], upstream[rows])
    for k in ("dw", "db"):  # what DDP's averaged gradient times the world is: the sum
        dist.all_reduce(result[k])
    return result


@pytest.mark.dist
def test_unequal_shares_over_three_ranks_equal_batchnorm_on_the_whole_batch(tmp_path):
    ranks = gloo_ranks(_rank, len(SHARES), threads=torch.get_num_threads())
    upstream = torch.randn(sum(SHARES), 6, 1, 9, generator=torch.Generator().manual_seed(8))
    ref = _step(_bn(), _batch(), upstream)
    torch.testing.assert_close(torch.cat([r["y"] for r in ranks]), ref["y"], **TOL)
    torch.testing.assert_close(torch.cat([r["dx"] for r in ranks]), ref["dx"], **TOL)
    for r in ranks:
        for k in ("dw", "db", "mean", "var"):
            torch.testing.assert_close(r[k], ref[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")


def test_one_process_and_eval_match_batchnorm_and_the_keys_stay():
    x, upstream = _batch(), torch.randn(sum(SHARES), 6, 1, 9, generator=torch.Generator().manual_seed(8))
    ours, ref = _step(_bn(GlobalBatchNorm2d), x, upstream), _step(_bn(), x, upstream)
    for k in ours:
        torch.testing.assert_close(ours[k], ref[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")
    from raymcn.config import ModelConfig
    from raymcn.model import MCN

    cfg = ModelConfig(embed_dim=16, audio_channels=(4, 4, 8, 8, 16), recon_hidden=8, video_dim=12, word_dim=6)
    plain, synced = MCN(cfg), global_batchnorm(MCN(cfg), "cpu")
    assert sum(isinstance(m, GlobalBatchNorm2d) for m in synced.modules()) == sum(
        isinstance(m, nn.BatchNorm2d) for m in plain.modules()) > 0
    synced.load_state_dict(plain.state_dict())  # checkpoints load both ways
    plain.eval(), synced.eval()
    audio = torch.randn(3, 40, 64)
    torch.testing.assert_close(synced.audio_encoder.davenet(audio), plain.audio_encoder.davenet(audio), **TOL)
