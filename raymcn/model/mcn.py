"""The MCN model: three modality branches into one shared space, plus reconstruction heads.

Which modalities are active is an argument of every forward call, not a property of the model:
a staged run (AV_T, VT_A, AT_V) switches the set mid-training and an inactive branch must neither
run nor receive gradient.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import Tensor, nn

from raymcn.config import MODALITIES, ModelConfig
from raymcn.model.davenet import DAVEnet, masked_time_mean, pooled_steps
from raymcn.model.gated import GatedEmbeddingUnit, SentenceMaxpool


def _recon_head(embed_dim: int, hidden: int, target_dim: int) -> nn.Sequential:
    """embed -> hidden -> target MLP. The final ReLU is the original's; targets are >= 0 in the paper setup."""
    return nn.Sequential(
        nn.Linear(embed_dim, hidden), nn.ReLU(inplace=True),
        nn.Linear(hidden, target_dim), nn.ReLU(inplace=True),
    )


class MCN(nn.Module):
    """Multimodal Clustering Network.

    Branches (paper sizes in brackets, B = clips):
        video: GU_video(video_dim -> embed_dim)                      (B, 4096) -> (B, 6144)
        audio: DAVEnet -> masked time mean -> GU_audio(C4 -> C4)
               -> Linear(C4 -> embed_dim)                            (B, 40, T) -> (B, 6144)
        text:  SentenceMaxpool(word_dim -> embed_dim) -> GU_text     (B, 20, 300) -> (B, 6144)

    With ``cfg.recon`` each modality also has a head embed -> recon_hidden -> target reconstructing
    the video input (4096), the pooled DAVEnet output (C4 = 1024) or the sentence max-pool (6144).
    Paper defaults: 223.8 M parameters with the heads, 193.4 M without.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        audio_dim = cfg.audio_channels[-1]
        self.gu_video = GatedEmbeddingUnit(cfg.video_dim, cfg.embed_dim)
        self.davenet = DAVEnet(cfg.audio_channels, cfg.audio_blocks, cfg.mel_bins)
        # The audio gate sits at C4 and the last step is a plain Linear, as in the original (it
        # gated at 1024 "for stability with mixed precision").
        self.gu_audio = GatedEmbeddingUnit(audio_dim, audio_dim)
        self.audio_proj = nn.Linear(audio_dim, cfg.embed_dim)
        self.text_pool = SentenceMaxpool(cfg.word_dim, cfg.embed_dim)
        self.gu_text = GatedEmbeddingUnit(cfg.embed_dim, cfg.embed_dim)
        self.recon = None
        if cfg.recon:
            targets = {"video": cfg.video_dim, "audio": audio_dim, "text": cfg.embed_dim}
            self.recon = nn.ModuleDict(
                {m: _recon_head(cfg.embed_dim, cfg.recon_hidden, d) for m, d in targets.items()})

    # --- branches: each returns (embedding (B, embed_dim), reconstruction target (B, target_dim)) ---
    def _video(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        video = batch["video"]  # (B, video_dim)
        return self.gu_video(video), video

    def _audio(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        audio = batch["audio"]  # (B, mel_bins, T), fp16 or fp32
        feats = self.davenet(audio)  # (B, C4, T')
        steps = pooled_steps(batch["nframes"], audio.shape[-1], feats.shape[-1])
        pooled = masked_time_mean(feats, steps)  # (B, C4); same pooling in train and eval
        return self.audio_proj(self.gu_audio(pooled)), pooled

    def _text(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        pooled = self.text_pool(batch["text"])  # (B, max_words, word_dim) -> (B, embed_dim)
        return self.gu_text(pooled), pooled

    def _run(self, batch: dict[str, Tensor], active: Collection[str], with_recon: bool) -> dict:
        unknown = set(active) - set(MODALITIES)
        if unknown:
            raise ValueError(f"unknown modalities {sorted(unknown)}: allowed are {', '.join(MODALITIES)}")
        branches = {"video": self._video, "audio": self._audio, "text": self._text}
        out: dict = {}
        for m in MODALITIES:  # fixed order, whatever order `active` has
            if m not in active:
                continue  # not run at all: no compute, no gradient, inputs may be absent
            emb, target = branches[m](batch)
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
                (B, max_words, word_dim) float. Only the active modalities' keys are read
                (audio needs ``audio`` and ``nframes``).
            active: a subset of {"video", "audio", "text"}.

        Returns:
            For each active modality m: ``m`` -> (B, embed_dim). With ``cfg.recon`` also
            ``recon_m`` -> (prediction, target), both (B, target_dim): video 4096 (the input),
            audio C4 (pooled DAVEnet output), text embed_dim (sentence max-pool output).
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
