"""The step's levers, against the eager step they must equal: DAVEnet's layouts (``scale.davenet_layout``)
and ``torch.compile`` (``scale.compile``).

Each lever changes which kernels run, not the arithmetic, so each is compared with the plain eager
step of the same weights and batch to fp32's tolerance, on one step: the loss terms and every
parameter's gradient (tolerances relative to each tensor's largest value, as two summation orders
differ). Checkpoints stay the bare model's, so a run resumes across either setting. Compiling
takes tens of seconds on a CPU (Inductor's C++), so the compiled cases are in the soak tier (by hand
before a release, beside the compiled Ray runs of tests/test_compile_runs.py): CI's time does not
hold their minutes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODEL, config

from raymcn.data.formats.batch import random_batch
from raymcn.train import loop
from raymcn.train.build import assemble
from raymcn.train.checkpoints import payload as checkpoint
from raymcn.train.compiled import CompileClock
from raymcn.train.run_plan import make_plan
from raymcn.train.stages import active_modalities

# One rank's tiny step: 4 videos x 4 clips, staged (AV_T: audio and video, then text), k-means on
# the first batch; the same dims in every case, so Inductor's cache serves the compiled ones.
TINY_STEP = {**TINY_MODEL, "data.batch_size": 4, "data.clips_per_video": 4, "loss.num_clusters": 4,
             "loss.kmeans_iters": 5, "loss.queue_steps": 2, "scale.num_workers": 0, "optim.warmup_steps": 1,
             "schedule.stage_order": "AV_T"}


def _run(**overrides):
    cfg = config(TINY_STEP, **overrides)
    return assemble(cfg, make_plan(cfg, videos=8 * cfg.data.batch_size))


def _step(run, batch, step: int = 0) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One forward and backward at global ``step``: the terms and every parameter's gradient, by name."""
    run.optimizer.zero_grad(set_to_none=True)
    run.state.step = step
    active = active_modalities(run.cfg.schedule.stage_order, step, run.plan.switch_step)
    terms = loop.forward_backward(run, batch, active, 0, lambda phase: None)
    grads = {n: p.grad.detach().clone() for n, p in run.net.named_parameters() if p.grad is not None}
    return {k: float(v.detach()) for k, v in terms.items()}, grads


def _assert_same_step(got: tuple, want: tuple, rtol: float = 1e-4) -> None:
    (terms, grads), (ref_terms, ref_grads) = got, want
    assert terms.keys() == ref_terms.keys()
    for k in ref_terms:
        assert terms[k] == pytest.approx(ref_terms[k], rel=rtol, abs=1e-6), k
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    for name, ref in ref_grads.items():
        scale = float(ref.abs().max()) or 1.0
        torch.testing.assert_close(grads[name], ref, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout", ["channels_last", "1d"])
def test_a_davenet_layout_computes_the_eager_step_on_the_same_weights(layout):
    """The same loss terms and gradients as torch's default layout, to fp32 tolerance, and a state
    dict of the same names, shapes and values (a checkpoint loads across the setting)."""
    batch = random_batch(config(TINY_STEP), 16)
    plain, laid_out = _run(), _run(**{"scale.davenet_layout": layout})
    assert laid_out.net.audio_encoder.davenet.layout == layout
    before = {k: v.clone() for k, v in laid_out.net.state_dict().items()}
    reference = {k: v.clone() for k, v in plain.net.state_dict().items()}
    _assert_same_step(_step(laid_out, batch), _step(plain, batch))
    assert {k: (v.shape, v.dtype) for k, v in before.items()} == {k: (v.shape, v.dtype) for k, v in reference.items()}
    assert all(torch.equal(before[k], reference[k]) for k in reference)  # seeded alike: the same weights
    if layout == "channels_last":
        assert laid_out.net.audio_encoder.davenet.conv1.weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "1d"])
def test_every_gradient_arrives_in_its_weights_strides(layout):
    """What the backward hands each parameter (what DDP's reducer receives) has the parameter's own
    strides, so DDP's gradient buckets take it in place: a channels-last (O, C, 1, 1) projection
    weight left in contiguous strides got channels-last gradients, which DDP copied every step
    with a "Grad strides do not match bucket view strides" warning."""
    run = _run(**{"scale.davenet_layout": layout})
    arrived = {}

    def seen(name):
        def hook(grad):
            arrived[name] = grad.stride()  # returns None: the gradient passes on unchanged
        return hook

    for name, p in run.net.named_parameters():
        p.register_hook(seen(name))
    _step(run, random_batch(config(TINY_STEP), 16))
    params = dict(run.net.named_parameters())
    assert any(p.shape[-2:] == (1, 1) for name, p in params.items() if name in arrived)  # a 1x1 projection is seen
    assert {n: s for n, s in arrived.items() if s != params[n].stride()} == {}


def test_a_layout_that_does_not_exist_is_refused():
    from raymcn.model.davenet import DAVEnet

    with pytest.raises(ValueError, match="DAVEnet layout 'nhwc': allowed are nchw, channels_last, 1d"):
        DAVEnet((4, 4, 8, 8, 16)).set_layout("nhwc")


def test_the_compile_clock_counts_nothing_where_nothing_compiles():
    clock = CompileClock()
    torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()
    assert clock.lap() == {"compiled_graphs": 0.0, "time_compile_s": 0.0}


@pytest.mark.slow
@pytest.mark.soak
def test_a_compiled_step_equals_the_eager_step_and_compiles_again_only_at_the_stage_switch():
    """``scale.compile``: the compiled model's loss terms and gradients are the eager step's to fp32
    tolerance; further steps of the same stage reuse the graph, the stage switch (text joins)
    compiles once more, and the clock counts both and their seconds."""
    cfg = config(TINY_STEP)
    batch = random_batch(cfg, 16)
    compiled, eager = _run(**{"scale.compile": True}), _run()
    assert compiled.net is compiled.model._orig_mod  # the bare model, which checkpoints hold
    _assert_same_step(_step(compiled, batch), _step(eager, batch))
    first = compiled.compile_clock.lap()
    assert first["compiled_graphs"] >= 1 and first["time_compile_s"] > 0, first
    _step(compiled, random_batch(cfg, 16, seed=1), step=1)
    assert compiled.compile_clock.lap() == {"compiled_graphs": 0.0, "time_compile_s": 0.0}
    switch = compiled.plan.switch_step
    assert active_modalities("AV_T", switch, switch) != active_modalities("AV_T", 0, switch)
    _assert_same_step(_step(compiled, batch, step=switch), _step(eager, batch, step=switch))
    again = compiled.compile_clock.lap()
    assert again["compiled_graphs"] >= 1 and again["time_compile_s"] > 0, again
    total = compiled.compile_clock.total()
    assert total["compiled_graphs"] == first["compiled_graphs"] + again["compiled_graphs"]


def _train(run, steps: range, seed: int = 0) -> list[float]:
    """``steps`` of training (the loop's epoch over one batch per step); the total loss of each."""
    losses = []
    for step in steps:
        run.state.step = step
        metrics = loop.train_one_epoch(run, [random_batch(run.cfg, 16, seed=seed + step)])
        losses.append(metrics["total_loss"])
    return losses


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.parametrize("first, then", [(False, True), (True, False)], ids=["eager-then-compiled",
                                                                            "compiled-then-eager"])
def test_a_run_resumes_across_the_compile_setting(tmp_path, first, then):
    """A checkpoint written by a compiled run holds the bare model's names (no ``_orig_mod.``), and a
    run resumed from it with the other setting continues as the uninterrupted run does (to fp32
    tolerance over the next steps)."""
    uninterrupted = _run()
    losses = _train(uninterrupted, range(4))
    before = _run(**{"scale.compile": first})
    _train(before, range(2))
    checkpoint.save(tmp_path, **before.parts())
    saved = checkpoint.load(tmp_path)
    assert list(saved["model"]) == list(uninterrupted.net.state_dict())
    after = _run(**{"scale.compile": then})
    checkpoint.restore(saved, **after.parts())
    assert after.state.step == 2
    assert _train(after, range(2, 4)) == pytest.approx(losses[2:], rel=1e-4)


@pytest.mark.slow
@pytest.mark.soak
def test_a_compiled_gradient_cached_step_equals_the_eager_one():
    """Gradient caching runs the compiled model twice a chunk, without autograd and then with it,
    BatchNorm's statistics held: the terms and every gradient are the eager cached step's."""
    cfg = config(TINY_STEP, **{"scale.grad_cache_clips": 8})
    batch = random_batch(cfg, 16)

    def cached(run):
        run.optimizer.zero_grad(set_to_none=True)
        active = active_modalities(run.cfg.schedule.stage_order, 0, run.plan.switch_step)
        terms = loop.forward_backward(run, batch, active, loop.cache_chunk(run.cfg, 1), lambda phase: None)
        grads = {n: p.grad.detach().clone() for n, p in run.net.named_parameters() if p.grad is not None}
        return {k: float(v.detach()) for k, v in terms.items()}, grads

    compiled = _run(**{"scale.compile": True, "scale.grad_cache_clips": 8})
    assert loop.cache_chunk(compiled.cfg, 1) == 8  # 16 clips in chunks of 8: the cached path
    _assert_same_step(cached(compiled), cached(_run(**{"scale.grad_cache_clips": 8})))
    assert compiled.compile_clock.total()["compiled_graphs"] >= 1
