"""DDP equivalence of the objective: N gloo processes == one process holding the whole batch.

Each rank runs tiny identical encoders (``conftest.linear_mcn``, wrapped in DDP as the Ray worker
wraps MCN: unused parameters found, gradients as bucket views) on its share of the videos' clips
(video-major), computes the MCNObjective terms, back-propagates ``total_loss`` and takes an SGD
step with the DDP-averaged gradients. The rank-mean of every term, the averaged gradients, the
centroids and the queue must equal the single-process run on the concatenated batch, for every
active set of the stage orders, over steps that include refresh and non-refresh (queue-using)
k-means steps and a stage switch. 5 videos never divide evenly: 2 ranks hold 3 and 2 videos, 3
ranks 2, 2 and 1 (the run plan's rotating ⌊B/N⌋ / ⌈B/N⌉). It also holds across resizes (2 -> 3 -> 1
ranks, each phase resuming from the previous one's model and objective state, as an elastic group
restarting from its checkpoint would).

The same holds with gradient caching (``raymcn.train.gradcache.cached_step``, chunks of one video
and uneven chunks, reconstruction on and off): the chunked ranks equal the plain single process,
and DDP all-reduces once per step (counted with a comm hook), not once per chunk. And with the
ring contrastive loss (``scale.ring_contrastive``: the rows passed around the ranks instead of
gathered), alone and with gradient caching.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import config, linear_mcn, objective_for, run_of
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.gloo import gloo_ranks
from raymcn.collectives import Collectives
from raymcn.train.gradcache import cached_step
from raymcn.train.run_plan import share

pytestmark = pytest.mark.dist

VIDEOS, CLIPS, DIM, IN_DIM = 5, 3, 8, 5
ACTIVE_SETS = [frozenset({"video", "audio"}), frozenset({"video", "text"}), frozenset({"audio", "text"}),
               frozenset({"video", "audio", "text"})]
STEPS_PER_SET = 3  # with refresh_every=2 every set sees a refit, a non-refresh step and a queue
STEPS = len(ACTIVE_SETS) * STEPS_PER_SET
LR = 0.05
TOL = {"rtol": 1e-5, "atol": 1e-5}
# (chunk clips, reconstruction heads, ring contrastive): the plain step, cached steps with chunks of
# one video and uneven chunks (a share of 3 videos: 2 + 1), the ring alone and with caching
PLAIN = (0, True, False)
VARIANTS = [PLAIN, (CLIPS, True, False), (2 * CLIPS, False, False), (0, True, True), (2 * CLIPS, True, True)]


BASE = {"data.batch_size": VIDEOS, "data.clips_per_video": CLIPS, "scale.num_workers": 3,
        "loss.num_clusters": 3, "loss.refresh_every": 2, "loss.queue_steps": 2, "loss.queue_clip_fraction": 0.5,
        "loss.kmeans_iters": 30, "loss.kmeans_tol": 1e-8, "loss.margin": 0.1, "loss.cluster_weight": 0.7,
        "loss.recon_weight": 2.0, "run.seed": 3, "model.embed_dim": DIM}


def _counting_allreduce(calls: list, bucket):
    """DDP's default all-reduce (mean over ranks), counted: one call per bucket per synced backward."""
    calls.append(1)
    fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _run(rank: int, world: int, steps: range, state: dict | None = None, chunk: int = 0,
         recon: bool = True, ring: bool = False) -> tuple[list[dict], dict]:
    """Per step: rank-mean term values, DDP-averaged grads, centroids, queue and the all-reduce calls
    (single process: world=1, no DDP); and the state at the end (per cluster_on: model and
    objective), from which a resized world continues. ``chunk`` > 0: gradient caching with chunks
    of that many clips; ``ring``: the ring contrastive loss."""
    records, end = [], {}
    for cluster_on in ("modalities", "fused"):
        net = linear_mcn(IN_DIM, DIM, recon=recon)
        cfg = config(BASE, **{"loss.cluster_on": cluster_on, "scale.ring_contrastive": ring})
        objective = objective_for(cfg, comm=Collectives(rank, world))
        if state is not None:
            net.load_state_dict(state[cluster_on]["model"])
            objective.cluster.load_state_dict(state[cluster_on]["objective"])
        model, calls = net, []
        if world > 1:  # as the Ray worker wraps the model
            model = DDP(net, find_unused_parameters=True, gradient_as_bucket_view=True)
            model.register_comm_hook(calls, _counting_allreduce)
        for step in steps:
            active = ACTIVE_SETS[step // STEPS_PER_SET]
            shares = [share(VIDEOS, r, world, step) for r in range(world)]  # the run plan's rotating shares
            start = sum(shares[:rank]) * CLIPS
            rows = slice(start, start + shares[rank] * CLIPS)  # whole videos per rank, video-major
            g = torch.Generator().manual_seed(100 + step)
            inputs = {m: torch.randn(VIDEOS * CLIPS, IN_DIM, generator=g) for m in ("video", "audio", "text")}
            batch = {m: x[rows] for m, x in inputs.items()}
            net.zero_grad(set_to_none=True)
            calls.clear()
            if chunk:
                terms = cached_step(model, objective, batch, active, step, chunk)
            else:
                terms = objective(model(batch, active), active, step)
                terms["total_loss"].backward()
            grads = {name: None if p.grad is None else p.grad.clone() for name, p in net.named_parameters()}
            with torch.no_grad():
                for p in net.parameters():
                    if p.grad is not None:
                        p -= LR * p.grad  # every rank takes the same step
            records.append({"cluster_on": cluster_on, "step": step, "active": sorted(active), "shares": shares,
                            "terms": {k: objective.comm.all_reduce_mean(v) for k, v in terms.items()},
                            "grads": grads, "allreduce_calls": len(calls),
                            "centroids": objective.cluster.centroids.clone(), "queue": objective.cluster.queue.contents()})
        end[cluster_on] = {"model": net.state_dict(), "objective": objective.cluster.state_dict()}
    records.sort(key=lambda r: (r["cluster_on"], r["step"]))
    return records, end


def _worker(rank: int, world: int, steps: range, state: dict | None,
            variants: list[tuple[int, bool, bool]]) -> dict:
    return {v: _run(rank, world, steps, state, *v) for v in variants}


def _spawn(world: int, steps: range, state: dict | None = None,
           variants: list[tuple[int, bool, bool]] = (PLAIN,)) -> tuple[list[dict], dict]:
    """``world`` gloo processes over ``steps``; returns, per variant, each rank's records, and rank
    0's end state of the plain step."""
    runs = gloo_ranks(_worker, world, steps, state, list(variants))
    per_variant = {v: [run[v][0] for run in runs] for v in variants}
    return per_variant, runs[0][variants[0]][1]


def _single_process(recon: bool = True) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (restored: later tests must not inherit it)
    try:
        return _run(0, 1, range(STEPS), recon=recon)[0]
    finally:
        torch.set_num_threads(threads)


def _assert_equal(reference: list[dict], per_rank: list[list[dict]], what: str = "") -> None:
    assert len(reference) == len(per_rank[0]) == 2 * STEPS
    for i, ref in enumerate(reference):
        where = f"{what} cluster_on={ref['cluster_on']} step={ref['step']} active={ref['active']}"
        ranks = [records[i] for records in per_rank]
        r0 = ranks[0]
        assert r0["step"] == ref["step"] and r0["cluster_on"] == ref["cluster_on"], where
        for r in ranks[1:]:  # clustering state is replicated exactly across ranks
            assert torch.equal(r0["centroids"], r["centroids"]), where
            assert torch.equal(r0["queue"], r["queue"]), where
        torch.testing.assert_close(r0["centroids"], ref["centroids"], **TOL, msg=lambda m: f"{where}: {m}")
        torch.testing.assert_close(r0["queue"], ref["queue"], **TOL, msg=lambda m: f"{where}: {m}")
        assert set(r0["terms"]) == set(ref["terms"]), where
        pair_terms = [k for k in ref["terms"] if k.endswith("_contrastive_loss") and k != "contrastive_loss"]
        assert len(pair_terms) == (3 if len(ref["active"]) == 3 else 1), where
        for name, value in ref["terms"].items():
            torch.testing.assert_close(r0["terms"][name], value, **TOL, msg=lambda m: f"{where} {name}: {m}")
        for name, grad in ref["grads"].items():
            modality = name.split(".")[1].removeprefix("recon_")  # layers.<modality> / layers.recon_<modality>
            if modality not in ref["active"]:
                assert grad is None, f"{where}: inactive {name} got a gradient"
                for r in ranks:  # DDP may hand unused parameters zeros, never a value
                    assert r["grads"][name] is None or not r["grads"][name].any(), f"{where}: inactive {name}"
                continue
            for r in ranks:
                torch.testing.assert_close(r["grads"][name], grad, **TOL, msg=lambda m: f"{where} grad {name}: {m}")


def _assert_unequal_rotating_shares(records: list[dict], world: int) -> None:
    shares = {tuple(r["shares"]) for r in records}
    assert all(sum(s) == VIDEOS for s in shares), shares
    for rank in range(world):  # every rank holds ⌊B/N⌋ at some steps and ⌈B/N⌉ at others
        assert {s[rank] for s in shares} == {VIDEOS // world, VIDEOS // world + 1}, shares


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks: the full tier
def test_gloo_ranks_with_unequal_shares_equal_single_process_with_and_without_caching(tmp_path, world):
    """5 videos over 2 ranks (3 + 2) or 3 ranks (2 + 2 + 1), the larger shares rotating; the plain
    step, gradient caching (chunks of one video; chunks of two, reconstruction off) and the ring
    contrastive loss (alone; with chunks of two videos) equal the plain single process with the
    gathered loss, and every variant all-reduces as often as the plain step."""
    per_variant, _ = _spawn(world, range(STEPS), variants=VARIANTS)
    _assert_unequal_rotating_shares(per_variant[PLAIN][0], world)
    reference = {recon: _single_process(recon) for recon in (True, False)}
    plain_calls = [r["allreduce_calls"] for r in per_variant[PLAIN][0]]
    assert min(plain_calls) >= 1
    for chunk, recon, ring in VARIANTS:
        per_rank = per_variant[(chunk, recon, ring)]
        assert all(("recon_loss" in r["terms"]) == recon for r in per_rank[0])
        _assert_equal(reference[recon], per_rank, f"world={world} chunk={chunk} recon={recon} ring={ring}")
        for records in per_rank:  # the gradients are all-reduced once per step, whatever the chunks
            assert [r["allreduce_calls"] for r in records] == plain_calls, (chunk, recon, ring)


@pytest.mark.slow  # three process groups in turn: the full tier (the elastic tier resizes for real)
def test_resized_between_steps_equals_single_process(tmp_path):
    """2 ranks, then 3, then 1, each phase continuing from the last one's model and objective state:
    the steps, the queue and the centroids never notice the world changing."""
    a, b = 4, 8
    two, state = _spawn(2, range(0, a))
    three, state = _spawn(3, range(a, b), state)
    one, _ = _run(0, 1, range(b, STEPS), state)
    # per phase, rank 0's records stand for all (the phases' own tests compare every rank)
    stitched = sorted(two[PLAIN][0] + three[PLAIN][0] + one, key=lambda r: (r["cluster_on"], r["step"]))
    _assert_equal(_single_process(), [stitched])


def _loop_worker(rank: int, world: int, cache_clips: int) -> dict:
    """The training loop itself on ``world`` gloo ranks with the rotating unequal shares."""
    from raymcn.train.loop import train_one_epoch

    cfg = config(BASE, **{"loss.cluster_on": "fused", "scale.grad_cache_clips": cache_clips, "optim.warmup_steps": 0})
    comm = Collectives(rank, world)
    net = linear_mcn(IN_DIM, DIM)
    # A buffer, as DAVEnet's BatchNorm has: DDP broadcasts buffers before a synced forward, so
    # the plain step (forward, then the loss's gathers) and the cached one (the loss's gathers,
    # then the re-forward) call their collectives in different orders.
    net.register_buffer("running_like", torch.zeros(1))
    model = DDP(net, find_unused_parameters=True, gradient_as_bucket_view=True)
    batches = []
    for step in range(4):
        shares = [share(VIDEOS, r, world, step) for r in range(world)]
        start = sum(shares[:rank]) * CLIPS
        g = torch.Generator().manual_seed(100 + step)
        inputs = {m: torch.randn(VIDEOS * CLIPS, IN_DIM, generator=g) for m in ("video", "audio", "text")}
        batches.append({m: x[start:start + shares[rank] * CLIPS] for m, x in inputs.items()})
    metrics = train_one_epoch(run_of(cfg, model, comm=comm), batches)
    return {"metrics": metrics, "params": {n: p.detach().clone() for n, p in net.named_parameters()}}


def test_ranks_with_unequal_shares_agree_on_gradient_caching(tmp_path):
    """5 videos of 3 clips on 3 ranks: shares of 6, 6 and 3 clips. With chunks of 3 clips the ranks
    holding 6 would cache and the rank holding 3 would not (the chunk is not smaller than its
    share): different collective sequences, and the ranks waited for each other until the process
    group's timeout (measured: failed after 69 s with gloo's "Timed out waiting 60000ms"). Every
    rank now decides from the largest share, and the loop's run equals the one without caching.
    (A cached rank with fewer chunks still broadcasts the buffers once: DDP syncs them only in a
    forward after a synced backward, not in the ``no_sync`` chunks.)"""
    runs = {}
    for cache_clips in (0, CLIPS):
        # Ranks on different paths would wait for each other forever: the timeout turns that into a failure.
        runs[cache_clips] = gloo_ranks(_loop_worker, 3, cache_clips, timeout_s=60)
    plain, cached = runs[0], runs[CLIPS]
    assert cached[0]["metrics"]["time_reforward_s"] > 0 and plain[0]["metrics"]["time_reforward_s"] == 0
    for key in [k for k in plain[0]["metrics"] if k.endswith("_loss")]:
        assert cached[0]["metrics"][key] == pytest.approx(plain[0]["metrics"][key], rel=1e-5, abs=1e-6), key
    for name, value in plain[0]["params"].items():
        torch.testing.assert_close(cached[0]["params"][name], value, **TOL)
