"""Time and peak memory of one MCN training step at paper dimensions on CPU, per clip count.

    python -m bench.step            # clips 8, 16, 32, 64; 3 timed repeats (~6 min quiet, 2 cores)
    python -m bench.step --quick    # clips 4, 8; 2 repeats (~1.5 min quiet)
    python -m bench.step --json     # the table, then one JSON line with every figure
    python -m bench.step --zero-grad-late    # the earlier loop order, zero_grad after the loss (before/after)

What runs: the real training step, ``raymcn.train.loop.train_one_epoch`` on a one-batch epoch
(forward, MCNObjective, backward, gradient-norm check, Adam, LR schedule) of the run as
``raymcn.train.build.assemble`` builds it (the Ray worker's assembly), one process, no Ray,
fp32 on CPU. The model is ``ModelConfig()`` (223.8 M parameters, 6144-d space, full-width
DAVEnet); the batch follows the batch contract with 1000 audio frames (fp16) and random values.
Clips are grouped 8 per video (``data.clips_per_video``) and ``loss.num_clusters`` = min(256,
clips), because k-means needs at least K clips per step; everything else is the default config.
Peak memory at 64 clips: 4.3 GB allocated, ~6.1 GB max RSS of the subprocess.

Each clip count runs in a fresh subprocess. Torch's memory profiler (``profile_memory=True``)
records from before the first tensor is created, so replaying its allocation and free events
gives the *absolute* bytes held by live tensors at every moment:

1. **saved activations**: one forward under ``torch.autograd.graph.saved_tensors_hooks``; the bytes
   of the distinct storages autograd keeps (parameters, buffers and batch inputs excluded)
   against the preflight's activation term (``footprint.model_trace``: the same forward traced on
   the meta device);
2. a warm-up step (global step 0: k-means refit, Adam state allocated);
3. the measured step (step 1: no refit, like 19 of every 20 steps): **peak alloc** = the maximum
   of live bytes during the step and the phase it falls in, and **fwd+bwd peak** = the maximum
   outside ``optimizer.step`` (what grows with the clips). **Peak RSS** (VmHWM minus the RSS after
   ``import torch``; reset before the step where the kernel allows it) is a cross-check that
   includes allocator fragmentation and the profiler's own records;
4. ``--repeats`` timed steps, outside the profiler: median wall time and the loop's own phase
   times (forward, loss, backward, optimizer).

The estimate columns are ``footprint.estimate_worker_memory(cfg, refit=False)`` (one worker,
fp32): its total, and persistent + step phase (everything but Adam's temporaries). A line
fitted over the clip counts gives the per-clip slopes: every term is linear in the clips except
the similarity slabs (b×B per pair, quadratic), a few kB at these sizes; ``bench/memory.py``
measures those at B up to 4096.

``--zero-grad-late`` replaces the loop's step by the same step with ``optimizer.zero_grad`` moved
after the loss, as ``loop.py`` first had it: last step's gradients (P × 4 = 0.9 GB) then stay live
through the forward, the loss and any k-means refit. The loop now frees them before the forward
(as the original ``TrainOneBatch`` did); this flag shows the before/after.

Load caveat: timings are wall-clock on whatever else the machine runs; re-measure on a quiet
machine (memory figures do not depend on load). ``--threads`` pins torch's intra-op threads.

What it found (this machine, 2 cores; the tables are in docs/performance.md):

* Per kernel path. On an AVX2-only CPU the test suite once measured 8.5 MB against an estimate of
  3.2 MB. Reproduced here with ``ONEDNN_MAX_CPU_ISA=AVX2`` (the same 8 524 244 bytes) and located by
  replaying the profiler's allocations per conv call: the backward of DAVEnet's first convolution
  (a 1-channel spectrogram) reorders its input into oneDNN's channel-blocked layout, 8 channels wide
  on AVX2, so the spectrogram becomes 8 channels (1.28 MB per clip at paper dims). On AVX-512 the
  same call keeps the input unpadded. Hence one workspace formula per path
  (``footprint.conv_path()``), and the scratchpad allowance per oneDNN call (two 16-float vectors
  per output position per thread, measured <= 11 KB per thread at 160 positions, plus 256 KiB).
* Waste, fixed: last step's gradients held through the forward (step peak 3.967 -> 3.599 GB at 32
  clips, 4.344 -> 3.917 GB at 64; ``--zero-grad-late`` shows the old order); the model's outputs
  (0.1 GB per rank at paper size) held through Adam's step, now released after the loss; DDP's
  second copy of the gradients in its buckets (0.9 GB per worker at paper size), now
  ``gradient_as_bucket_view=True``, except under gradient caching's ``no_sync`` chunks, which the
  estimate counts (P x 4 bytes until the last chunk's backward).

The convolution workspace by kernel path (``footprint.conv_path()``; the estimate has one formula
per path, and this bench prints which one the machine takes):

* ``onednn-avx512`` (x86 with AVX-512; AMX CPUs too): weights + input (twice in the strided
  convs' backward) + output, reordered; measured per conv call, 1-32 threads.
* ``onednn-avx2`` (AVX2 without AVX-512, or ``ONEDNN_MAX_CPU_ISA=AVX2``): the same with channels
  padded to blocks of 8 (conv1: 8 x its input); the test suite runs this path on every CI machine.
* ``native`` (oneDNN disabled or not built): im2col columns, b x C_in * k * T'; measured per call.
* ``cudnn`` (``scale.use_gpu``): not known in advance; a stated margin (the AVX-512 formula in
  fp32), measured by ``bench/gpu_smoke.py`` on a GPU.
* ``unknown`` (any other CPU): not known in advance; the larger of the AVX2 and native formulas.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from bench import harness, meters
from bench.meters import end_ns, start_ns
from bench.procstat import status_bytes
from raymcn.config import Config
from raymcn.data.formats.batch import random_batch
from raymcn.results.render import render_table
from raymcn.train.preflight import footprint

MB = 1e6
GB = 1e9
# The smoke size's model: tiny widths (the paper's take minutes per step on CPU); clips 4 and 8
SMOKE_DIMS = {"model.embed_dim": 64, "model.audio_channels": [8, 8, 16, 16, 32], "model.recon_hidden": 32,
              "data.audio_frames": 64, "loss.kmeans_iters": 5, "loss.queue_steps": 2}


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False if not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def step_config(clips: int, cpv: int = 8, smoke: bool = False) -> Config:
    """Paper dims (with ``smoke``: ``SMOKE_DIMS``), one process, ``clips`` in videos of ``cpv``
    clips, ``loss.num_clusters`` = min(256, clips) (k-means needs at least K clips a step)."""
    cpv = min(cpv, clips)
    if clips % cpv:
        raise SystemExit(f"--clips {clips}: must be a multiple of {cpv} (clips per video)")
    return Config().replace({**(SMOKE_DIMS if smoke else {}), "data.batch_size": clips // cpv,
                             "data.clips_per_video": cpv, "loss.num_clusters": min(256, clips),
                             "scale.num_workers": 0})


def zero_grad_late_step(model, objective, optimizer, scheduler, batch: dict, *, cfg: Config, state) -> dict:
    """``train_one_epoch``'s step for a joint run, but with ``zero_grad`` *after* the loss (the
    earlier loop order), so last step's gradients (P × 4 bytes) are held through the forward, the
    loss and a k-means refit. Returns the loop's timing keys."""
    from raymcn.train.stages import ALL

    times = {}
    t = time.perf_counter()
    out = model(batch, ALL)
    times["time_forward_s"], t = time.perf_counter() - t, time.perf_counter()
    terms = objective(out, ALL, state.step)
    times["time_loss_s"], t = time.perf_counter() - t, time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    terms["total_loss"].backward()
    times["time_backward_s"], t = time.perf_counter() - t, time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
    optimizer.step()
    scheduler.step()
    state.step += 1
    times["time_optimizer_s"] = time.perf_counter() - t
    return times


def measure(clips: int, repeats: int, zero_grad_late: bool = False, smoke: bool = False) -> dict:
    """One clip count, in this process (called in a fresh subprocess by :func:`main`)."""
    from torch.profiler import ProfilerActivity, profile

    from raymcn.losses.cluster import KMEANS_REFIT
    from raymcn.train.build import assemble
    from raymcn.train.loop import train_one_epoch
    from raymcn.train.run_plan import make_plan

    rss_start = status_bytes("VmRSS")
    cfg = step_config(clips, smoke=smoke)
    cpu = torch.device("cpu")
    active = frozenset({"video", "audio", "text"})
    # The profiler records from before the first tensor is made, so every allocation *and* free of
    # the model, optimizer, queue and batch is in the trace and live bytes are absolute.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        # The run as the Ray worker assembles it (one process: no DDP wrap); Adam's state is
        # allocated at its first step, inside the trace.
        run = assemble(cfg, make_plan(cfg, videos=cfg.data.batch_size), device=cpu)
        model, optimizer, scheduler, objective, state = run.model, run.optimizer, run.scheduler, run.objective, run.state
        batch = random_batch(cfg, clips)
        inputs = tuple(v for v in batch.values() if isinstance(v, torch.Tensor))
        # 1. saved activations of one forward (the graph is dropped right after)
        state_tensors = tuple(model.parameters()) + tuple(model.buffers())
        out, saved = meters.saved_tensor_bytes(lambda: model(batch, active), exclude=state_tensors + inputs)
        del out  # frees the graph and its saved tensors
        # A full queue, so the warm-up refit builds the k-means input the estimate counts.
        objective.cluster.queue.push(torch.randn(objective.cluster.queue.capacity, cfg.model.embed_dim))

        def one_step() -> dict:
            if zero_grad_late:
                return zero_grad_late_step(model, objective, optimizer, scheduler, batch, cfg=cfg, state=state)
            return train_one_epoch(run, [batch])

        one_step()  # 2. warm-up: global step 0 (k-means refit, Adam state allocated)
        rss_before = status_bytes("VmRSS")
        reset = _reset_peak_rss()
        window = (time.time_ns(), None)
        one_step()  # the measured step (step 1: no refit, like 19 of every 20 steps)
        window = (window[0], time.time_ns())
        hwm = status_bytes("VmHWM")
    replay = _replay(prof, window)
    measured = {
        "params": sum(t.nbytes for t in state_tensors),
        "grads": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
        "adam_moments": sum(v.nbytes for st in optimizer.state.values() for k, v in st.items() if k != "step"),
        "batch": sum(t.nbytes for t in inputs),
        "activations": saved,
        "conv_workspace": max(t for _, t in meters.op_transient_bytes(prof)),
        "queue": objective.cluster.queue._buf.nbytes,
        "kmeans_input": max(t for _, t in meters.op_transient_bytes(prof, (KMEANS_REFIT,))),
        "optimizer_workspace": max(t for _, t in meters.op_transient_bytes(prof, ("Optimizer.step#Adam.step",))),
        "loss": _loss_peak(model, objective, batch, active, state.step),
        "total": replay["peak_alloc_bytes"],
    }

    # 3. timed steps, outside the profiler
    walls, phases = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        metrics = one_step()
        walls.append(time.perf_counter() - t0)
        phases.append({k: metrics[f"time_{k}_s"] for k in ("forward", "loss", "backward", "optimizer")})

    est = footprint.estimate_worker_memory(cfg, refit=False, threads=torch.get_num_threads())  # measured step: no refit
    estimated = {k: est[k] for k in measured if k in est}
    estimated["kmeans_input"] = footprint.estimate_worker_memory(cfg, threads=torch.get_num_threads())["kmeans_input"]
    estimated["loss"] = est["loss_slabs"] + est["gathered_embeddings"] + est["loss_grads"]
    traced = footprint.model_trace(cfg).saved_bytes(clips)  # the estimate's activations, from a meta trace
    return {
        "clips": clips, "repeats": repeats, "threads": torch.get_num_threads(), "zero_grad_late": zero_grad_late,
        "conv_path": footprint.conv_path(),
        "step_s": statistics.median(walls), "step_s_all": walls,
        "phase_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "saved_activation_bytes": saved, "traced_activation_bytes": traced,
        **replay,
        "rss_start_bytes": rss_start, "rss_before_step_bytes": rss_before, "peak_rss_bytes": hwm,
        "peak_rss_is_step_only": reset,
        "estimate": est,
        "estimate_fwd_bwd_bytes": sum(est[k] for k in footprint.PERSISTENT + footprint.STEP_PHASE),
        "terms_measured": measured, "terms_estimated": estimated,
    }


def _loss_peak(model, objective, batch: dict, active: frozenset, step: int) -> int:
    """Peak bytes of the objective's forward + backward from the model's outputs (held before it
    starts, as leaves), on a step without refit: the slabs, normalisers and the gradients it hands
    back, which the estimate counts as loss_slabs + gathered_embeddings + loss_grads."""
    with torch.no_grad():
        out = model(batch, active)
    leaves: dict = {}
    for k, v in out.items():
        leaves[k] = (tuple(t.detach().requires_grad_() for t in v) if isinstance(v, tuple)
                     else v.detach().requires_grad_())
    step = step if step % objective.loss.refresh_every else step + 1
    _, peak, _ = meters.peak_allocated_bytes(lambda: objective(leaves, active, step)["total_loss"].backward())
    return peak


def _replay(prof, window: tuple[int, int]) -> dict:
    """Replay the memory events: live torch bytes at the start of ``window``, their maximum inside
    it (both absolute: the trace starts before the first tensor), the phase running at that
    maximum, and the maximum outside the optimizer step (forward + loss + backward)."""
    events = list(prof.profiler.kineto_results.events())
    optim = [(start_ns(e), end_ns(e)) for e in events if e.name().startswith("Optimizer.step")
             and start_ns(e) >= window[0]]
    mem = sorted((e for e in events if e.name() == "[memory]"), key=start_ns)
    live = start = peak = peak_fb = 0
    t_peak = window[0]
    started = False
    for e in mem:
        if not started and start_ns(e) >= window[0]:
            start = peak = peak_fb = live
            started = True
        if start_ns(e) > window[1]:
            break
        live += e.nbytes()
        if not started:
            continue
        if live > peak:
            peak, t_peak = live, start_ns(e)
        if not any(a <= start_ns(e) <= b for a, b in optim):
            peak_fb = max(peak_fb, live)
    running = [e.name() for e in events if e.name() != "[memory]" and start_ns(e) <= t_peak <= end_ns(e)]
    if any(n.startswith("Optimizer.step") for n in running):
        phase = "optimizer"
    elif any(n.startswith("autograd::engine") for n in running):
        phase = "backward"
    else:
        phase = "forward/loss"
    return {"live_at_step_start_bytes": start, "peak_alloc_bytes": peak, "peak_phase": phase,
            "peak_fwd_bwd_bytes": peak_fb}


def _run_child(clips: int, repeats: int, threads: int | None, zero_grad_late: bool, smoke: bool) -> dict:
    cmd = harness.module_command("bench.step", "--_child", str(clips), "--repeats", str(repeats))
    if zero_grad_late:
        cmd.append("--zero-grad-late")
    if threads:
        cmd += ["--threads", str(threads)]
    if smoke:
        cmd.append("--smoke")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=harness.REPO)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"bench.step: the run with {clips} clips failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(rows: list[dict]) -> str:
    head = ("clips", "step s", "fwd", "loss", "bwd", "opt", "s/clip", "saved MB", "traced MB",
            "peak alloc GB", "peak in", "est GB", "est/meas", "fwd+bwd peak GB", "fwd+bwd est GB", "fwd+bwd est/meas",
            "peak RSS GB")
    table = []
    for r in rows:
        p = r["phase_s"]
        rss = r["peak_rss_bytes"] - r["rss_start_bytes"]
        cells = (r["clips"], f"{r['step_s']:.2f}", f"{p['forward']:.2f}", f"{p['loss']:.2f}", f"{p['backward']:.2f}",
                 f"{p['optimizer']:.2f}", f"{r['step_s'] / r['clips']:.3f}", f"{r['saved_activation_bytes'] / MB:.1f}",
                 f"{r['traced_activation_bytes'] / MB:.1f}", f"{r['peak_alloc_bytes'] / GB:.3f}", r["peak_phase"],
                 f"{r['estimate']['total'] / GB:.3f}", f"{r['estimate']['total'] / r['peak_alloc_bytes']:.3f}",
                 f"{r['peak_fwd_bwd_bytes'] / GB:.3f}", f"{r['estimate_fwd_bwd_bytes'] / GB:.3f}",
                 f"{r['estimate_fwd_bwd_bytes'] / r['peak_fwd_bwd_bytes']:.3f}", f"{rss / GB:.3f}")
        table.append(dict(zip(head, cells)))
    return render_table(table, right=head)


TERMS = ("params", "grads", "adam_moments", "batch", "activations", "conv_workspace", "loss", "queue",
         "kmeans_input", "optimizer_workspace", "total")


def terms_table(rows: list[dict]) -> str:
    """Estimate / measured of every term, one column per clip count, and both figures in MB for the
    largest count (total = the whole measured step's peak against the estimate's total)."""
    last = rows[-1]
    table = []
    for term in TERMS:
        row = {"term": term}
        for r in rows:
            meas = r["terms_measured"][term]
            row[f"est/meas {r['clips']} clips"] = f"{r['terms_estimated'][term] / meas:.4f}" if meas else "-"
        row[f"est MB ({last['clips']})"] = f"{last['terms_estimated'][term] / MB:.1f}"
        row[f"measured MB ({last['clips']})"] = f"{last['terms_measured'][term] / MB:.1f}"
        table.append(row)
    return render_table(table, right=[k for k in table[0] if k != "term"])




def summarize(rows: list[dict]) -> dict:
    xs = [float(r["clips"]) for r in rows]
    t0, t_slope, t_r2 = meters.fitted_line(xs, [r["step_s"] for r in rows])
    m0, m_slope, m_r2 = meters.fitted_line(xs, [float(r["peak_fwd_bwd_bytes"]) for r in rows])
    e0, e_slope, _ = meters.fitted_line(xs, [float(r["estimate_fwd_bwd_bytes"]) for r in rows])
    s_per_clip = [r["saved_activation_bytes"] / r["clips"] for r in rows]
    return {
        "time_intercept_s": t0, "time_per_clip_s": t_slope, "time_r2": t_r2,
        "peak_intercept_bytes": m0, "peak_per_clip_bytes": m_slope, "peak_r2": m_r2,
        "estimate_per_clip_bytes": e_slope, "estimate_intercept_bytes": e0,
        "saved_per_clip_bytes": statistics.mean(s_per_clip),
        "traced_per_clip_bytes": statistics.mean(r["traced_activation_bytes"] / r["clips"] for r in rows),
        "estimate_over_measured": [r["estimate"]["total"] / r["peak_alloc_bytes"] for r in rows],
        "fwd_bwd_estimate_over_measured": [r["estimate_fwd_bwd_bytes"] / r["peak_fwd_bwd_bytes"] for r in rows],
        "lowest_term_ratio": min((r["terms_estimated"][t] / r["terms_measured"][t], t, r["clips"])
                                 for r in rows for t in TERMS if r["terms_measured"][t]),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = harness.parser(__doc__, smoke="the model at tiny widths (SMOKE_DIMS), clips 4 and 8, 1 timed repeat")
    ap.add_argument("--clips", type=int, nargs="+", help="clip counts (default 8 16 32 64; --quick: 4 8)")
    ap.add_argument("--repeats", type=int, help="timed steps per clip count (default 3; --quick: 2)")
    ap.add_argument("--quick", action="store_true", help="small clip counts, fewer repeats")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--zero-grad-late", action="store_true",
                    help="free last step's gradients after the loss (the earlier loop order) instead of "
                         "before the forward (loop.py's now): shows what the stale gradients cost")
    ap.add_argument("--_child", type=int, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.smoke else 2 if args.quick else 3)
    if args._child:
        print(json.dumps(measure(args._child, repeats, args.zero_grad_late, args.smoke)))
        return 0

    clips = args.clips or ([4, 8] if args.quick or args.smoke else [8, 16, 32, 64])
    with harness.Results("step", args) as results:
        print(f"bench.step: one MCN training step at {'smoke' if args.smoke else 'paper'} dims on CPU: "
              f"{results.machine}\nclips {clips}, {repeats} timed repeats each"
              + (", zero_grad after the loss (earlier order)" if args.zero_grad_late else ""), flush=True)
        rows = []
        for n in clips:
            t0 = time.perf_counter()
            rows.append(_run_child(n, repeats, args.threads, args.zero_grad_late, args.smoke))
            results.save(rows=rows)
            print(f"  {n} clips done in {time.perf_counter() - t0:.0f} s", flush=True)
        results.finish({"bench": "step", "rows": rows, "summary": report(rows)})
    return 0


def report(rows: list[dict]) -> dict:
    """Print the tables and the fits; returns the summary."""
    print(_table(rows))
    s = summarize(rows)
    print("\nestimate / measured by term (none may be below 1):")
    print(terms_table(rows))
    low, term, at = s["lowest_term_ratio"]
    print(f"lowest ratio: {low:.4f} ({term}, {at} clips)" + ("" if low >= 1 else "  <-- UNDER-ESTIMATED"))
    print(f"\nfit over clips: step time = {s['time_intercept_s']:.2f} s + {s['time_per_clip_s']:.3f} s/clip "
          f"(R² {s['time_r2']:.3f})\n               fwd+bwd peak = {s['peak_intercept_bytes'] / GB:.2f} GB + "
          f"{s['peak_per_clip_bytes'] / MB:.2f} MB/clip (R² {s['peak_r2']:.3f}); "
          f"estimate = {s['estimate_intercept_bytes'] / GB:.2f} GB + {s['estimate_per_clip_bytes'] / MB:.2f} MB/clip")
    print(f"saved activations: measured {s['saved_per_clip_bytes'] / MB:.3f} MB/clip, "
          f"traced on meta {s['traced_per_clip_bytes'] / MB:.3f} MB/clip (both with BatchNorm's batch statistics, "
          f"a per-step constant)")
    big = footprint.estimate_worker_memory(step_config(4096, 32))
    last = rows[-1]
    print(f"quadratic term (b×B slabs): {last['estimate']['loss_slabs'] / 1e3:.0f} kB at {last['clips']} clips; "
          f"{big['loss_slabs'] / GB:.2f} GB for one worker at B = 4096 (bench.memory measures it)")
    if len(rows) > 1 and not all(r["peak_rss_is_step_only"] for r in rows):
        print("note: VmHWM could not be reset; peak RSS includes the warm-up step")
    return s


if __name__ == "__main__":
    sys.exit(main())
