"""BatchNorm over the global batch (``model.sync_batchnorm``): the forward does not depend on how
many workers share a step, which an elastic group changes mid-run.

DAVEnet's BatchNorm normalises with the statistics of the batch it sees; under DDP that is each
rank's share (as DataParallel had), so a resized run computes a different forward. Here the
per-channel sums over every rank are all-reduced (with gradient, :class:`_SumOverRanks`), so
every rank normalises with the global batch's mean and variance and the backward carries the
global terms too. On GPUs torch's own ``SyncBatchNorm`` does the same with fused kernels; it
refuses CPU tensors, hence this module for CPU workers (gloo) and the tests. Torch only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _SumOverRanks(torch.autograd.Function):
    """Σ over ranks of a tensor, differentiable: the gradient of every rank's input is the sum of
    every rank's output gradient (each rank's loss depends on every rank's input through the sum).
    Our own rather than ``torch.distributed.nn.functional.all_reduce``, which torch 2.13
    deprecates, and whose functional-collectives successor has no autograd for all_reduce."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        total = x.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        total = grad.clone()
        dist.all_reduce(total)
        return total


class GlobalBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose training statistics are those of the batch over all ranks.

    Input (n, C, H, W) per rank, any n (ranks may hold unequal shares). In training the mean and
    the biased variance come from Σx and Σx² over every rank's n·H·W positions; the running
    statistics take the unbiased variance, as BatchNorm's. Evaluation uses the running
    statistics, as BatchNorm's. The same arithmetic runs with one process, so a run's forward is
    the same (to the order of the float sums) whatever the world size.
    """

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return super().forward(x)
        dims = (0, 2, 3)
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        if _world() > 1:
            stats = _SumOverRanks.apply(stats)
        channels = x.shape[1]
        n = stats[-1]
        mean = stats[:channels] / n
        var = (stats[channels:2 * channels] / n - mean * mean).clamp_min(0)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(m * mean)
                self.running_var.mul_(1 - m).add_(m * var * n / (n - 1).clamp_min(1))
        shape = (1, channels, 1, 1)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape) if self.affine else y


def global_batchnorm(module: nn.Module, device_type: str) -> nn.Module:
    """``module`` with every ``BatchNorm2d`` computing global-batch statistics: torch's
    ``SyncBatchNorm`` on GPUs, :class:`GlobalBatchNorm2d` on CPU; parameters and buffers kept."""
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    for name, child in module.named_children():
        if type(child) is nn.BatchNorm2d:
            meta = any(t.is_meta for t in child.state_dict().values())  # a model traced for its memory: no values
            synced = GlobalBatchNorm2d(child.num_features, child.eps, child.momentum, child.affine,
                                       child.track_running_stats, device="meta" if meta else None)
            if not meta:
                synced.load_state_dict(child.state_dict())
            setattr(module, name, synced)
        else:
            global_batchnorm(child, device_type)
    return module
