"""The original MCN release's parameter names -> raymcn's MCN (spec Appendix A). torch + ModelConfig only.

The original ``Net`` (``model_kmeans_ICCV.py``) and raymcn's :class:`~raymcn.model.mcn.MCN` are the
same network layer for layer; only the module names differ. :data:`NAME_TABLE` states every
renaming explicitly, one module per row; the part of a key after its module (``weight``,
``bias``, BN statistics, a block index inside a DAVEnet layer, the Sequential index of a
reconstruction head) is the same on both sides, because both use the same torch modules.

:func:`convert` infers the architecture from the tensor shapes, builds the expected raymcn state
dict on the meta device (no memory), and accepts the checkpoint only if every tensor maps to a
raymcn parameter of exactly the right shape and none is missing. Everything else is refused with
one message per key: the original's loader silently fell back to ``strict=False``,
which is how a wrong checkpoint turns into a plausible-looking but random model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from raymcn.config import ModelConfig
from raymcn.model.mcn import MCN

# (original module, raymcn module). Every tensor of raymcn's MCN lies under exactly one row.
NAME_TABLE: tuple[tuple[str, str], ...] = (
    ("DAVEnet.conv1", "davenet.conv1"),
    ("DAVEnet.bn1", "davenet.bn1"),
    ("DAVEnet.layer1", "davenet.layers.0"),  # the original names its 4 layers; raymcn indexes a Sequential
    ("DAVEnet.layer2", "davenet.layers.1"),
    ("DAVEnet.layer3", "davenet.layers.2"),
    ("DAVEnet.layer4", "davenet.layers.3"),
    ("DAVEnet_projection", "audio_proj"),
    ("GU_audio.fc", "gu_audio.fc"),
    ("GU_audio.cg.fc", "gu_audio.gate.fc"),  # cg = Context_Gating
    ("GU_video.fc", "gu_video.fc"),
    ("GU_video.cg.fc", "gu_video.gate.fc"),
    ("text_pooling_caption.fc", "text_pool.fc"),
    ("GU_text_captions.fc", "gu_text.fc"),
    ("GU_text_captions.cg.fc", "gu_text.gate.fc"),
    ("recon_v", "recon.video"),
    ("recon_a", "recon.audio"),
    ("recon_t", "recon.text"),
)

# Built by the original's ResDavenet but never used in its forward; raymcn has no such layer.
SKIPPED_MODULES: tuple[str, ...] = ("DAVEnet.batchnorm1",)

DATA_PARALLEL_PREFIX = "module."

# Where each architecture setting can be read: (original key, dimension) in order of preference.
# Several sources per setting, so that one missing tensor is reported as missing, not as "cannot infer".
_DIM_SOURCES: dict[str, tuple[tuple[str, int], ...]] = {
    "embed_dim": (("GU_video.fc.weight", 0), ("GU_text_captions.fc.weight", 0),
                  ("text_pooling_caption.fc.weight", 0), ("DAVEnet_projection.weight", 0)),
    "video_dim": (("GU_video.fc.weight", 1), ("recon_v.2.weight", 0)),
    "word_dim": (("text_pooling_caption.fc.weight", 1),),
    "mel_bins": (("DAVEnet.conv1.weight", 2),),  # conv1 kernel (mel_bins, 1) spans the mel axis
    "recon_hidden": (("recon_v.0.weight", 0), ("recon_a.0.weight", 0), ("recon_t.0.weight", 0)),
    "width0": (("DAVEnet.conv1.weight", 0), ("DAVEnet.bn1.weight", 0)),
    **{f"width{i}": ((f"DAVEnet.layer{i}.0.conv1.weight", 0), (f"DAVEnet.layer{i}.0.bn1.weight", 0))
       for i in range(1, 5)},
}
_RECON_MODULES = ("recon_v", "recon_a", "recon_t")


class OriginalCheckpointError(ValueError):
    """The checkpoint cannot be imported; ``problems`` has one line per offending key."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n  - ".join(["cannot import the checkpoint:", *self.problems]))


@dataclass
class Conversion:
    """Result of :func:`convert`.

    Attributes:
        state_dict: raymcn names -> tensors; loads strictly into ``MCN(model)``. Floating tensors
            are float32, BN counters int64.
        model: the architecture inferred from the shapes.
        notes: what was skipped, stripped or cast, one sentence each.
    """

    state_dict: dict[str, Tensor]
    model: ModelConfig
    notes: list[str] = field(default_factory=list)


def _split(key: str, table: tuple[tuple[str, str], ...]) -> tuple[str, str] | None:
    """(target module, rest) for the longest row whose source module is a prefix of ``key``."""
    hits = [(src, dst) for src, dst in table if key.startswith(src + ".")]
    if not hits:
        return None
    src, dst = max(hits, key=lambda row: len(row[0]))
    return dst, key[len(src) + 1:]


def to_raymcn_name(original: str) -> str | None:
    """raymcn's name for an original key, or None if no row of :data:`NAME_TABLE` covers it."""
    hit = _split(original, NAME_TABLE)
    return None if hit is None else f"{hit[0]}.{hit[1]}"


def to_original_name(raymcn: str) -> str | None:
    """Inverse of :func:`to_raymcn_name` (the table is one-to-one)."""
    hit = _split(raymcn, tuple((dst, src) for src, dst in NAME_TABLE))
    return None if hit is None else f"{hit[0]}.{hit[1]}"


def strip_data_parallel(state: Mapping[str, object]) -> tuple[dict[str, object], bool]:
    """Remove DataParallel's ``module.`` prefix when every key has it (``amp_checkpoint.pt`` saves
    ``net.state_dict()`` of the wrapped model). A dict where only some keys have it is left as it
    is, so those keys are reported as unmappable instead of being guessed at."""
    keys = list(state)
    if keys and all(k.startswith(DATA_PARALLEL_PREFIX) for k in keys):
        return {k[len(DATA_PARALLEL_PREFIX):]: v for k, v in state.items()}, True
    return dict(state), False


def infer_model_config(shapes: Mapping[str, tuple[int, ...]]) -> tuple[ModelConfig | None, list[str]]:
    """Architecture settings read from original-named tensor shapes.

    Args:
        shapes: original key (no ``module.`` prefix) -> shape.

    Returns:
        (ModelConfig or None, problems). Inferred: embed_dim, video_dim, word_dim, mel_bins,
        audio_channels (conv1 + layer1..4 widths), audio_blocks (per layer), recon (any
        reconstruction head present) and recon_hidden. The other tensors' shapes are checked
        against the model built from these settings by :func:`convert`.
    """
    problems: list[str] = []
    dims: dict[str, int] = {}
    for setting, sources in _DIM_SOURCES.items():
        label = f"model.{setting}" if not setting.startswith("width") else f"model.audio_channels[{setting[5:]}]"
        if setting == "recon_hidden" and not any(k.startswith(m + ".") for k in shapes for m in _RECON_MODULES):
            continue  # a checkpoint of a --recon 0 run: no heads, nothing to infer
        present = [(k, d) for k, d in sources if k in shapes]
        if not present:
            keys = [k for k, _ in sources]
            problems.append(f"{keys[0]}: missing (the only source of {label})" if len(keys) == 1 else
                            f"{', '.join(keys)}: all missing (the sources of {label})")
            continue
        short = [k for k, d in present if len(shapes[k]) <= d]
        if short:
            problems += [f"{k}: shape {tuple(shapes[k])} has too few dimensions for a {label} source" for k in short]
            continue
        values = {k: int(shapes[k][d]) for k, d in present}
        if len(set(values.values())) > 1:  # the odd one out is the wrong shape; name every source
            problems.append(f"{label}: the shapes disagree: " + ", ".join(
                f"{k} {tuple(shapes[k])} says {v}" for k, v in values.items()))
            continue
        dims[setting] = values[present[0][0]]
    # Blocks per layer: the count most layers agree on (ties: the smaller), so that one stray or
    # missing block is reported key by key instead of changing the architecture of all four layers.
    counts = [1 + max((int(k.split(".")[2]) for k in shapes
                       if k.startswith(f"DAVEnet.layer{i}.") and k.split(".")[2].isdigit()), default=-1)
              for i in range(1, 5)]
    counts = [c for c in counts if c > 0]
    if not counts:
        problems.append("cannot infer model.audio_blocks: no DAVEnet.layer<N>.<block>.* key in the checkpoint")
    if problems:
        return None, problems
    recon = "recon_hidden" in dims
    cfg = ModelConfig(video_dim=dims["video_dim"], word_dim=dims["word_dim"], embed_dim=dims["embed_dim"],
                      audio_channels=tuple(dims[f"width{i}"] for i in range(5)),
                      audio_blocks=max(set(counts), key=lambda c: (counts.count(c), -c)),
                      mel_bins=dims["mel_bins"], recon=recon,
                      recon_hidden=dims["recon_hidden"] if recon else ModelConfig.recon_hidden)
    return cfg, []


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """raymcn key -> shape of ``MCN(cfg).state_dict()``, built on the meta device (allocates nothing)."""
    with torch.device("meta"):
        model = MCN(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def convert(state: Mapping[str, object]) -> Conversion:
    """Map an original state dict (``e{N}.pth``, or the ``net`` entry of ``amp_checkpoint.pt``) to raymcn.

    Args:
        state: original key -> tensor, with or without DataParallel's ``module.`` prefix. At paper
            size: 159 tensors (spec Appendix A), 5 of them the unused ``DAVEnet.batchnorm1``.

    Returns:
        A :class:`Conversion` whose ``state_dict`` loads strictly into ``MCN(conversion.model)``.

    Raises:
        OriginalCheckpointError: listing, one line each, every key that no table row covers,
            every key the inferred model does not have, every missing key, every wrong shape and
            every value that is not a tensor.
    """
    state, stripped = strip_data_parallel(state)
    notes = [f"stripped DataParallel's '{DATA_PARALLEL_PREFIX}' prefix from all {len(state)} keys"] if stripped else []
    skipped = sorted(k for k in state if any(k.startswith(m + ".") for m in SKIPPED_MODULES))
    problems = [f"{k}: is a {type(v).__name__}, not a tensor" for k, v in state.items()
                if not isinstance(v, Tensor) and k not in skipped]
    tensors = {k: v for k, v in state.items() if isinstance(v, Tensor) and k not in skipped}
    unmapped = [k for k in tensors if to_raymcn_name(k) is None]
    problems += [f"{k}: no entry in the name table (not part of the MCN model: unused options such as "
                 f"--withMLP/--project or another model's layers are not imported)" for k in unmapped]
    cfg, infer_problems = infer_model_config({k: tuple(v.shape) for k, v in tensors.items() if k not in unmapped})
    if cfg is None:
        raise OriginalCheckpointError(problems + infer_problems)
    try:
        expected = expected_shapes(cfg)
    except (RuntimeError, ValueError) as e:  # e.g. a zero width read from a damaged tensor
        raise OriginalCheckpointError(problems + [f"the inferred settings ({_describe(cfg)}) do not build a "
                                                  f"model: {e}"]) from None

    out: dict[str, Tensor] = {}
    cast: set[str] = set()
    for key, value in tensors.items():
        name = to_raymcn_name(key)
        if name is None:
            continue  # reported above
        if name not in expected:
            problems.append(f"{key}: would be raymcn's {name}, which the model inferred from the shapes does not "
                            f"have ({_describe(cfg)})")
        elif tuple(value.shape) != expected[name]:
            problems.append(f"{key}: shape {tuple(value.shape)}, but raymcn's {name} needs {expected[name]} for "
                            f"{_describe(cfg)}")
        else:
            if value.is_floating_point() and value.dtype != torch.float32:
                cast.add(str(value.dtype).removeprefix("torch."))
                value = value.float()
            out[name] = value
    for name, shape in expected.items():
        original = to_original_name(name)
        if original not in tensors and original not in state:  # a non-tensor value is reported above
            problems.append(f"{original}: missing (raymcn's {name}, shape {shape})")
    if problems:
        raise OriginalCheckpointError(problems)
    for module in SKIPPED_MODULES:
        parts = [k[len(module) + 1:] for k in skipped if k.startswith(module + ".")]
        if parts:
            notes.append(f"skipped {module} ({', '.join(parts)}): the original builds it but never uses it in its "
                         "forward, and raymcn's model has no such layer")
    if cast:
        notes.append(f"cast {', '.join(sorted(cast))} tensors to float32")
    return Conversion(state_dict=out, model=cfg, notes=notes)


def _describe(cfg: ModelConfig) -> str:
    return (f"embed_dim={cfg.embed_dim}, video_dim={cfg.video_dim}, word_dim={cfg.word_dim}, "
            f"audio_channels={list(cfg.audio_channels)}, audio_blocks={cfg.audio_blocks}, mel_bins={cfg.mel_bins}, "
            f"recon={cfg.recon}" + (f", recon_hidden={cfg.recon_hidden}" if cfg.recon else ""))
