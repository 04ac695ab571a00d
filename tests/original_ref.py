"""The original MCN checkpoint and forward pass, rebuilt for tests from the spec alone (no raymcn code).

``original_state_dict`` writes the tensors the original ``Net`` saves (names and shape rules of
spec Appendix A, any width); ``OriginalReference`` computes the original's forward pass with
torch.nn.functional straight from those original-named tensors, following the original model and the
original's own formulations (Context Gating as a GLU over [x, Wx+b], eval-mode audio pooling over
the first max(1, nframes // 16) steps). It shares nothing with raymcn's model or name table, so a
round trip through the importer that agrees with it is evidence that the mapping is right.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BN_SUFFIXES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class Dims:
    """Sizes of an original Net. Paper: Dims() (embd_dim 6144, video_dim 4096, recon_size 1024)."""

    widths: tuple[int, ...] = (128, 128, 256, 512, 1024)  # conv1, layer1..layer4
    blocks: int = 2
    embed: int = 6144
    video: int = 4096
    word: int = 300
    mel: int = 40
    recon_size: int = 1024
    recon: bool = True


# Small variant: the eval sets fix video (4096 = 2 x 2048) and mel bins (40); the rest is shrunk.
SMALL = Dims(widths=(4, 4, 8, 8, 16), blocks=2, embed=32, video=4096, word=24, mel=40, recon_size=12)


def original_shapes(d: Dims) -> "OrderedDict[str, tuple[int, ...]]":
    """Original key -> shape, in the original module order (paper size: the 159 rows of Appendix A)."""
    s: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def bn(prefix: str, ch: int) -> None:
        for suffix in BN_SUFFIXES:
            s[f"{prefix}.{suffix}"] = () if suffix == "num_batches_tracked" else (ch,)

    bn("DAVEnet.batchnorm1", 1)  # built, never used in forward
    s["DAVEnet.conv1.weight"] = (d.widths[0], 1, d.mel, 1)
    bn("DAVEnet.bn1", d.widths[0])
    for layer in range(1, 5):
        out = d.widths[layer]
        for b in range(d.blocks):
            inp = d.widths[layer - 1] if b == 0 else out
            p = f"DAVEnet.layer{layer}.{b}"
            s[f"{p}.conv1.weight"] = (out, inp, 1, 9)
            bn(f"{p}.bn1", out)
            s[f"{p}.conv2.weight"] = (out, out, 1, 9)
            bn(f"{p}.bn2", out)
            if b == 0:  # stride 2: 1x1 conv + BN shortcut
                s[f"{p}.downsample.0.weight"] = (out, inp, 1, 1)
                bn(f"{p}.downsample.1", out)
    a = d.widths[-1]
    s["DAVEnet_projection.weight"], s["DAVEnet_projection.bias"] = (d.embed, a), (d.embed,)
    for name, (i, o) in {"GU_audio": (a, a), "GU_video": (d.video, d.embed)}.items():
        s[f"{name}.fc.weight"], s[f"{name}.fc.bias"] = (o, i), (o,)
        s[f"{name}.cg.fc.weight"], s[f"{name}.cg.fc.bias"] = (o, o), (o,)
    s["text_pooling_caption.fc.weight"], s["text_pooling_caption.fc.bias"] = (d.embed, d.word), (d.embed,)
    s["GU_text_captions.fc.weight"], s["GU_text_captions.fc.bias"] = (d.embed, d.embed), (d.embed,)
    s["GU_text_captions.cg.fc.weight"], s["GU_text_captions.cg.fc.bias"] = (d.embed, d.embed), (d.embed,)
    if d.recon:
        for name, target in (("recon_v", d.video), ("recon_a", a), ("recon_t", d.embed)):
            s[f"{name}.0.weight"], s[f"{name}.0.bias"] = (d.recon_size, d.embed), (d.recon_size,)
            s[f"{name}.2.weight"], s[f"{name}.2.bias"] = (target, d.recon_size), (target,)
    return s


def original_state_dict(d: Dims, seed: int = 0, device: str | None = None) -> "OrderedDict[str, torch.Tensor]":
    """Random tensors of the original's names and shapes. BN statistics are non-trivial (mean != 0,
    var != 1) so that eval mode actually uses them; ``device="meta"`` allocates nothing."""
    g = torch.Generator().manual_seed(seed)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, shape in original_shapes(d).items():
        if device == "meta":
            dtype = torch.long if key.endswith("num_batches_tracked") else torch.float32
            out[key] = torch.empty(shape, dtype=dtype, device="meta")
        elif key.endswith("num_batches_tracked"):
            out[key] = torch.tensor(1234)
        elif key.endswith("running_var"):
            out[key] = 0.5 + torch.rand(shape, generator=g)
        elif key.endswith("running_mean"):
            out[key] = 0.2 * torch.randn(shape, generator=g)
        elif ".bn" in key or "downsample.1" in key or "batchnorm1" in key:  # BN affine
            out[key] = (1.0 if key.endswith("weight") else 0.0) + 0.1 * torch.randn(shape, generator=g)
        else:  # conv / linear: fan-in scaled, so activations keep a sensible range through the net
            fan_in = max(1, int(torch.tensor(shape[1:]).prod())) if len(shape) > 1 else shape[0]
            out[key] = torch.randn(shape, generator=g) / fan_in ** 0.5
    return out


def save_original(path, sd, form="pth", prefix=False, legacy=False):
    """Write ``sd`` as the original does: e{N}.pth = state dict; amp_checkpoint.pt = {'net', ...}."""
    if prefix:
        sd = {f"module.{k}": v for k, v in sd.items()}
    obj = sd
    if form == "amp":  # plain values only, as apex/torch state dicts are
        obj = {"net": sd, "optimizer": {"state": {0: {"step": 10, "exp_avg": torch.zeros(3)}},
                                        "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "params": [0]}]},
               "scheduler": {"last_epoch": 10, "base_lrs": [1e-4], "lr_lambdas": [None]},
               "amp": {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 7}}}
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)  # legacy: the torch 1.3 era's format
    return path


class OriginalReference:
    """The original Net's forward (README configuration: tri_modal, recon) from original-named tensors."""

    def __init__(self, sd: dict[str, torch.Tensor], d: Dims):
        self.sd, self.d = sd, d

    def _bn(self, x, p, training):
        sd = self.sd
        return F.batch_norm(x, sd[f"{p}.running_mean"].clone(), sd[f"{p}.running_var"].clone(), sd[f"{p}.weight"],
                            sd[f"{p}.bias"], training=training, momentum=0.1, eps=1e-5)

    def _lin(self, x, p):
        return F.linear(x, self.sd[f"{p}.weight"], self.sd[f"{p}.bias"])

    def _gated_unit(self, x, p):
        x = self._lin(x, f"{p}.fc")
        return F.glu(torch.cat((x, self._lin(x, f"{p}.cg.fc")), 1), 1)  # Context_Gating as the original writes it

    def davenet(self, audio, training=False):
        """(B, mel, T) -> (B, C4, T')."""
        sd, bn = self.sd, self._bn
        x = audio.float().unsqueeze(1)
        x = F.relu(bn(F.conv2d(x, sd["DAVEnet.conv1.weight"]), "DAVEnet.bn1", training))
        for layer in range(1, 5):
            for b in range(self.d.blocks):
                p, stride = f"DAVEnet.layer{layer}.{b}", 2 if b == 0 else 1
                out = F.relu(bn(F.conv2d(x, sd[f"{p}.conv1.weight"], stride=stride, padding=(0, 4)), f"{p}.bn1",
                                training))
                out = bn(F.conv2d(out, sd[f"{p}.conv2.weight"], padding=(0, 4)), f"{p}.bn2", training)
                res = x if b else bn(F.conv2d(x, sd[f"{p}.downsample.0.weight"], stride=stride),
                                     f"{p}.downsample.1", training)
                x = F.relu(out + res)
        return x.squeeze(2)

    def forward(self, video, audio, nframes, text, training=False, steps="original"):
        """The original's outputs (a, v, t) plus each recon head's (prediction, target).

        Eval mode pools audio over the first max(1, nframes // ratio) steps (the original's
        in-place floor division); ``steps="ceil"`` instead takes raymcn's documented deviation,
        ceil(min(nframes, T) * T' / T) steps. Train mode averages all steps, padding included.
        """
        feats = self.davenet(audio, training)
        frames, out_steps = audio.shape[-1], feats.shape[-1]
        if training:
            pooled = feats.mean(dim=2)
        else:
            ratio = round(frames / out_steps)
            counts = [max(1, int(n) // ratio) if steps == "original" else
                      max(1, math.ceil(min(int(n), frames) * out_steps / frames)) for n in nframes]
            pooled = torch.stack([feats[i, :, :c].mean(dim=1) for i, c in enumerate(counts)])
        v = self._gated_unit(video, "GU_video")
        a = self._lin(self._gated_unit(pooled, "GU_audio"), "DAVEnet_projection")
        t_bar = F.relu(self._lin(text, "text_pooling_caption.fc")).max(dim=1).values
        t = self._gated_unit(t_bar, "GU_text_captions")
        out = {"video": v, "audio": a, "text": t}
        if self.d.recon:
            def head(x, p):
                return F.relu(self._lin(F.relu(self._lin(x, f"{p}.0")), f"{p}.2"))
            out.update(recon_video=(head(v, "recon_v"), video), recon_audio=(head(a, "recon_a"), pooled),
                       recon_text=(head(t, "recon_t"), t_bar))
        return out
