"""What asking Ray Train about a drained node costs a step: ``ray.train.get_preemption_info()``.

    python -m bench.drain_check              # 2 workers, 3 repeats of 200 questions (~1 min)
    python -m bench.drain_check --json       # the table, then one JSON line

The question is a barrier over the ranks through Ray Train's synchronisation actor (every rank
sends an actor call and waits for the last one; rank 0's answer comes back to all), so a rank that
asks after every step pays at least an actor round trip per step. Measured in a Ray Train run of
``--workers`` CPU workers on a local Ray instance (raymcn's own: Ray Train's preemption watcher is
off there, which does not change the question's path: the watcher only sets what rank 0 answers):
each rank times ``--questions`` questions in a row, ``--repeats`` times, after ``--warmup`` untimed
ones; the figure is the slowest rank's mean per question, median over repeats. Beside it, for
scale: a one-float gloo broadcast from rank 0, which is what ``run.checkpoint_every``'s duration
check costs every ``run.log_every`` steps (``checkpoints/policy.CheckpointPolicy``).

From the cost c and a step time t, asking every N steps costs c / (N t) of training; the choice of
``run.drain_check_every`` is the smallest N of 1, 2, 5, 10, 20, 50 under 1 % of the plain paper
step measured on a GPU (``--step-s``, by default read from docs/measurements/gpu_smoke.json).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

from bench import harness
from raymcn.results.render import render_table

MEASURED = harness.REPO / "docs" / "measurements"


def gpu_step_s() -> float:
    """The plain paper step measured on a GPU: one of 4 ranks' share (bench.gpu_smoke's plain
    variant). A slower GPU's step is longer, so asking costs a smaller share of it."""
    return json.loads((MEASURED / "gpu_smoke.json").read_text())["variants"]["plain"]["s_per_step_wall"]


def cpu_step_s() -> float:
    """The measured paper-dims step on a CPU machine: bench.grad_cache's plain step at 64 clips."""
    rows = json.loads((MEASURED / "grad_cache.json").read_text())["step"]
    return next(r["step_s"] for r in rows if r["clips"] == 64 and not r["chunk"])


CANDIDATES = (1, 2, 5, 10, 20, 50)
SMOKE = {"questions": 5, "repeats": 1, "warmup": 2}


def _worker(conf: dict) -> list[dict] | None:
    """One rank: the timed questions and broadcasts (runs inside Ray Train); rank 0 returns every rank's."""
    import ray.train
    import torch
    import torch.distributed as dist

    def timed(fn) -> list[float]:
        for _ in range(conf["warmup"]):
            fn()
        out = []
        for _ in range(conf["repeats"]):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(conf["questions"]):
                fn()
            out.append((time.perf_counter() - start) / conf["questions"])
        return out

    one = torch.zeros(1, dtype=torch.float64)
    answers = set()

    def ask():
        answers.add(ray.train.get_preemption_info() is None)

    mine = {"rank": dist.get_rank(), "ask_s": timed(ask), "broadcast_s": timed(lambda: dist.broadcast(one, src=0)),
            "answers_none": answers == {True}}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every if mine["rank"] == 0 else None


def measure(workers: int, questions: int, repeats: int, warmup: int) -> dict:
    """Per-question seconds on every rank, from one Ray Train run of ``workers`` CPU workers on
    raymcn's own local Ray instance (or this process's connection, when it has one)."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from raymcn.train.on_ray.cluster import ray_session

    with ray_session("local"):
        cpus = min(1.0, float(ray.cluster_resources().get("CPU", 1)) / workers)
        trainer = TorchTrainer(_worker, train_loop_config={"questions": questions, "repeats": repeats,
                                                           "warmup": warmup},
                               scaling_config=ray.train.ScalingConfig(num_workers=workers,
                                                                      resources_per_worker={"CPU": cpus}),
                               run_config=ray.train.RunConfig(name=f"drain-check-{time.time_ns()}",
                                                              storage_path=tempfile.mkdtemp(prefix="raymcn-bench-")))
        ranks = trainer.fit().return_value
    return {"ranks": ranks, "cpus_per_worker": cpus}


def summarise(raw: dict, step_s: float) -> dict:
    ask = statistics.median(max(r["ask_s"][i] for r in raw["ranks"]) for i in range(len(raw["ranks"][0]["ask_s"])))
    bcast = statistics.median(max(r["broadcast_s"][i] for r in raw["ranks"])
                              for i in range(len(raw["ranks"][0]["broadcast_s"])))
    share = {n: ask / (n * step_s) for n in CANDIDATES}
    chosen = next((n for n in CANDIDATES if share[n] < 0.01), None)
    return {"ask_ms": ask * 1e3, "broadcast_ms": bcast * 1e3, "step_s": step_s, "share_of_step": share,
            "share_of_cpu_paper_step": {n: ask / (n * cpu_step_s()) for n in CANDIDATES},
            "chosen_every": chosen}


def build_parser():
    ap = harness.parser(__doc__, smoke="2 workers, 5 questions, 1 repeat", raw=True)
    ap.add_argument("--workers", type=int, default=2, help="Ray Train workers (default 2)")
    ap.add_argument("--questions", type=int, default=200, help="questions per timed repeat (default 200)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (default 3)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed questions first (default 20)")
    ap.add_argument("--step-s", type=float, default=gpu_step_s(),
                    help=f"the step the cost is a share of, seconds (default {gpu_step_s():.3f}: the plain paper "
                         "step measured on a GPU)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_args(build_parser(), argv, SMOKE)
    with harness.Results("drain_check", args) as results:
        raw = measure(args.workers, args.questions, args.repeats, args.warmup)
        results.save(raw=raw)
        figures = {"settings": {k: getattr(args, k) for k in ("workers", "questions", "repeats", "warmup")},
                   "raw": raw, **summarise(raw, args.step_s)}
        print(render_table([{"": "get_preemption_info (the question)", "ms": figures["ask_ms"]},
                            {"": "gloo broadcast of one float", "ms": figures["broadcast_ms"]}]))
        print(render_table([{"every N steps": n, f"share of a {args.step_s} s step": figures["share_of_step"][n],
                             f"of {cpu_step_s():.2f} s (CPU)": figures["share_of_cpu_paper_step"][n]}
                            for n in CANDIDATES]))
        print(f"smallest N under 1 % of a {args.step_s} s step: {figures['chosen_every']}")
        results.finish(figures)
    return 0 if all(r["answers_none"] for r in raw["ranks"]) else 1  # no drain here: every answer None


if __name__ == "__main__":
    raise SystemExit(main())
