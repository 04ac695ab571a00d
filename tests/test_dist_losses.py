"""DDP equivalence of the objective: 2 gloo processes == one process holding the whole batch.

Each rank runs tiny identical encoders (``conftest.linear_mcn``, wrapped in DDP as the Ray worker
wraps MCN: unused parameters found, gradients as bucket views) on its half of the videos' clips
(video-major), computes the MCNObjective terms and back-propagates ``total_loss``. The rank-mean
of every term, the DDP-averaged gradients, the centroids and the queue must equal the
single-process run on the concatenated batch, for every active set of the stage orders, over
steps that include refresh and non-refresh (queue-using) k-means steps and a stage switch.

The same holds with gradient caching (``raymcn.train.gradcache.cached_step``, chunks of one video
and uneven chunks, reconstruction on and off): the chunked ranks equal the plain single process,
and DDP all-reduces once per step (counted with a comm hook), not once per chunk.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from raymcn.config import Config
from raymcn.losses import Collectives
from raymcn.train.gradcache import cached_step

from conftest import linear_mcn, objective_for

pytestmark = pytest.mark.dist

VIDEOS, CLIPS, DIM, IN_DIM, WORLD = 6, 3, 8, 5, 2  # 9 clips per rank
ACTIVE_SETS = [frozenset({"video", "audio"}), frozenset({"video", "text"}), frozenset({"audio", "text"}),
               frozenset({"video", "audio", "text"})]
STEPS_PER_SET = 3  # with refresh_every=2 every set sees a refit, a non-refresh step and a queue
# (chunk clips, reconstruction heads): the plain step, then cached steps with chunks of one video
# (3 per rank) and uneven chunks (6 + 3 per rank)
VARIANTS = [(0, True), (CLIPS, True), (2 * CLIPS, False)]


def _cfg(cluster_on: str) -> Config:
    return Config().replace({
        "data.batch_size": VIDEOS, "data.clips_per_video": CLIPS, "scale.num_workers": WORLD,
        "loss.num_clusters": 3, "loss.refresh_every": 2, "loss.queue_steps": 2, "loss.queue_clip_fraction": 0.5,
        "loss.kmeans_iters": 30, "loss.kmeans_tol": 1e-8, "loss.margin": 0.1, "loss.cluster_on": cluster_on,
        "loss.cluster_weight": 0.7, "loss.recon_weight": 2.0, "run.seed": 3, "model.embed_dim": DIM,
    })


def _counting_allreduce(calls: list, bucket):
    """DDP's default all-reduce (mean over ranks), counted: one call per bucket per synced backward."""
    calls.append(1)
    fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _run(rank: int, world: int, chunk: int = 0, recon: bool = True) -> list[dict]:
    """Per step: rank-mean term values, DDP-averaged grads, centroids, queue and the all-reduce
    calls (single process: world=1, no DDP). ``chunk`` > 0: gradient caching with chunks of that many clips."""
    records = []
    local = VIDEOS * CLIPS // world
    rows = slice(rank * local, (rank + 1) * local)  # whole videos per rank, video-major
    for cluster_on in ("modalities", "fused"):
        net = linear_mcn(IN_DIM, DIM, recon=recon)
        model, calls = net, []
        if world > 1:  # as the Ray worker wraps the model
            model = DDP(net, find_unused_parameters=True, gradient_as_bucket_view=True)
            model.register_comm_hook(calls, _counting_allreduce)
        objective, step = objective_for(_cfg(cluster_on), comm=Collectives.from_process_group()), 0
        for active in ACTIVE_SETS:
            for _ in range(STEPS_PER_SET):
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
                records.append({"cluster_on": cluster_on, "step": step, "active": sorted(active),
                                "terms": {k: objective.comm.all_reduce_mean(v) for k, v in terms.items()},
                                "grads": grads, "allreduce_calls": len(calls),
                                "centroids": objective.centroids.clone(), "queue": objective.queue.contents()})
                step += 1
    return records


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save({variant: _run(rank, world, *variant) for variant in VARIANTS}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_equal_single_process(tmp_path):
    mp.spawn(_worker, args=(WORLD, str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (restored: later tests must not inherit it)
    try:
        reference = {recon: _run(0, 1, 0, recon) for recon in (True, False)}  # plain, whole batch
    finally:
        torch.set_num_threads(threads)
    plain_calls = [r["allreduce_calls"] for r in per_rank[0][VARIANTS[0]]]
    assert min(plain_calls) >= 1

    tol = {"rtol": 1e-5, "atol": 1e-5}
    for chunk, recon in VARIANTS:
        ref_steps, got = reference[recon], [per_rank[r][(chunk, recon)] for r in range(WORLD)]
        assert len(ref_steps) == len(got[0]) == 2 * len(ACTIVE_SETS) * STEPS_PER_SET
        for i, (ref, r0, r1) in enumerate(zip(ref_steps, *got)):
            where = f"chunk={chunk} recon={recon} cluster_on={ref['cluster_on']} step={ref['step']} active={ref['active']}"
            # clustering state is replicated exactly across ranks
            assert torch.equal(r0["centroids"], r1["centroids"]), where
            assert torch.equal(r0["queue"], r1["queue"]), where
            torch.testing.assert_close(r0["centroids"], ref["centroids"], **tol, msg=lambda m: f"{where}: {m}")
            torch.testing.assert_close(r0["queue"], ref["queue"], **tol, msg=lambda m: f"{where}: {m}")
            assert set(r0["terms"]) == set(ref["terms"]), where
            assert ("recon_loss" in ref["terms"]) == recon, where
            pair_terms = [k for k in ref["terms"] if k.endswith("_contrastive_loss") and k != "contrastive_loss"]
            assert len(pair_terms) == (3 if len(ref["active"]) == 3 else 1), where
            for name, value in ref["terms"].items():
                torch.testing.assert_close(r0["terms"][name], value, **tol, msg=lambda m: f"{where} {name}: {m}")
            for name, grad in ref["grads"].items():
                modality = name.split(".")[1].removeprefix("recon_")
                if modality not in ref["active"]:
                    assert grad is None, f"{where}: inactive {name} got a gradient"
                    for r in (r0, r1):  # DDP may hand unused parameters zeros, never a value
                        assert r["grads"][name] is None or not r["grads"][name].any(), f"{where}: inactive {name}"
                    continue
                torch.testing.assert_close(r0["grads"][name], grad, **tol, msg=lambda m: f"{where} grad {name}: {m}")
                torch.testing.assert_close(r1["grads"][name], grad, **tol, msg=lambda m: f"{where} grad {name}: {m}")
            # the gradients are all-reduced once per step, as in the plain step, whatever the chunks
            assert r0["allreduce_calls"] == r1["allreduce_calls"] == plain_calls[i], where
