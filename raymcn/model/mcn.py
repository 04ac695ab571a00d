"""The MCN model: three modality branches into one shared space, plus reconstruction heads.

Each branch is a part chosen by its setting from ``parts.py``'s table (``model.text_encoder:
gated``); MCN only runs the active ones and the heads. Which modalities are active is an argument
of every forward call, not a property of the model: a staged run (AV_T, VT_A, AT_V) switches the
set mid-training and an inactive branch must neither run nor receive gradient.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from torch import Tensor, nn

from raymcn.config import MODALITIES, ModelConfig
from raymcn.model.davenet import DAVEnet
from raymcn.model.parts import ENCODER_OF, part_class


class MCN(nn.Module):
    """Multimodal Clustering Network.

    Branches (the default parts; paper sizes in brackets, B = clips), each ``parts.PARTS``' class
    of its setting, held as ``video_encoder``, ``audio_encoder``, ``text_encoder``:
        video: GU_video(video_dim -> embed_dim)                      (B, 4096) -> (B, 6144)
        audio: DAVEnet -> masked time mean -> GU_audio(C4 -> C4)
               -> Linear(C4 -> embed_dim)                            (B, 40, T) -> (B, 6144)
        text:  SentenceMaxpool(word_dim -> embed_dim) -> GU_text     (B, 20, 300) -> (B, 6144)

    With ``cfg.recon`` each modality also has a head (``model.recon_head``) embed -> target,
    rebuilding what its encoder names as target: the video input (4096), the pooled DAVEnet output
    (C4 = 1024) or the sentence max-pool (6144). Paper defaults: 223.8 M parameters with the heads,
    193.4 M without.

    State dicts name an original part's parameters as the original release and every older
    checkpoint do (``gu_text.fc.weight``; ``branch.Encoder.original_names``); a new part's are named
    under its setting (``text_encoder.layers.0...``).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.video_encoder = part_class(cfg, "video_encoder")(cfg)
        self.audio_encoder = part_class(cfg, "audio_encoder")(cfg)
        self.text_encoder = part_class(cfg, "text_encoder")(cfg)
        for modality, setting in ENCODER_OF.items():
            if getattr(self, setting).modality != modality:
                raise TypeError(f"model.{setting}={getattr(cfg, setting)!r}: {type(getattr(self, setting)).__name__} "
                                f"encodes {getattr(self, setting).modality!r}, not {modality!r}")
        self.recon = None
        if cfg.recon:
            head = part_class(cfg, "recon_head")
            self.recon = nn.ModuleDict({m: head(cfg, self.encoder(m).target_dim) for m in MODALITIES})
        self._register_state_dict_hook(_original_names_on_save)
        self._register_load_state_dict_pre_hook(_original_names_on_load, with_module=True)

    def encoder(self, modality: str) -> nn.Module:
        """The part that encodes ``modality``."""
        return getattr(self, ENCODER_OF[modality])

    def set_layout(self, layout: str) -> MCN:
        """``scale.davenet_layout`` for every DAVEnet the parts hold (:meth:`DAVEnet.set_layout`)."""
        for m in self.modules():
            if isinstance(m, DAVEnet):
                m.set_layout(layout)
        return self

    def _original_slots(self) -> list[str]:
        return [setting for setting in ENCODER_OF.values() if getattr(self, setting).original_names]

    def _run(self, batch: dict[str, Tensor], active: Collection[str], with_recon: bool) -> dict:
        unknown = set(active) - set(MODALITIES)
        if unknown:
            raise ValueError(f"unknown modalities {sorted(unknown)}: allowed are {', '.join(MODALITIES)}")
        out: dict = {}
        for m in MODALITIES:  # fixed order, whatever order `active` has
            if m not in active:
                continue  # not run at all: no compute, no gradient, inputs may be absent
            emb, target = self.encoder(m)(batch)
            out[m] = emb
            if with_recon and self.recon is not None:
                # Targets are returned live; whether they are detached is the loss's decision.
                out[f"recon_{m}"] = (self.recon[m](emb), target)
        return out

    def forward(self, batch: dict[str, Tensor], active: Collection[str]) -> dict:
        """Embed the active modalities.

        Args:
            batch: ``video`` (B, video_dim) float; ``audio`` (B, mel_bins, T) fp16/fp32;
                ``nframes`` (B,) int (real audio frames, not modified); ``text``
                (B, max_words, word_dim) float; ``nwords`` (B,) int (each caption's words).
                Only the active modalities' encoders read the keys they list (``inputs``).
            active: a subset of {"video", "audio", "text"}.

        Returns:
            For each active modality m: ``m`` -> (B, embed_dim). With ``cfg.recon`` also
            ``recon_m`` -> (prediction, target), both (B, target_dim): the default parts' video
            4096 (the input), audio C4 (pooled DAVEnet output), text embed_dim (sentence max-pool).
        """
        return self._run(batch, active, with_recon=True)

    def embed(self, batch: dict[str, Tensor], active: Collection[str]) -> dict[str, Tensor]:
        """The active modalities' embeddings, no reconstruction heads: {m: (B, embed_dim)}.

        Exactly ``forward``'s embeddings (the heads only read them). For gradient caching's pass
        without autograd (``raymcn.train.gradcache``), which needs the embeddings of the whole
        share but computes the per-clip reconstruction term in its chunk pass.
        """
        return self._run(batch, active, with_recon=False)

    def encode(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """All three embeddings, no reconstruction: {"video", "audio", "text"} -> (B, embed_dim).

        For evaluation. It neither switches to eval mode nor disables grad: the caller does both.
        Call it on the bare module (``ddp_model.module.encode``); it bypasses DDP's forward.
        """
        return self._run(batch, MODALITIES, with_recon=False)


def _original_names_on_save(module: MCN, state: OrderedDict, prefix: str, local_metadata: dict) -> None:
    """State dict hook: an original part's keys lose their setting's prefix
    (``text_encoder.gu_text.fc.weight`` -> ``gu_text.fc.weight``), in place and in order, as the
    original release and older checkpoints name them (metadata keys alike)."""
    slots = [prefix + s + "." for s in module._original_slots()]

    def short(key: str) -> str:
        hit = next((s for s in slots if key.startswith(s)), None)
        return key if hit is None else prefix + key[len(hit):]

    items = list(state.items())
    state.clear()
    state.update((short(k), v) for k, v in items)
    metadata = getattr(state, "_metadata", None)  # module prefix (no final dot) -> its version
    for key in list(metadata or ()):
        if key + "." in slots:  # the part's own entry: a name no original state dict has
            del metadata[key]
        elif short(key + ".") != key + ".":
            metadata[short(key + ".")[:-1]] = metadata.pop(key)


def _original_names_on_load(module: MCN, state: dict, prefix: str, local_metadata: dict, strict: bool,
                            missing: list, unexpected: list, errors: list) -> None:
    """Load pre-hook, the inverse of :func:`_original_names_on_save`: a key under one of an original
    part's own modules (``gu_text.``) is put under its setting (``text_encoder.gu_text.``)."""
    owners = {f"{prefix}{child}.": f"{prefix}{slot}.{child}." for slot in module._original_slots()
              for child, _ in getattr(module, slot).named_children()}
    for key in list(state):
        hit = next((o for o in owners if key.startswith(o)), None)
        if hit is not None:
            state[owners[hit] + key[len(hit):]] = state.pop(key)
