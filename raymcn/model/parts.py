"""The model's parts by name: the one table a setting chooses from.

Each ``model.*`` part setting (``model.video_encoder``, ``model.audio_encoder``,
``model.text_encoder``, ``model.recon_head``) names a class of :data:`PARTS`. A new part is a class
in ``raymcn/model/`` (deriving from ``branch.Encoder``, ``branch.TextEncoder`` or
``branch.ReconHead``) plus its entry here; the preflight checks the names before Ray starts
(:func:`name_problem`), sweeps may sweep them, and the settings page lists them.
"""

from __future__ import annotations

from raymcn.config import ModelConfig
from raymcn.model.branch import Encoder, ReconHead, TextEncoder
from raymcn.model.davenet import DavenetAudioEncoder
from raymcn.model.gated import GatedTextEncoder, GatedVideoEncoder
from raymcn.model.heads import MLPReconHead

# setting -> name -> class. The first name of each is the default (config/sections.py's ModelConfig).
PARTS: dict[str, dict[str, type]] = {
    "video_encoder": {"gated": GatedVideoEncoder},
    "audio_encoder": {"davenet": DavenetAudioEncoder},
    "text_encoder": {"gated": GatedTextEncoder},
    "recon_head": {"mlp": MLPReconHead},
}
# what each setting's classes derive from
_BASES = {"video_encoder": Encoder, "audio_encoder": Encoder, "text_encoder": TextEncoder, "recon_head": ReconHead}
ENCODER_OF = {"video": "video_encoder", "audio": "audio_encoder", "text": "text_encoder"}  # modality -> setting


def part_names() -> dict[str, tuple[str, ...]]:
    """``model.<setting>`` -> the names it allows (what the settings page and the errors list)."""
    return {f"model.{setting}": tuple(table) for setting, table in PARTS.items()}


def name_problem(setting: str, name: object) -> str | None:
    """Why ``name`` is no part of ``setting`` (with the allowed names), or None when it is one."""
    if name in PARTS[setting]:
        return None
    return (f"model.{setting}={name!r}: allowed values are {', '.join(PARTS[setting])} (the parts named in "
            "raymcn/model/parts.py)")


def part_class(cfg: ModelConfig, setting: str) -> type:
    """The class ``cfg``'s ``setting`` names. Raises ValueError naming the allowed values."""
    name = getattr(cfg, setting)
    problem = name_problem(setting, name)
    if problem:
        raise ValueError(problem)
    cls = PARTS[setting][name]
    if not issubclass(cls, _BASES[setting]):
        raise TypeError(f"model.{setting}={name!r}: {cls.__name__} does not derive from {_BASES[setting].__name__}")
    return cls


def text_in_bf16(cfg: ModelConfig, use_gpu: bool) -> bool:
    """Whether the reader sends the word vectors as bfloat16: on a GPU run (bf16 autocast) when the
    text encoder says every use of them rounds them to bf16 anyway (``TextEncoder.bf16_input``)."""
    return bool(use_gpu) and part_class(cfg, "text_encoder").bf16_input
