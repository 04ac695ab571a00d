"""Gradient caching at paper dims on CPU: per-worker peak and time of a whole training step with and
without ``scale.grad_cache_clips``, the effect of chunk-level BatchNorm statistics, and the
preflight's advice for the paper's batch on one GPU.

    python -m bench.grad_cache                # clips 64 128 256 512, chunk 32; BN table; ~35 min on 2 quiet cores
    python -m bench.grad_cache --quick        # clips 64 128; BN at 128 clips (~10 min)
    python -m bench.grad_cache --only bn      # one section: step | bn | preflight
    python -m bench.grad_cache --json         # the tables, then one JSON line with every figure

Peak RSS of the process: ~10 GB at 512 clips without caching (the largest row).

**step**: the real training step, ``train_one_epoch`` on a one-batch epoch of the run as
``assemble`` builds it (forward, MCNObjective, backward, Adam; with caching the step of
``raymcn.train.gradcache``), one process, fp32, ``ModelConfig()`` (223.8 M parameters), 32 clips
per video (the paper's), 1000 audio frames, random inputs, ``loss.num_clusters`` = min(256, clips),
a full feature queue. Each (clips, chunk) runs in a fresh subprocess under torch's memory
profiler from before the first tensor, so the peak is absolute: the maximum of live bytes of
torch's allocator during the measured step (global step 1: no k-means refit, like 19 of 20
steps), as ``bench.step`` measures it. Then ``--repeats`` timed steps outside the profiler:
median wall time and the loop's phases (``time_*_s``; ``reforward`` is caching's second forward).
The estimate column is ``footprint.estimate_worker_memory(cfg, refit=False)`` (the preflight's).

**bn**: what chunk-level BatchNorm statistics change. One step at paper dims on a share of clips
from the synthetic corpus (its clips of one video are correlated, as real ones are), the model at
initialisation, BatchNorm in training mode: the plain step (DAVEnet's BN over the whole share)
against the cached step with chunks of 1, 2, 4 ... videos (BN over each chunk). Reported: the
relative change of each loss term, and of the gradient (‖g_chunk − g_share‖ / ‖g_share‖, and the
cosine) over DAVEnet, over the rest of the audio branch and over the video and text branches.
Chunks of b/N clips are exactly N ranks' per-rank BN under DDP (and the original DataParallel's
per-replica statistics: 4 × 1024 clips at the paper's batch).

**preflight**: ``footprint.fits`` for the paper's README configuration (128 videos × 32 clips,
one worker, bf16 on GPU) on a 24 GB and a 40 GB device: the message the preflight prints.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from bench import harness
from bench import step as stepbench
from raymcn.config import Config
from raymcn.data.formats.batch import random_batch
from raymcn.results.render import render_table
from raymcn.train.preflight import footprint

GB, MB = 1e9, 1e6
CPV = 32  # the paper's clips per video
PHASES = ("forward", "loss", "backward", "reforward", "optimizer")
# The smoke size's BN table draws its clips from the test suite's corpus
SMOKE_CORPUS = {"data.synthetic_videos": 64, "data.synthetic_eval_clips": 64}


def step_config(clips: int, chunk: int = 0, smoke: bool = False) -> Config:
    """``bench.step``'s configuration at the paper's 32 clips per video, caching in chunks of ``chunk`` clips."""
    return stepbench.step_config(clips, CPV, smoke).replace({"scale.grad_cache_clips": chunk})


# --- step: memory and time --------------------------------------------------------------------------
def measure(clips: int, chunk: int, repeats: int, smoke: bool = False) -> dict:
    """One (clips, chunk) in this process (a fresh subprocess of :func:`main`)."""
    from torch.profiler import ProfilerActivity, profile

    from raymcn.train.build import assemble
    from raymcn.train.loop import train_one_epoch
    from raymcn.train.run_plan import make_plan

    cfg = step_config(clips, chunk, smoke)
    cpu = torch.device("cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run = assemble(cfg, make_plan(cfg, videos=cfg.data.batch_size), device=cpu)
        batch = random_batch(cfg, clips)
        run.objective.cluster.queue.push(torch.randn(run.objective.cluster.queue.capacity, cfg.model.embed_dim))

        def one_step() -> dict:
            return train_one_epoch(run, [batch])

        one_step()  # warm-up: global step 0 (k-means refit, Adam state allocated)
        window = (time.time_ns(), None)
        one_step()  # the measured step: no refit
        window = (window[0], time.time_ns())
    replay = stepbench._replay(prof, window)
    del prof
    walls, phases = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        metrics = one_step()
        walls.append(time.perf_counter() - t0)
        phases.append({k: metrics[f"time_{k}_s"] for k in PHASES})
    est = footprint.estimate_worker_memory(cfg, refit=False, threads=torch.get_num_threads())
    return {"clips": clips, "chunk": chunk, "repeats": repeats, "threads": torch.get_num_threads(),
            "step_s": statistics.median(walls), "step_s_all": walls,
            "phase_s": {k: statistics.median(p[k] for p in phases) for k in PHASES},
            "peak_alloc_bytes": replay["peak_alloc_bytes"], "peak_phase": replay["peak_phase"],
            "estimate": est}


def _child(args: list[str]) -> dict:
    proc = subprocess.run(harness.module_command("bench.grad_cache", *args), capture_output=True, text=True,
                          cwd=harness.REPO)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"bench.grad_cache: child {args} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_table(rows: list[dict]) -> str:
    by = {(r["clips"], r["chunk"]): r for r in rows}
    table = []
    for r in rows:
        plain = by.get((r["clips"], 0))
        p = r["phase_s"]
        table.append({
            "clips": r["clips"], "chunk": r["chunk"] or "off", "peak GB": f"{r['peak_alloc_bytes'] / GB:.2f}",
            "peak in": r["peak_phase"], "est GB": f"{r['estimate']['total'] / GB:.2f}",
            "est/meas": f"{r['estimate']['total'] / r['peak_alloc_bytes']:.2f}", "step s": f"{r['step_s']:.1f}",
            "fwd": f"{p['forward']:.1f}", "loss": f"{p['loss']:.1f}", "bwd": f"{p['backward']:.1f}",
            "reforward": f"{p['reforward']:.1f}", "opt": f"{p['optimizer']:.1f}",
            "time / off": f"{r['step_s'] / plain['step_s']:.2f}" if plain and r["chunk"] else "-",
            "peak / off": f"{r['peak_alloc_bytes'] / plain['peak_alloc_bytes']:.2f}" if plain and r["chunk"] else "-"})
    return render_table(table, right=[k for k in table[0] if k != "peak in"])


def slopes(rows: list[dict]) -> dict:
    """Per-clip growth of the measured peak, with and without caching (least squares over the clips)."""
    from bench import meters

    out = {}
    for label, sel in (("off", [r for r in rows if not r["chunk"]]), ("cached", [r for r in rows if r["chunk"]])):
        if len(sel) > 1:
            _, slope, r2 = meters.fitted_line([float(r["clips"]) for r in sel], [float(r["peak_alloc_bytes"]) for r in sel])
            out[label] = {"bytes_per_clip": slope, "r2": r2}
    return out


# --- bn: the effect of chunk statistics ----------------------------------------------------------------
def _groups(net) -> dict[str, list]:
    """Parameter groups: DAVEnet, the rest of the audio branch, the video and text branches, the heads."""
    groups: dict[str, list] = {"davenet": [], "audio head": [], "video+text": [], "recon heads": []}
    for name, p in net.named_parameters():
        part, _, rest = name.partition(".")
        key = ("davenet" if rest.startswith("davenet.") else "audio head" if part == "audio_encoder"
               else "recon heads" if part == "recon" else "video+text")
        groups[key].append((name, p))
    return groups


def bn_effect(clips: int, chunks: list[int], smoke: bool = False) -> dict:
    """One step's loss terms and gradients, plain vs cached with each chunk size (fresh model each)."""
    import copy

    from bench.readers import train_videos
    from raymcn.model import MCN
    from raymcn.train.build import build_objective
    from raymcn.train.gradcache import cached_step
    from raymcn.train.run_plan import make_plan
    from raymcn.train.stages import ALL

    cfg = step_config(clips, smoke=smoke).replace(SMOKE_CORPUS if smoke else {})
    videos = train_videos(cfg)
    batch = next(videos.batches(cfg, 0, 0, 1, 1))
    torch.manual_seed(cfg.run.seed)
    base = MCN(cfg.model).train()

    def one(chunk: int) -> tuple[dict, dict]:
        net = copy.deepcopy(base)
        objective = build_objective(cfg, make_plan(cfg, videos=cfg.data.batch_size), "cpu")
        if chunk:
            terms = cached_step(net, objective, batch, ALL, 0, chunk)
        else:
            terms = objective(net(batch, ALL), ALL, 0)
            terms["total_loss"].backward()
        grads = {g: torch.cat([p.grad.flatten() for _, p in ps]) for g, ps in _groups(net).items()}
        grads["all"] = torch.cat(list(grads.values()))
        return {k: float(v.detach()) for k, v in terms.items()}, grads

    ref_terms, ref_grads = one(0)
    rows = []
    for chunk in chunks:
        terms, grads = one(chunk)
        row = {"chunk": chunk, "ranks_equivalent": clips // chunk,
               "terms": {k: (terms[k] - v) / abs(v) for k, v in ref_terms.items()}, "grads": {}}
        for g, ref in ref_grads.items():
            got = grads[g]
            row["grads"][g] = {"rel": float((got - ref).norm() / ref.norm()),
                               "cos": float(torch.nn.functional.cosine_similarity(got, ref, dim=0))}
        rows.append(row)
        print(f"  chunk {chunk}: gradient change {row['grads']['all']['rel']:.3g}", flush=True)
    return {"clips": clips, "terms": ref_terms, "rows": rows}


def bn_table(res: dict) -> str:
    table = []
    for r in res["rows"]:
        row = {"chunk clips": r["chunk"], "= per-rank BN of N ranks": r["ranks_equivalent"]}
        for k in ("total_loss", "contrastive_loss", "cluster_loss", "recon_loss"):
            row[f"Δ {k.removesuffix('_loss')}"] = f"{100 * r['terms'][k]:+.2f} %"
        for g, v in r["grads"].items():
            row[f"grad {g} rel (cos)"] = f"{v['rel']:.3f} ({v['cos']:.3f})"
        table.append(row)
    return render_table(table, right=list(table[0]))


# --- preflight -------------------------------------------------------------------------------------------
def preflight_messages() -> list[dict]:
    cfg = Config().replace({"scale.num_workers": 1, "scale.use_gpu": True})  # the paper: 128 videos x 32 clips
    out = []
    for label, device in (("24 GB", 24 * 10**9), ("40 GB (A100)", 40 * 10**9)):
        ok, msg, over = footprint.fits(cfg, device)
        after = footprint.fits(cfg.replace(over), device) if over else (ok, msg, {})
        out.append({"device": label, "ok": ok, "message": msg, "overrides": over, "then": after[1]})
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = harness.parser(__doc__, smoke="the model at bench.step's tiny widths, 64 clips, chunk 32, BN at 64 clips, "
                                       "1 timed repeat")
    ap.add_argument("--clips", type=int, nargs="+", help="clips per step (default 64 128 256 512; --quick 64 128)")
    ap.add_argument("--chunk", type=int, nargs="+", default=[32], help="chunk sizes to run (default 32 = one video)")
    ap.add_argument("--bn-clips", type=int, help="share of the BN table (default 256; --quick 128)")
    ap.add_argument("--repeats", type=int, help="timed steps per row (default 2)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("step", "bn", "preflight"))
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--_child", nargs=2, type=int, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.smoke else 2)
    if args._child:
        print(json.dumps(measure(*args._child, repeats, args.smoke)))
        return 0
    clips = args.clips or ([64] if args.smoke else [64, 128] if args.quick else [64, 128, 256, 512])
    for c in clips + args.chunk:
        if c % CPV:
            ap.error(f"{c}: clips and chunks are whole videos of {CPV} clips")
    with harness.Results("grad_cache", args) as results:
        print(f"bench.grad_cache: {'smoke' if args.smoke else 'paper'} dims, fp32 on CPU: {results.machine}",
              flush=True)
        out: dict = {"bench": "grad_cache"}
        if args.only in (None, "step"):
            rows = []
            for n in clips:
                for chunk in [0] + [c for c in args.chunk if c < n]:
                    t0 = time.perf_counter()
                    extra = ["--threads", str(args.threads)] if args.threads else []
                    extra += ["--smoke"] if args.smoke else []
                    rows.append(_child(["--_child", str(n), str(chunk), "--repeats", str(repeats), *extra]))
                    results.save(step=rows)
                    print(f"  {n} clips, chunk {chunk or 'off'}: {time.perf_counter() - t0:.0f} s", flush=True)
            print("\none training step, peak of torch's allocator (absolute) and time per step:")
            print(step_table(rows))
            s = slopes(rows)
            print("peak growth per clip: " + ", ".join(f"{k} {v['bytes_per_clip'] / MB:.2f} MB/clip (R² {v['r2']:.3f})"
                                                      for k, v in s.items()))
            out.update(step=rows, slopes=s)
        if args.only in (None, "bn"):
            n = args.bn_clips or (64 if args.smoke else 128 if args.quick else 256)
            chunks = [c for c in (32, 64, 128, 256) if c < n] + [n]  # the last: one chunk, a control (0 change)
            print(f"\nchunk-level BatchNorm: one step on {n} synthetic-corpus clips, model at initialisation, "
                  f"plain step (BN over {n}) vs chunks:", flush=True)
            res = bn_effect(n, chunks, args.smoke)
            print(bn_table(res))
            out["bn"] = res
            results.save(**out)
        if args.only in (None, "preflight"):
            print("\npreflight for the paper's batch (128 videos x 32 clips) on one GPU:")
            msgs = preflight_messages()
            for m in msgs:
                print(f"- {m['device']}: {m['message']}\n  with {m['overrides']}: {m['then']}")
            out["preflight"] = msgs
        results.finish(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
