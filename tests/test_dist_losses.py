"""DDP equivalence of the objective: 2 gloo processes == one process holding the whole batch.

Each rank runs tiny identical encoders on its half of the videos' clips (video-major), computes
the MCNObjective terms, back-propagates ``total_loss`` and averages the gradients over ranks as
DDP does. The rank-mean of every term, the averaged gradients, the centroids and the queue must
equal the single-process run on the concatenated batch, for every active set of the stage orders,
over steps that include refresh and non-refresh (queue-using) k-means steps and a stage switch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raymcn.config import Config
from raymcn.losses import Collectives

from conftest import objective_for

pytestmark = pytest.mark.dist

VIDEOS, CLIPS, DIM, IN_DIM, WORLD = 4, 3, 8, 5, 2
ACTIVE_SETS = [frozenset({"video", "audio"}), frozenset({"video", "text"}), frozenset({"audio", "text"}),
               frozenset({"video", "audio", "text"})]
STEPS_PER_SET = 3  # with refresh_every=2 every set sees a refit, a non-refresh step and a queue


def _cfg(cluster_on: str) -> Config:
    return Config().replace({
        "data.batch_size": VIDEOS, "data.clips_per_video": CLIPS, "scale.num_workers": WORLD,
        "loss.num_clusters": 3, "loss.refresh_every": 2, "loss.queue_steps": 2, "loss.queue_clip_fraction": 0.5,
        "loss.kmeans_iters": 30, "loss.kmeans_tol": 1e-8, "loss.margin": 0.1, "loss.cluster_on": cluster_on,
        "loss.cluster_weight": 0.7, "loss.recon_weight": 2.0, "run.seed": 3, "model.embed_dim": DIM,
    })


def _model() -> torch.nn.ModuleDict:
    torch.manual_seed(0)  # identical replicas on every rank, as DDP guarantees
    mods = ("video", "audio", "text")
    return torch.nn.ModuleDict({**{m: torch.nn.Linear(IN_DIM, DIM) for m in mods},
                                **{f"recon_{m}": torch.nn.Linear(DIM, IN_DIM) for m in mods}})


def _run(rank: int, world: int) -> list[dict]:
    """Per step: rank-mean term values, DDP-averaged grads, centroids and queue (single process: world=1)."""
    records = []
    local = VIDEOS * CLIPS // world
    rows = slice(rank * local, (rank + 1) * local)  # whole videos per rank, video-major
    for cluster_on in ("modalities", "fused"):
        model, objective, step = _model(), objective_for(_cfg(cluster_on), comm=Collectives.from_process_group()), 0
        for active in ACTIVE_SETS:
            for _ in range(STEPS_PER_SET):
                g = torch.Generator().manual_seed(100 + step)
                inputs = {m: torch.randn(VIDEOS * CLIPS, IN_DIM, generator=g) for m in ("video", "audio", "text")}
                out = {}
                for m in sorted(active):
                    out[m] = model[m](inputs[m][rows])
                    out[f"recon_{m}"] = (model[f"recon_{m}"](out[m]), inputs[m][rows])
                terms = objective(out, active, step)
                model.zero_grad(set_to_none=True)
                terms["total_loss"].backward()
                grads = {}
                for name, p in model.named_parameters():
                    if p.grad is None:
                        grads[name] = None
                        continue
                    grad = p.grad.clone()
                    if world > 1:  # what DDP does
                        dist.all_reduce(grad)
                        grad /= world
                    grads[name] = grad
                records.append({"cluster_on": cluster_on, "step": step, "active": sorted(active),
                                "terms": {k: objective.comm.all_reduce_mean(v) for k, v in terms.items()}, "grads": grads,
                                "centroids": objective.centroids.clone(), "queue": objective.queue.contents()})
                step += 1
    return records


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(_run(rank, world), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_equal_single_process(tmp_path):
    mp.spawn(_worker, args=(WORLD, str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (restored: later tests must not inherit it)
    try:
        reference = _run(0, 1)
    finally:
        torch.set_num_threads(threads)
    assert len(reference) == len(per_rank[0]) == 2 * len(ACTIVE_SETS) * STEPS_PER_SET

    tol = {"rtol": 1e-5, "atol": 1e-5}
    for ref, r0, r1 in zip(reference, *per_rank):
        where = f"cluster_on={ref['cluster_on']} step={ref['step']} active={ref['active']}"
        # clustering state is replicated exactly across ranks
        assert torch.equal(r0["centroids"], r1["centroids"]), where
        assert torch.equal(r0["queue"], r1["queue"]), where
        torch.testing.assert_close(r0["centroids"], ref["centroids"], **tol, msg=lambda m: f"{where}: {m}")
        torch.testing.assert_close(r0["queue"], ref["queue"], **tol, msg=lambda m: f"{where}: {m}")
        assert set(r0["terms"]) == set(ref["terms"]), where
        pair_terms = [k for k in ref["terms"] if k.endswith("_contrastive_loss") and k != "contrastive_loss"]
        assert len(pair_terms) == (3 if len(ref["active"]) == 3 else 1), where
        for name, value in ref["terms"].items():
            torch.testing.assert_close(r0["terms"][name], value, **tol, msg=lambda m: f"{where} {name}: {m}")
        for name, grad in ref["grads"].items():
            modality = name.split(".")[0].removeprefix("recon_")
            if modality not in ref["active"]:
                assert grad is None and r0["grads"][name] is None, f"{where}: inactive {name} got a gradient"
                continue
            torch.testing.assert_close(r0["grads"][name], grad, **tol, msg=lambda m: f"{where} grad {name}: {m}")
            torch.testing.assert_close(r1["grads"][name], grad, **tol, msg=lambda m: f"{where} grad {name}: {m}")
