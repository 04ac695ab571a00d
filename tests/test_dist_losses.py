"""DDP equivalence of the objective: N gloo processes == one process holding the whole batch.

Each rank runs tiny identical encoders on its share of the videos' clips (video-major), computes
the MCNObjective terms, back-propagates ``total_loss``, averages the gradients over ranks as DDP
does and takes an SGD step with them. The rank-mean of every term, the averaged gradients, the
centroids and the queue must equal the single-process run on the concatenated batch, for every
active set of the stage orders, over steps that include refresh and non-refresh (queue-using)
k-means steps and a stage switch: with 2 ranks and equal shares, with 3 ranks whose shares are
unequal (the run plan's rotating ⌊B/N⌋ / ⌈B/N⌉), and across resizes (2 -> 3 -> 1 ranks, each phase
resuming from the previous one's model and objective state, as an elastic group restarting from
its checkpoint would).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raymcn.config import Config
from raymcn.losses import Collectives
from raymcn.train.plan import share

from conftest import objective_for

pytestmark = pytest.mark.dist

VIDEOS, CLIPS, DIM, IN_DIM = 4, 3, 8, 5
ACTIVE_SETS = [frozenset({"video", "audio"}), frozenset({"video", "text"}), frozenset({"audio", "text"}),
               frozenset({"video", "audio", "text"})]
STEPS_PER_SET = 3  # with refresh_every=2 every set sees a refit, a non-refresh step and a queue
STEPS = len(ACTIVE_SETS) * STEPS_PER_SET
LR = 0.05
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _cfg(cluster_on: str) -> Config:
    return Config().replace({
        "data.batch_size": VIDEOS, "data.clips_per_video": CLIPS, "scale.num_workers": 3,
        "loss.num_clusters": 3, "loss.refresh_every": 2, "loss.queue_steps": 2, "loss.queue_clip_fraction": 0.5,
        "loss.kmeans_iters": 30, "loss.kmeans_tol": 1e-8, "loss.margin": 0.1, "loss.cluster_on": cluster_on,
        "loss.cluster_weight": 0.7, "loss.recon_weight": 2.0, "run.seed": 3, "model.embed_dim": DIM,
    })


def _model() -> torch.nn.ModuleDict:
    torch.manual_seed(0)  # identical replicas on every rank, as DDP guarantees
    mods = ("video", "audio", "text")
    return torch.nn.ModuleDict({**{m: torch.nn.Linear(IN_DIM, DIM) for m in mods},
                                **{f"recon_{m}": torch.nn.Linear(DIM, IN_DIM) for m in mods}})


def _run(rank: int, world: int, steps: range, state: dict | None = None) -> tuple[list[dict], dict]:
    """Per step: rank-mean term values, DDP-averaged grads, centroids and queue; and the state at the
    end (per cluster_on: model and objective), from which a resized world continues."""
    records, end = [], {}
    for cluster_on in ("modalities", "fused"):
        model = _model()
        objective = objective_for(_cfg(cluster_on), comm=Collectives(rank, world))
        if state is not None:
            model.load_state_dict(state[cluster_on]["model"])
            objective.load_state_dict(state[cluster_on]["objective"])
        for step in steps:
            active = ACTIVE_SETS[step // STEPS_PER_SET]
            shares = [share(VIDEOS, r, world, step) for r in range(world)]  # the run plan's rotating shares
            start = sum(shares[:rank]) * CLIPS
            rows = slice(start, start + shares[rank] * CLIPS)  # whole videos per rank, video-major
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
                with torch.no_grad():
                    p -= LR * grad  # every rank takes the same step
            records.append({"cluster_on": cluster_on, "step": step, "active": sorted(active), "shares": shares,
                            "terms": {k: objective.comm.all_reduce_mean(v) for k, v in terms.items()},
                            "grads": grads, "centroids": objective.centroids.clone(),
                            "queue": objective.queue.contents()})
        end[cluster_on] = {"model": model.state_dict(), "objective": objective.state_dict()}
    records.sort(key=lambda r: (r["cluster_on"], r["step"]))
    return records, end


def _worker(rank: int, world: int, init_file: str, out_dir: str, steps: range, state_file: str | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        state = torch.load(state_file) if state_file else None
        torch.save(_run(rank, world, steps, state), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(world: int, steps: range, where, state: dict | None = None) -> tuple[list[list[dict]], dict]:
    """``world`` gloo processes over ``steps``; returns each rank's records and rank 0's end state."""
    where.mkdir(parents=True)
    state_file = None
    if state is not None:
        state_file = str(where / "state.pt")
        torch.save(state, state_file)
    mp.spawn(_worker, args=(world, str(where / "init"), str(where), steps, state_file), nprocs=world, join=True)
    runs = [torch.load(where / f"rank{r}.pt") for r in range(world)]
    return [records for records, _ in runs], runs[0][1]


def _single_process() -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (restored: later tests must not inherit it)
    try:
        return _run(0, 1, range(STEPS))[0]
    finally:
        torch.set_num_threads(threads)


def _assert_equal(reference: list[dict], per_rank: list[list[dict]]) -> None:
    assert len(reference) == len(per_rank[0]) == 2 * STEPS
    for i, ref in enumerate(reference):
        where = f"cluster_on={ref['cluster_on']} step={ref['step']} active={ref['active']}"
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
            modality = name.split(".")[0].removeprefix("recon_")
            if modality not in ref["active"]:
                assert all(r["grads"][name] is None for r in ranks), f"{where}: inactive {name} got a gradient"
                continue
            for r in ranks:
                torch.testing.assert_close(r["grads"][name], grad, **TOL, msg=lambda m: f"{where} grad {name}: {m}")


def test_two_gloo_ranks_equal_single_process(tmp_path):
    per_rank, _ = _spawn(2, range(STEPS), tmp_path / "two")
    assert {tuple(r["shares"]) for r in per_rank[0]} == {(2, 2)}
    _assert_equal(_single_process(), per_rank)


def test_three_ranks_with_unequal_shares_equal_single_process(tmp_path):
    """4 videos over 3 ranks: one rank holds 2 (which one rotates with the step), the others 1."""
    per_rank, _ = _spawn(3, range(STEPS), tmp_path / "three")
    assert {tuple(r["shares"]) for r in per_rank[0]} == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
    _assert_equal(_single_process(), per_rank)


def test_resized_between_steps_equals_single_process(tmp_path):
    """2 ranks, then 3, then 1, each phase continuing from the last one's model and objective state:
    the steps, the queue and the centroids never notice the world changing."""
    a, b = 4, 8
    two, state = _spawn(2, range(0, a), tmp_path / "phase1")
    three, state = _spawn(3, range(a, b), tmp_path / "phase2", state)
    one, _ = _run(0, 1, range(b, STEPS), state)
    # per phase, rank 0's records stand for all (the phases' own tests compare every rank)
    stitched = sorted(two[0] + three[0] + one, key=lambda r: (r["cluster_on"], r["step"]))
    _assert_equal(_single_process(), [stitched])
