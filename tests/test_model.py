"""Model tests (default tier: no Ray, no process group). Paper-size models are built on the meta
device, so counting 224 M parameters allocates nothing."""

from __future__ import annotations

import math

import pytest
import torch

from raymcn.config import ModelConfig
from raymcn.model import MCN
from raymcn.model.davenet import DAVEnet, masked_time_mean, pooled_steps
from raymcn.model.gated import ContextGating, GatedEmbeddingUnit, SentenceMaxpool

TINY = ModelConfig(embed_dim=32, audio_channels=(4, 4, 8, 8, 16), recon_hidden=16)
TINY_CH = TINY.audio_channels
ALL = ("video", "audio", "text")


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def make_batch(cfg: ModelConfig = TINY, b: int = 3, frames: int = 160, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "video": torch.rand(b, cfg.video_dim, generator=g),
        "audio": torch.randn(b, cfg.mel_bins, frames, generator=g),
        # nframes may exceed T: eval sets store the unclipped length
        "nframes": torch.tensor([frames + 40, frames // 2, 7][:b], dtype=torch.int32),
        "text": torch.randn(b, 20, cfg.word_dim, generator=g),
    }


@pytest.fixture(scope="module")
def paper_meta() -> MCN:
    with torch.device("meta"):
        return MCN(ModelConfig())


@pytest.fixture
def tiny() -> MCN:
    torch.manual_seed(0)
    return MCN(TINY)


# --- parameter counts ----------------------------------------------------------------
def test_paper_parameter_count_with_recon(paper_meta):
    assert abs(n_params(paper_meta) / 1e6 - 223.8) <= 0.05


def test_paper_parameter_count_without_recon():
    with torch.device("meta"):
        model = MCN(ModelConfig(recon=False))
    assert model.recon is None
    assert abs(n_params(model) / 1e6 - 193.4) <= 0.05


@pytest.mark.parametrize("attr, millions", [
    ("audio_encoder.davenet", 44.67), ("audio_encoder.gu_audio", 2.10), ("audio_encoder.audio_proj", 6.30),
    ("video_encoder.gu_video", 62.93), ("text_encoder.text_pool", 1.85), ("text_encoder.gu_text", 75.51),
])
def test_paper_module_counts(paper_meta, attr, millions):
    assert abs(n_params(paper_meta.get_submodule(attr)) / 1e6 - millions) <= 0.005


@pytest.mark.parametrize("modality, millions", [("video", 10.49), ("audio", 7.34), ("text", 12.59)])
def test_paper_recon_head_counts(paper_meta, modality, millions):
    assert abs(n_params(paper_meta.recon[modality]) / 1e6 - millions) <= 0.005


def test_davenet_has_no_unused_batchnorm(paper_meta):
    assert not any("batchnorm1" in k for k in paper_meta.state_dict())


# --- DAVEnet ----------------------------------------------------------------------------------------
def test_davenet_paper_shape_t1000():
    torch.manual_seed(0)
    net = DAVEnet().eval()
    with torch.no_grad():
        out = net(torch.randn(1, 40, 1000))
    assert out.shape == (1, 1024, 63)


@pytest.mark.parametrize("frames, steps", [(1000, 63), (3072, 192), (5120, 320), (1, 1), (17, 2)])
def test_davenet_time_downsampling(frames, steps):
    net = DAVEnet(TINY_CH).eval()
    with torch.no_grad():
        out = net(torch.randn(2, 40, frames))
    assert out.shape == (2, TINY_CH[-1], steps) == (2, 16, math.ceil(frames / 16))


def test_davenet_init():
    torch.manual_seed(0)
    net = DAVEnet((8, 16, 16, 32, 256))
    w = net.layers[3][0].conv1.weight  # (256, 32, 1, 9): n = 1 * 9 * 256
    assert abs(w.std().item() - math.sqrt(2 / (9 * 256))) < 0.1 * math.sqrt(2 / (9 * 256))
    assert net.conv1.bias is None and net.layers[0][0].conv1.bias is None
    assert torch.equal(net.bn1.weight, torch.ones(8)) and torch.equal(net.bn1.bias, torch.zeros(8))
    # the first block of every layer projects its shortcut, later blocks are identity shortcuts
    assert all(layer[0].downsample is not None and layer[1].downsample is None for layer in net.layers)


def test_davenet_rejects_wrong_mel_bins():
    with pytest.raises(ValueError, match="40"):
        DAVEnet(TINY_CH)(torch.randn(1, 64, 100))


# --- pooling helpers --------------------------------------------------------------------------------
def test_pooled_steps_values():
    nframes = torch.tensor([0, 1, 500, 999, 1000, 5000])
    got = pooled_steps(nframes, frames=1000, steps=63)
    # ceil(min(n, 1000) * 63 / 1000) clamped to [1, 63]
    assert got.tolist() == [1, 1, 32, 63, 63, 63]
    assert got.dtype == torch.int64


def test_pooled_steps_does_not_mutate():
    nframes = torch.tensor([1000, 400, 5000], dtype=torch.int32)
    before = nframes.clone()
    pooled_steps(nframes, 1000, 63)
    assert torch.equal(nframes, before)


def test_masked_time_mean_values():
    x = torch.arange(2 * 1 * 4, dtype=torch.float32).view(2, 1, 4)  # rows [0,1,2,3], [4,5,6,7]
    got = masked_time_mean(x, torch.tensor([2, 4]))
    assert torch.allclose(got, torch.tensor([[0.5], [5.5]]))


@pytest.mark.parametrize("steps", [257, 300, 319])
def test_masked_time_mean_in_bf16_is_not_scaled_past_256_steps(steps):
    """Under bf16 (GPU autocast) the divisor was cast to bf16, which rounds integers above 256
    (the YouCook2 eval's 5120 frames give 320 steps): every pooled value was scaled by
    steps / bf16(steps), up to 0.4 %. Over many values the bf16 result may round either way but
    must not be biased."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(64, 256, 320, generator=g)  # (B, C, T') fp32 reference
    n = torch.full((64,), steps)
    want = masked_time_mean(x, n)
    got = masked_time_mean(x.bfloat16(), n)
    assert got.dtype == torch.bfloat16
    bias = (got.float() / want).mean().item() - 1.0
    assert abs(bias) < 5e-4, f"pooled bf16 values biased by {bias:+.2%} at {steps} steps"


# --- gated blocks -----------------------------------------------------------------------------------
def test_context_gating_formula():
    torch.manual_seed(0)
    cg, x = ContextGating(5), torch.randn(3, 5)
    assert torch.allclose(cg(x), x * torch.sigmoid(x @ cg.fc.weight.T + cg.fc.bias))
    assert GatedEmbeddingUnit(7, 5)(torch.randn(3, 7)).shape == (3, 5)


def test_sentence_maxpool_keeps_unmasked_padding():
    torch.manual_seed(0)
    pool = SentenceMaxpool(4, 6)
    words = torch.zeros(2, 3, 4)
    words[:, 0] = torch.randn(2, 4)  # one real word, two zero-padded slots
    expected = torch.maximum(torch.relu(pool.fc(words[:, 0])), torch.relu(pool.fc.bias))
    assert torch.allclose(pool(words), expected)


# --- MCN forward ------------------------------------------------------------------------------------
def test_forward_shapes_and_recon_targets(tiny):
    batch = make_batch()
    out = tiny(batch, ALL)
    assert set(out) == {"video", "audio", "text", "recon_video", "recon_audio", "recon_text"}
    for m in ALL:
        assert out[m].shape == (3, 32)
    dims = {"video": TINY.video_dim, "audio": 16, "text": 32}
    for m, d in dims.items():
        pred, target = out[f"recon_{m}"]
        assert pred.shape == target.shape == (3, d)
    assert out["recon_video"][1] is batch["video"]
    assert out["recon_text"][1].requires_grad and out["recon_audio"][1].requires_grad  # live, not detached


def test_forward_without_recon_heads():
    out = MCN(ModelConfig(embed_dim=32, audio_channels=TINY_CH, recon=False))(make_batch(), ALL)
    assert set(out) == set(ALL)


def test_unknown_modality_rejected(tiny):
    with pytest.raises(ValueError, match="speech"):
        tiny(make_batch(), {"video", "speech"})


def test_inactive_branch_not_run(tiny):
    calls = []
    tiny.audio_encoder.davenet.register_forward_hook(lambda *args: calls.append(1))
    batch = make_batch()
    del batch["audio"], batch["nframes"]  # inactive inputs may be absent
    out = tiny(batch, {"video", "text"})
    assert set(out) == {"video", "text", "recon_video", "recon_text"}
    recon = sum(pred.sum() for pred, _ in (out["recon_video"], out["recon_text"]))
    (out["video"].sum() + out["text"].sum() + recon).backward()
    assert calls == []
    audio_params = [*tiny.audio_encoder.parameters(), *tiny.recon["audio"].parameters()]
    assert all(p.grad is None for p in audio_params)
    assert tiny.video_encoder.gu_video.fc.weight.grad is not None and tiny.text_encoder.text_pool.fc.weight.grad is not None


def test_all_params_get_grads_when_all_active(tiny):
    out = tiny(make_batch(), ALL)
    loss = sum(out[m].pow(2).mean() for m in ALL)
    loss = loss + sum((p - t).pow(2).mean() for p, t in (out[f"recon_{m}"] for m in ALL))
    loss.backward()
    missing = [n for n, p in tiny.named_parameters() if p.grad is None]
    assert missing == []
    assert all(torch.isfinite(p.grad).all() for p in tiny.parameters())


def test_masked_pooling_ignores_padding(tiny):
    tiny.eval()
    clip = torch.randn(1, 40, 400)
    short = torch.nn.functional.pad(clip, (0, 1024 - 400))
    long = torch.nn.functional.pad(clip, (0, 2048 - 400))
    nframes = torch.tensor([400])
    with torch.no_grad():
        a_short = tiny({"audio": short, "nframes": nframes}, {"audio"})
        a_long = tiny({"audio": long, "nframes": nframes}, {"audio"})
        a_unmasked = tiny({"audio": long, "nframes": torch.tensor([2048])}, {"audio"})
    assert torch.allclose(a_short["audio"], a_long["audio"], atol=1e-5)
    assert torch.allclose(a_short["recon_audio"][1], a_long["recon_audio"][1], atol=1e-5)
    # and the padding does change the result when it is not masked out
    assert not torch.allclose(a_long["audio"], a_unmasked["audio"], atol=1e-3)


def test_train_mode_uses_masked_pooling_too(tiny):
    batch = make_batch()
    with torch.no_grad():
        feats = tiny.audio_encoder.davenet(batch["audio"])  # train mode: batch statistics, same as the forward below
        expected = masked_time_mean(feats, pooled_steps(batch["nframes"], 160, feats.shape[-1]))
        got = tiny(batch, {"audio"})["recon_audio"][1]
    assert torch.allclose(got, expected, atol=1e-6)
    assert not torch.allclose(got, feats.mean(-1), atol=1e-4)


def test_forward_does_not_mutate_nframes(tiny):
    for dtype in (torch.int32, torch.int64):
        batch = make_batch()
        batch["nframes"] = batch["nframes"].to(dtype)
        before = batch["nframes"].clone()
        tiny(batch, ALL)
        assert torch.equal(batch["nframes"], before) and batch["nframes"].dtype == dtype


def test_fp16_audio_accepted(tiny):
    tiny.eval()
    batch = make_batch()
    half = dict(batch, audio=batch["audio"].half())
    full = dict(batch, audio=half["audio"].float())
    with torch.no_grad():
        a16, a32 = tiny(half, {"audio"})["audio"], tiny(full, {"audio"})["audio"]
    assert a16.dtype == torch.float32 and torch.isfinite(a16).all()
    assert torch.equal(a16, a32)


def test_bf16_autocast_forward(tiny):
    batch = make_batch()
    batch["audio"] = batch["audio"].half()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tiny(batch, ALL)
    assert all(out[m].dtype == torch.bfloat16 and torch.isfinite(out[m].float()).all() for m in ALL)


def test_encode_returns_embeddings_only(tiny):
    tiny.eval()
    batch = make_batch()
    with torch.no_grad():
        enc = tiny.encode(batch)
        fwd = tiny(batch, ALL)
    assert set(enc) == set(ALL)
    assert all(torch.equal(enc[m], fwd[m]) for m in ALL)
