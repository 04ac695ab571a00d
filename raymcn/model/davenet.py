"""ResDAVEnet: the audio CNN of MCN, the padding-aware time pooling helpers, and the original's
audio encoder made of them (``model.audio_encoder: davenet``).

The network collapses the mel axis with one (mel_bins, 1) convolution and then runs 1-D residual
layers along time. Every layer halves the time axis, so 5 widths (conv1 + 4 layers) give a 16x
downsampling: T=1000 -> 63, 3072 -> 192, 5120 -> 320 steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raymcn.config import ModelConfig
from raymcn.model.branch import Encoder
from raymcn.model.gated import GatedEmbeddingUnit

LAYOUTS = ("nchw", "channels_last", "1d")  # how DAVEnet's convolutions run (:meth:`DAVEnet.set_layout`)


class HeightOneConv2d(nn.Conv2d):
    """A 2-D convolution whose output is one row high (its kernel spans the input's height, no
    padding along it), which can also run as the 1-D convolution over width that it is.

    With ``as_1d`` the input (B, C, H, W) is viewed as (B, C·H, W) and the weight (O, C, H, k) as
    (O, C·H, k): the same products summed, by 1-D kernels, on the same parameter (its name and shape
    unchanged, so checkpoints load either way). Output (B, O, 1, W') in both cases.
    """

    as_1d = False

    def forward(self, x: Tensor) -> Tensor:
        if not self.as_1d:
            return super().forward(x)
        b, c, h, w = x.shape
        if h != self.kernel_size[0] or self.padding[0] != 0:
            raise ValueError(f"a 1-D run needs the kernel to span the input's height: input {tuple(x.shape)}, "
                             f"kernel {self.kernel_size}, padding {self.padding}")
        weight = self.weight.reshape(self.out_channels, c * h, self.kernel_size[1])
        out = F.conv1d(x.reshape(b, c * h, w), weight, self.bias, stride=self.stride[1], padding=self.padding[1],
                       dilation=self.dilation[1], groups=self.groups)
        return out.unsqueeze(2)


def _restrided(weight: Tensor, channels_last: bool) -> Tensor:
    """``weight`` (O, C, H, W) copied into exactly the strides of its memory format, channels-last
    (H·W·C, 1, W·C, C) or contiguous (C·H·W, H·W, W, 1), even along dimensions of size 1. Torch
    leaves a (O, C, 1, 1) weight as it is for either format (its strides there never address
    memory), but the convolution's backward returns its gradient in the format's exact strides,
    and DDP's gradient buckets take a gradient in place only with the parameter's own strides:
    otherwise they copy it every step and warn "Grad strides do not match bucket view strides"."""
    _, c, h, w = weight.shape
    strides = (h * w * c, 1, w * c, c) if channels_last else (c * h * w, h * w, w, 1)
    if weight.stride() == strides:
        return weight
    return torch.empty_strided(weight.shape, strides, dtype=weight.dtype, device=weight.device).copy_(weight)


def _time_conv(in_ch: int, out_ch: int, stride: int = 1) -> HeightOneConv2d:
    """A (1, 9) convolution along time; 'same' padding so only the stride changes the length."""
    return HeightOneConv2d(in_ch, out_ch, kernel_size=(1, 9), stride=(1, stride), padding=(0, 4), bias=False)


class BasicBlock(nn.Module):
    """conv(1x9) -> BN -> ReLU -> conv(1x9) -> BN, plus a shortcut, then ReLU.

    Input (B, in_ch, 1, T) -> output (B, out_ch, 1, ceil(T / stride)). A block that changes the
    stride or the width gets a 1x1 conv + BN projection on its shortcut.
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1):
        super().__init__()
        self.conv1 = _time_conv(in_ch, out_ch, stride)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = _time_conv(out_ch, out_ch)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                HeightOneConv2d(in_ch, out_ch, kernel_size=1, stride=(1, stride), bias=False),
                nn.BatchNorm2d(out_ch),
            )

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + shortcut)


def _layer(in_ch: int, out_ch: int, blocks: int) -> nn.Sequential:
    """`blocks` basic blocks; the first one halves time (and always carries the projection)."""
    layers = [BasicBlock(in_ch, out_ch, stride=2)]
    layers += [BasicBlock(out_ch, out_ch) for _ in range(blocks - 1)]
    return nn.Sequential(*layers)


class DAVEnet(nn.Module):
    """ResDAVEnet audio encoder.

    Args:
        channels: conv1 width followed by one width per residual layer; the paper uses
            (128, 128, 256, 512, 1024). Each layer halves time, so 4 layers downsample by 16.
        blocks: residual blocks per layer (paper: 2).
        mel_bins: height of the input spectrogram (paper: 40).

    The original also builds an unused ``batchnorm1``; it is deliberately left out here.
    """

    def __init__(self, channels: Sequence[int] = (128, 128, 256, 512, 1024), blocks: int = 2, mel_bins: int = 40):
        super().__init__()
        if len(channels) < 2:
            raise ValueError(f"DAVEnet channels={list(channels)}: needs conv1 width and at least one layer width")
        self.mel_bins = mel_bins
        self.out_channels = channels[-1]
        # conv1 spans the whole mel axis, so everything after it is a 1-D net over time.
        self.conv1 = HeightOneConv2d(1, channels[0], kernel_size=(mel_bins, 1), bias=False)
        self.bn1 = nn.BatchNorm2d(channels[0])
        self.relu = nn.ReLU(inplace=True)
        self.layers = nn.Sequential(*[_layer(i, o, blocks) for i, o in zip(channels[:-1], channels[1:])])
        self.layout = "nchw"
        self._init_weights()

    def set_layout(self, layout: str) -> DAVEnet:
        """How the convolutions run (``scale.davenet_layout``): ``"nchw"``, torch's default;
        ``"channels_last"``, the weights and activations in channels-last memory format;
        ``"1d"``, every convolution as the 1-D convolution over time it is (:class:`HeightOneConv2d`).
        The same parameters and arithmetic in each, summed in the kernels' own orders. Call it before
        the optimizer is built (the weights' memory format is the optimizer states' too)."""
        if layout not in LAYOUTS:
            raise ValueError(f"DAVEnet layout {layout!r}: allowed are {', '.join(LAYOUTS)}")
        self.layout = layout
        for m in self.modules():
            if isinstance(m, HeightOneConv2d):
                m.as_1d = layout == "1d"
                m.weight.data = _restrided(m.weight.data, channels_last=layout == "channels_last")
        return self

    def _init_weights(self) -> None:
        """He-style init as in the original: N(0, sqrt(2 / (kh * kw * out_ch))); BN = identity."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                kh, kw = m.kernel_size
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / (kh * kw * m.out_channels)))
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, audio: Tensor) -> Tensor:
        """audio (B, mel_bins, T), any float dtype -> features (B, out_channels, ceil(T / 16)).

        The input is cast to the weights' dtype: fp16 spectrograms meet fp32 weights (the original's
        apex_level=0 crash). Under torch.autocast the weights stay fp32, so this is a plain
        ``.float()`` and autocast picks the compute dtype of each conv.
        """
        if audio.dim() != 3 or audio.shape[1] != self.mel_bins:
            raise ValueError(f"DAVEnet expects audio (B, {self.mel_bins}, T), got {tuple(audio.shape)}")
        x = audio.to(self.conv1.weight.dtype).unsqueeze(1)  # (B, 1, mel, T)
        if self.layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        x = self.relu(self.bn1(self.conv1(x)))  # (B, C0, 1, T)
        x = self.layers(x)  # (B, C4, 1, T')
        return x.squeeze(2)


def pooled_steps(nframes: Tensor, frames: int, steps: int) -> Tensor:
    """Number of DAVEnet output steps that cover real (non-padding) audio.

    Args:
        nframes: (B,) integer count of real spectrogram frames; may exceed ``frames`` (the eval
            sets store the unclipped length). Never modified (the original's in-place ``div_``,
            mutated the batch and fails in modern PyTorch).
        frames: padded input length T.
        steps: output length T' of DAVEnet for that input.

    Returns:
        (B,) int64 = clamp(ceil(min(nframes, T) * T' / T), 1, T'). Integer arithmetic, so the
        ratio is exact; at least one step so an empty clip still has a defined mean.
    """
    n = nframes.long().clamp(0, frames)  # out of place: a new tensor
    return torch.div(n * steps + frames - 1, frames, rounding_mode="floor").clamp(1, steps)


def masked_time_mean(x: Tensor, steps: Tensor) -> Tensor:
    """Mean over the first ``steps[b]`` time steps of each row.

    Args:
        x: (B, C, T') features.
        steps: (B,) integers in [1, T'].

    Returns:
        (B, C) in x's dtype. Steps computed from padding are excluded, in training and evaluation
        alike (the original averaged them in during training only).
    """
    steps = steps.to(x.device)
    mask = torch.arange(x.shape[-1], device=x.device) < steps[:, None]  # (B, T')
    # Sum and divide in fp32, rounded once to x's dtype: bf16 (autocast on GPU) holds integers
    # exactly only up to 256, and the eval sets' 5120 frames give 320 steps (a bf16 divisor of 257
    # is 256: +0.4 %); the sum's dtype argument accumulates in fp32 without an fp32 copy of x.
    total = (x * mask[:, None, :].to(x.dtype)).sum(dim=-1, dtype=torch.float32)
    return (total / steps[:, None].float()).to(x.dtype)


class DavenetAudioEncoder(Encoder):
    """The original's audio branch: DAVEnet -> masked time mean -> GU(C4 -> C4) -> Linear(C4 ->
    embed_dim), (B, 40, T) -> (B, 6144) at paper size; its reconstruction target is the pooled
    DAVEnet output (C4 = 1024 wide). The gate sits at C4 and the last step is a plain Linear, as in
    the original (it gated at 1024 "for stability with mixed precision")."""

    modality = "audio"
    inputs = ("audio", "nframes")
    original_names = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        width = cfg.audio_channels[-1]
        self.davenet = DAVEnet(cfg.audio_channels, cfg.audio_blocks, cfg.mel_bins)
        self.gu_audio = GatedEmbeddingUnit(width, width)
        self.audio_proj = nn.Linear(width, cfg.embed_dim)
        self.target_dim = width

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        audio = batch["audio"]  # (B, mel_bins, T), fp16 or fp32
        feats = self.davenet(audio)  # (B, C4, T')
        steps = pooled_steps(batch["nframes"], audio.shape[-1], feats.shape[-1])
        pooled = masked_time_mean(feats, steps)  # (B, C4); same pooling in train and eval
        return self.audio_proj(self.gu_audio(pooled)), pooled
