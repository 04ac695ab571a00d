"""The model's sizes as the memory estimate counts them: parameters, BatchNorm layers and what
each clip's forward saves for the backward, derived from ``ModelConfig`` alone (no torch).

``footprint.py`` composes them into a worker's memory; ``tests/test_footprint.py`` checks each
against a built model and torch's allocator.
"""

from __future__ import annotations

import itertools

from raymcn.config import ModelConfig
from raymcn.train.preflight.convspace import FP32, ceil_half


def parameter_tensors(model_cfg: ModelConfig) -> tuple[list[int], int]:
    """Element counts of every parameter tensor of :class:`raymcn.model.MCN`, and of its float
    buffers (BN running statistics), from the config alone (``tests/test_footprint.py`` checks them
    against the real module)."""
    m = model_cfg
    sizes: list[int] = []
    bn_channels = 0

    def linear(i: int, o: int) -> None:
        sizes.extend((i * o, o))

    def geu(i: int, o: int) -> None:  # Linear(i, o) then ContextGating(o) = Linear(o, o)
        linear(i, o)
        linear(o, o)

    def bn(c: int) -> None:
        nonlocal bn_channels
        sizes.extend((c, c))
        bn_channels += c

    c = m.audio_channels
    geu(m.video_dim, m.embed_dim)  # gu_video
    sizes.append(m.mel_bins * c[0])  # DAVEnet conv1 (mel, 1), no bias
    bn(c[0])
    for cin, cout in itertools.pairwise(c):
        for blk in range(m.audio_blocks):
            i = cin if blk == 0 else cout
            sizes.extend((i * cout * 9, cout * cout * 9))  # two (1, 9) convs, no bias
            bn(cout)
            bn(cout)
            if blk == 0:  # stride 2: projection shortcut (1x1 conv + BN)
                sizes.append(cin * cout)
                bn(cout)
    geu(c[-1], c[-1])  # gu_audio
    linear(c[-1], m.embed_dim)  # audio_proj
    linear(m.word_dim, m.embed_dim)  # text_pool
    geu(m.embed_dim, m.embed_dim)  # gu_text
    if m.recon:
        for target in (m.video_dim, c[-1], m.embed_dim):
            linear(m.embed_dim, m.recon_hidden)
            linear(m.recon_hidden, target)
    return sizes, 2 * bn_channels


def parameter_stats(model_cfg: ModelConfig) -> tuple[int, int]:
    """(parameters + float buffers, largest parameter tensor) of :class:`raymcn.model.MCN`, in
    elements (analytic: no model is built, so the preflight stays instant)."""
    sizes, buffers = parameter_tensors(model_cfg)
    return sum(sizes) + buffers, max(sizes)


def count_parameters(model_cfg: ModelConfig) -> int:
    """Parameters plus float buffers (BN running statistics) of :class:`raymcn.model.MCN`."""
    return parameter_stats(model_cfg)[0]


def batchnorm_layers(model_cfg: ModelConfig) -> int:
    """BatchNorm layers of DAVEnet: conv1's, then per layer two per block and the shortcut's."""
    return 1 + (len(model_cfg.audio_channels) - 1) * (2 * model_cfg.audio_blocks + 1)


def batchnorm_saved_bytes(model_cfg: ModelConfig) -> int:
    """BatchNorm's saved batch mean and inverse std (fp32, per channel): a per-step constant."""
    return parameter_tensors(model_cfg)[1] * FP32  # 2 per channel, as many as its running statistics


def batchnorm_input_elements_per_clip(model_cfg: ModelConfig, audio_frames: int) -> int:
    """Elements entering DAVEnet's BatchNorms per clip: conv1's output, then per layer three BNs of
    the first block (two convs, the shortcut) and two of every further block, at the layer's length."""
    c, t = model_cfg.audio_channels, audio_frames
    n = c[0] * t
    for width in c[1:]:
        t = ceil_half(t)
        n += (3 + 2 * (model_cfg.audio_blocks - 1)) * width * t
    return n


def global_batchnorm_extra_bytes(model_cfg: ModelConfig, audio_frames: int, clips: int) -> int:
    """What ``model.sync_batchnorm`` on CPU (``GlobalBatchNorm2d``, element-wise ops instead of the
    fused kernel) saves beyond BatchNorm: two copies of every BN input (the centred and the
    normalised input; measured 2.02x on a tiny DAVEnet), plus a few per-channel statistics."""
    return FP32 * (2 * clips * batchnorm_input_elements_per_clip(model_cfg, audio_frames)
                   + 4 * parameter_tensors(model_cfg)[1])


def activation_elements_per_clip(model_cfg: ModelConfig, audio_frames: int,
                                 active: tuple[str, ...] = ("video", "audio", "text"),
                                 max_words: int = 20) -> dict[str, int]:
    """Float elements the forward saves for backward, per clip and per branch (batch inputs excluded).

    int64 argmax indices count as 2 elements. BatchNorm's per-channel batch statistics (a per-step
    constant, 155 KB at paper dims) are left out. Per branch (T = audio frames, T_l = ⌈T/2^l⌉,
    C = ``audio_channels``, D = ``embed_dim``, H = ``recon_hidden``, W = ``max_words``):

    * audio: the fp32 copy of the fp16 spectrogram (mel·T), conv1 output and its ReLU (2·C0·T),
      per layer 5·C_l·T_l for the first block (2 convs, 2 ReLUs, the projection shortcut's conv)
      and 4·C_l·T_l for each further block, the pooling mask and divisor (T_4 + 1), the gated unit at C4
      (pooled input, fc output, sigmoid, gated output: 4·C4), the embedding (D), and the
      reconstruction head's two ReLU outputs (H + C4).
    * video: gated unit fc output, sigmoid, embedding (3·D) and the head (H + video_dim).
    * text: per-word ReLU output (W·D), max indices (2·D), pooled vector, gated unit (4·D) and the
      head (H + D).
    """
    c = model_cfg.audio_channels
    d, h = model_cfg.embed_dim, model_cfg.recon_hidden if model_cfg.recon else 0
    out: dict[str, int] = {}
    if "audio" in active:
        t = audio_frames
        n = model_cfg.mel_bins * t + 2 * c[0] * t
        for width in c[1:]:
            t = ceil_half(t)
            n += (5 + 4 * (model_cfg.audio_blocks - 1)) * width * t
        n += t + 1 + 4 * c[-1] + d + ((h + c[-1]) if model_cfg.recon else 0)
        out["audio"] = n
    if "video" in active:
        out["video"] = 3 * d + ((h + model_cfg.video_dim) if model_cfg.recon else 0)
    if "text" in active:
        out["text"] = max_words * d + 2 * d + 4 * d + ((h + d) if model_cfg.recon else 0)
    return out


def recon_dims(model_cfg: ModelConfig, detach_targets: bool) -> tuple[int, int]:
    """(F, F_live): reconstruction prediction width summed over modalities, and the width of the
    targets that receive gradient (audio C4 and text D unless detached; the video target is the input)."""
    if not model_cfg.recon:
        return 0, 0
    c4, d = model_cfg.audio_channels[-1], model_cfg.embed_dim
    return model_cfg.video_dim + c4 + d, 0 if detach_targets else c4 + d
