"""The bf16 tier, on CPU: the training step and the evaluation as the GPU runs them (the model's
forward under bf16 autocast, everything else as the loop does it), compared with fp32 on the same
batch and the same model and clustering state.

``raymcn.train.optim.autocast`` is what the loop, gradient caching and the evaluation enter around
the model's forward (bf16 on CUDA, nothing on CPU); here it is replaced by CPU bf16 autocast, so
the loop's own calls run in bf16 where the GPU's would. CPU autocast's op lists differ from CUDA's,
so the assertions are invariants (every loss term and every retrieval score in fp32) and stated
tolerances, not dtypes of intermediate tensors.

The model is the embedded default's tiny MCN after three epochs of fp32 training on the synthetic
corpus (embeddings with structure, so assignments and retrievals are not ties of noise). Every
variant of the step: the gathered and the ring contrastive loss, plain and with gradient caching
(chunks of two videos); the step is a k-means refit step.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from bench.readers import train_videos
from raymcn.cli import preset_path
from raymcn.config import load_config
from raymcn.losses.cluster import assign_clusters
from raymcn.train import evaluate as evaluation
from raymcn.train import optim
from raymcn.train.build import assemble
from raymcn.train.evaluate import evaluate
from raymcn.train.gradcache import cached_step
from raymcn.train.inputs import eval_set_of
from raymcn.train.loop import train_one_epoch
from raymcn.train.optim import apply_precision
from raymcn.train.run_plan import make_plan

ALL = frozenset({"video", "audio", "text"})
EPOCHS = 3  # of the embedded default's 4: retrieval well above chance
# Stated tolerances of bf16 against fp32 (bf16 keeps 8 bits of mantissa: ~0.4 % per rounding).
# Measured on this model and batch (x86-64 with AVX-512, all four variants): loss terms within 0.2 %;
# the whole gradient's cosine 0.995-0.998 and its norm 3-5 % larger, most of the difference in the
# audio branch (DAVEnet's convs and BatchNorms: per-tensor cosine >= 0.94; every other tensor
# >= 0.995); k-means labels and R@1/5/10, MedR identical. The bounds leave room for other CPUs' kernels.
TERM_RTOL = 0.02  # every loss term, relative
GRAD_COSINE = 0.98  # the whole gradient, flattened
AUDIO_COSINE = 0.85  # each DAVEnet tensor's gradient
OTHER_COSINE = 0.98  # each other tensor's gradient (video and text branches, heads)
GRAD_NORM_RTOL = 0.10  # the whole gradient's norm, relative
ASSIGN_AGREE = 0.90  # k-means labels equal to fp32's for at least this share of the rows
RECALL_POINTS = 3.0  # R@1/5/10 within this many percentage points (256 queries: 1 query = 0.39)
MEDR_RTOL = 0.25


def bf16_autocast(device):
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(cfg, run, a batch of the next epoch, the eval set): the tiny MCN after EPOCHS fp32 epochs."""
    cfg = load_config(preset_path(), ["scale.num_workers=0", "data.prefetch_batches=0"])
    videos = train_videos(cfg)
    plan = make_plan(cfg, len(videos.records))
    run = assemble(cfg, plan)
    for epoch in range(EPOCHS):
        run.state.epoch = epoch
        train_one_epoch(run, videos.batches(cfg, epoch, 0, 1, plan.steps_per_epoch))
    batch = next(videos.batches(cfg, EPOCHS, 0, 1, plan.steps_per_epoch))
    eval_set = eval_set_of(cfg)
    return cfg, run, batch, eval_set


def _step(run, batch, *, ring: bool, chunk: int, bf16: bool, monkeypatch) -> tuple[dict, dict, torch.Tensor]:
    """One training step's terms and gradients from a copy of the run's model and objective state,
    as the loop computes them; and the objective's k-means labels of the step's fused rows."""
    fp32 = lambda device: torch.autocast("cpu", enabled=False)  # noqa: E731
    monkeypatch.setattr(optim, "autocast", bf16_autocast if bf16 else fp32)
    model = copy.deepcopy(run.model)
    objective = copy.deepcopy(run.objective)
    objective.layout = dataclasses.replace(objective.layout, ring=ring)
    step = run.cfg.loss.refresh_every * 100  # a refit step
    model.zero_grad(set_to_none=True)
    if chunk:
        terms = cached_step(model, objective, batch, ALL, step, chunk,
                            forward_context=lambda: optim.autocast(run.device))
    else:
        with optim.autocast(run.device):
            out = model(batch, ALL)
        terms = objective(out, ALL, step)
        terms["total_loss"].backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad(), optim.autocast(run.device):
        emb = model.embed(batch, ALL) if hasattr(model, "embed") else model(batch, ALL)
    fused = sum(emb[m].float() for m in sorted(ALL)) / 3
    labels = assign_clusters(fused, objective.cluster.centroids)
    return {k: v.detach() for k, v in terms.items()}, grads, labels


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@pytest.mark.parametrize("ring", [False, True], ids=["gathered", "ring"])
@pytest.mark.parametrize("chunk", [0, 16], ids=["plain", "cached"])
def test_a_bf16_step_stays_within_the_stated_tolerances_of_fp32(trained, monkeypatch, ring, chunk):
    cfg, run, batch, _ = trained
    ref_terms, ref_grads, ref_labels = _step(run, batch, ring=ring, chunk=chunk, bf16=False, monkeypatch=monkeypatch)
    terms, grads, labels = _step(run, batch, ring=ring, chunk=chunk, bf16=True, monkeypatch=monkeypatch)
    assert set(terms) == set(ref_terms)
    for name, value in terms.items():  # the invariant: losses in fp32, whatever the forward ran in
        assert value.dtype == torch.float32, name
        assert math.isfinite(float(value)), name
        assert abs(float(value) - float(ref_terms[name])) <= TERM_RTOL * abs(float(ref_terms[name])), \
            (name, float(value), float(ref_terms[name]))
    assert grads.keys() == ref_grads.keys()
    flat, ref_flat = (torch.cat([g[n].flatten() for n in sorted(g)]) for g in (grads, ref_grads))
    assert _cosine(flat, ref_flat) >= GRAD_COSINE
    assert abs(float(flat.norm() / ref_flat.norm()) - 1) <= GRAD_NORM_RTOL
    for name in ref_grads:
        if ref_grads[name].norm() > 0:
            bound = AUDIO_COSINE if name.startswith("audio_encoder.davenet.") else OTHER_COSINE
            assert _cosine(grads[name], ref_grads[name]) >= bound, name
    assert float((labels == ref_labels).float().mean()) >= ASSIGN_AGREE


def test_bf16_retrieval_scores_in_fp32_within_the_stated_tolerances(trained, monkeypatch):
    cfg, run, _, eval_set = trained
    seen = []
    real_ranks = evaluation.ranks_of_matches

    def ranks(text, gallery):  # the scores are computed from fp32 rows, outside autocast
        seen.append((text.dtype, gallery.dtype, torch.is_autocast_cpu_enabled()))
        return real_ranks(text, gallery)

    monkeypatch.setattr(evaluation, "ranks_of_matches", ranks)
    ref = evaluate(run.model, eval_set, run.device)
    monkeypatch.setattr(optim, "autocast", bf16_autocast)
    got = evaluate(run.model, eval_set, run.device)
    assert seen == [(torch.float32, torch.float32, False)] * 2
    assert ref["text_to_video_R@10"] > 3 * 100 * 10 / ref["eval_size"]  # trained: not chance
    for k in ("text_to_video_R@1", "text_to_video_R@5", "text_to_video_R@10"):
        assert abs(got[k] - ref[k]) <= RECALL_POINTS, (k, got[k], ref[k])
    assert abs(got["text_to_video_MedR"] - ref["text_to_video_MedR"]) <= MEDR_RTOL * ref["text_to_video_MedR"] + 1


@pytest.fixture
def restored_precision_flags():
    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[1], saved[2]


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_the_rank_start_sets_the_precision_policy_and_the_assembly_none(restored_precision_flags, precision):
    """``scale.matmul_precision`` reaches torch once, where a rank starts (``apply_precision``):
    "highest" = fp32 matmuls and convolutions without TF32 (the default), "high" = TF32. Assembling
    a run sets no process-wide flag."""
    cfg = load_config(preset_path(), ["scale.num_workers=0", f"scale.matmul_precision={precision}"])
    flags = ("medium", precision == "highest", False)
    torch.set_float32_matmul_precision(flags[0])
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = flags[1], flags[2]
    assemble(cfg, make_plan(cfg, cfg.data.batch_size))
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark) == flags
    apply_precision(cfg)
    assert torch.get_float32_matmul_precision() == precision
    assert torch.backends.cudnn.allow_tf32 is (precision != "highest")
    assert torch.backends.cudnn.benchmark is True
    assert load_config(preset_path(), []).scale.matmul_precision == "highest"  # fidelity by default
