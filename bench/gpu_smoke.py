"""GPU smoke: the real training step on one GPU, in one command, without Ray; with ``--compare``,
the step's levers side by side.

    python -m bench.gpu_smoke                         # paper dims on cuda:0 (~2-4 min on an A100/H100)
    python -m bench.gpu_smoke --compare               # eager, compiled and each DAVEnet layout, in turns
    python -m bench.gpu_smoke --out gpu_smoke.json    # also write the JSON to a file
    python -m bench.gpu_smoke --device cpu --smoke    # the script's own check on a machine without a GPU

The step is measured by ``raymcn.train.preflight.step_probe``, the code ``raymcn doctor --step``
runs on every node: one process, a 1-rank process group (NCCL on CUDA, gloo on CPU), the model
wrapped in DDP as a Ray Train worker wraps it, ``build.assemble`` and ``loop.train_one_epoch`` over
prefetched batches, bf16 autocast, losses and k-means in fp32. Three workloads:

* ``plain``: one rank's share of the paper's step (32 videos x 32 clips = 1024 clips);
* ``cached``: the paper's whole step on this one GPU (128 videos x 32 clips = 4096 clips) with
  gradient caching in chunks of ``--chunk`` clips;
* ``ring``: the ``plain`` share with the ring contrastive loss (on 1 rank: one hop, no transfer).

The batches are random tensors of the batch contract at paper dims (2048 + 2048 video features,
40 x 1000 mel frames in fp16, 20 words x 300); no shards are read. Each workload runs ``--warmup``
steps (cuDNN autotuning, the first k-means fit, compiling; not timed) and then ``--steps`` timed
steps. Reported per workload: the peak of allocated device memory against the preflight's estimate
(``footprint.estimate_worker_memory``; the estimate must not be below it), seconds per step by
phase (CUDA events, no synchronisation inside the step), clips/s, MFU and the loss terms.

**MFU** (model FLOPs utilisation): the step's floating-point operations, counted once on the eager
step by torch's ``FlopCounterMode`` (matrix products and convolutions; the same arithmetic in every
variant), per second of step, over the device's matrix-product peak measured in the same run by
``--peak-size`` square products: bf16 on a GPU (the model runs under bf16 autocast), fp32 on a CPU.

**--compare** builds every variant of each workload at once: eager (``nchw``, the default),
``compiled`` (``scale.compile``), ``channels_last`` and ``1d`` (``scale.davenet_layout``), and each
layout compiled. After each variant's warm-up (its compile time said apart), the variants take
turns: ``--rounds`` rounds of ``--steps`` steps each, so a drift of the machine falls on all of
them alike. Per variant: clips/s, MFU, peak memory, the ratio to eager and, for a compiled one,
the steps after which its compile time is paid back. Default workload: ``plain`` (each compiled
variant compiles for minutes on a GPU's first run; Inductor caches the kernels on disk). Every
variant holds its own model and optimizer state: ``--levers`` picks fewer on a smaller GPU. The
compiled variants are built last; ``--budget`` seconds bound the building, so that a machine lent
for minutes still gets a table: a variant whose build would end past it is left out, with its
reason, and each build's time is in the partial file (``--out`` + ``.partial``) as it finishes.
Then ``torch.profiler`` records one more block of ``--steps`` steps of eager and of the fastest
other variant: the ``--profile-top`` CUDA kernels by device time (on a CPU: operators by self CPU
time), per step and as a share of the block's, so the same run says where the step's time goes.

The JSON line (last line of the output, and ``--out``) holds every figure. Runs without Ray:
nothing it imports needs it.
"""

from __future__ import annotations

import math
import time

import torch

from bench import harness
from bench.rank_exit import end_rank
from raymcn.config import Config
from raymcn.train.preflight.footprint import GIB, allocator_total, estimate_worker_memory
from raymcn.train.preflight.step_probe import StepRig, measure_step, one_rank_group, rig_config, step_figures

PAPER_SHARE = {"data.batch_size": 32, "data.clips_per_video": 32}  # one of 4 ranks' share of 128 videos
PAPER_STEP = {"data.batch_size": 128, "data.clips_per_video": 32}
QUICK = {"model.embed_dim": 64, "model.audio_channels": [8, 8, 16, 16, 32], "model.recon_hidden": 32,
         "data.audio_frames": 64, "loss.num_clusters": 8, "loss.kmeans_iters": 5, "loss.queue_steps": 2}
# --compare's variants: the settings each adds to the workload's. Built in this order: the ones that
# compile last, so that a --budget spent on compiling still leaves every layout measured.
LEVERS = {"eager": {}, "channels_last": {"scale.davenet_layout": "channels_last"},
          "1d": {"scale.davenet_layout": "1d"}, "compiled": {"scale.compile": True},
          "channels_last+compiled": {"scale.davenet_layout": "channels_last", "scale.compile": True},
          "1d+compiled": {"scale.davenet_layout": "1d", "scale.compile": True}}


def variants(quick: bool, chunk: int) -> dict[str, dict]:
    """The workloads' settings, by name."""
    if quick:
        share = {**QUICK, "data.batch_size": 4, "data.clips_per_video": 4}
        return {"plain": share, "cached": {**share, "data.batch_size": 8, "scale.grad_cache_clips": 8},
                "ring": {**share, "scale.ring_contrastive": True}}
    return {"plain": PAPER_SHARE, "cached": {**PAPER_STEP, "scale.grad_cache_clips": chunk},
            "ring": {**PAPER_SHARE, "scale.ring_contrastive": True}}


def todays_estimate_over_peak(recorded: dict, chunk: int = 512) -> dict[str, float]:
    """Today's estimate (``footprint.allocator_total``, computed on this machine: no GPU needed) of
    each workload a run of this benchmark recorded, over the peak that run measured on its GPU
    (``--chunk`` at its default, as the recorded run's command had it)."""
    out = {}
    for name, row in recorded["variants"].items():
        cfg = rig_config(Config().replace(variants(recorded["quick"], chunk)[name]), cuda=True)
        out[name] = allocator_total(estimate_worker_memory(cfg)) / row["peak_bytes"]
    return out


def matmul_peak(device: torch.device, size: int, repeats: int = 10, blocks: int = 3) -> dict:
    """The device's measured matrix-product throughput: the fastest of ``blocks`` blocks of
    ``repeats`` products of two ``size`` x ``size`` matrices (bf16 on CUDA, fp32 on CPU), after one
    untimed; 2·size³ FLOPs a product. The fastest block: a peak is what the device can do."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    best = math.inf
    for _ in range(blocks):
        started = time.perf_counter()
        for _ in range(repeats):
            a @ b
        sync()
        best = min(best, time.perf_counter() - started)
    return {"dtype": str(dtype).removeprefix("torch."), "size": size, "flops_per_s": 2 * size**3 * repeats / best}


def compare(workload: dict, device: torch.device, warmup: int, steps: int, rounds: int, peak_flops: float,
            say=print, levers: list[str] | None = None, profile_top: int = 0, budget_s: float | None = None,
            on_built=lambda built: None) -> tuple[dict, dict]:
    """The ``levers`` (default: every one of :data:`LEVERS`; eager always, the reference) of one
    workload, built at once and timed in turns (module doc); with ``profile_top``, eager's and the
    fastest other variant's rows carry their ``kernel_profile``.

    ``budget_s`` bounds the building, where the time goes: a variant is not built when the seconds
    spent since the comparison began plus the longest build so far of its kind (compiled or not)
    would pass it; the first compiled variant is built while any time is left. ``on_built(built)``
    is called after each build with what every variant built so far took (``warmup_s``: its build
    and warm-up steps; ``compile_s``: Dynamo's compile seconds), for a partial file that survives a
    kill. Returns (rows by variant, reasons by variant not built).
    """
    chosen = ["eager", *(name for name in (levers or LEVERS) if name != "eager")]
    rigs: dict[str, StepRig] = {}
    built: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    began = time.perf_counter()
    for name in chosen:
        if budget_s is not None and name != "eager":
            spent = time.perf_counter() - began
            expected = max((b["warmup_s"] for other, b in built.items() if _compiles(other) == _compiles(name)),
                           default=0.0)
            if spent + expected > budget_s:
                skipped[name] = (f"not built: {spent:.0f} s spent"
                                 + (f" and a build of its kind takes {expected:.0f} s" if expected else "")
                                 + f", past --budget {budget_s:g} s")
                say(f"  {name}: {skipped[name]}")
                continue
        started = time.perf_counter()
        rig = StepRig(Config().replace({**workload, **LEVERS[name]}), device,
                      max_steps=warmup + (rounds + 1) * steps + 1)  # + 1 block: the profile's
        rig.steps(warmup)  # ends with the loop's host sync: the device's work is in the wall time
        compile_s = rig.run.compile_clock.total()["time_compile_s"] if rig.run.compile_clock else 0.0
        built[name] = {"warmup_s": time.perf_counter() - started, "compile_s": compile_s}
        rigs[name] = rig
        on_built(built)
        say(f"  {name}: built and warmed up in {built[name]['warmup_s']:.1f} s"
            + (f" (compiling {compile_s:.1f} s of it)" if compile_s else ""))
    flops = rigs["eager"].step_flops()
    walls: dict[str, list[float]] = {name: [] for name in rigs}
    peaks: dict[str, int | None] = {name: None for name in rigs}
    metrics: dict[str, dict] = {}
    for _ in range(rounds):
        for name, rig in rigs.items():
            metrics[name], wall, peak = rig.steps(steps)
            walls[name].append(wall)
            peaks[name] = peak if peaks[name] is None or peak is None else max(peaks[name], peak)
    eager_s = _median(walls["eager"])
    estimate = allocator_total(estimate_worker_memory(rigs["eager"].cfg))
    out = {}
    for name, rig in rigs.items():
        wall = _median(walls[name])
        saved = eager_s - wall
        compile_s, warmup_s = built[name]["compile_s"], built[name]["warmup_s"]
        # what compiling cost the run: Dynamo's count, or the warm-up's excess over eager's where that
        # is larger (kernels compiled or autotuned on their first call fall outside Dynamo's count)
        cost = max(compile_s, warmup_s - built["eager"]["warmup_s"])
        out[name] = {**step_figures(rig, metrics[name], wall, peaks[name]),
                     "s_per_step_rounds": walls[name], "flops_per_step": flops,
                     "mfu": flops / wall / peak_flops, "vs_eager": eager_s / wall, "compile_s": compile_s,
                     "warmup_s": warmup_s, "estimate_bytes": estimate,
                     "steps_to_repay_compile": (cost / saved if saved > 0 else None) if compile_s else None}
    if profile_top:
        others = [name for name in out if name != "eager"]
        for name in ["eager", *([min(others, key=lambda n: out[n]["s_per_step_wall"])] if others else [])]:
            try:
                out[name]["kernel_profile"] = kernel_profile(rigs[name], steps, profile_top)
            except Exception as e:  # the timings above stand without it: keep them, and the profile's reason
                out[name]["kernel_profile_error"] = f"{type(e).__name__}: {e}"
                say(f"  {name}: no kernel profile ({out[name]['kernel_profile_error']})")
    return out, skipped


def kernel_profile(rig: StepRig, steps: int, top: int) -> list[dict]:
    """Where ``rig``'s step spends its time: ``torch.profiler`` over one block of ``steps`` steps,
    the ``top`` CUDA kernels by their device time (on a CPU: operators by self CPU time), each with
    its milliseconds and calls per step and its share of the block's total, largest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if rig.cuda else [])]
    with profile(activities=activities) as prof:
        rig.steps(steps)

    def self_us(e) -> float:
        return e.self_device_time_total if rig.cuda else e.self_cpu_time_total

    # on CUDA the kernels themselves: a CPU operator's self device time counts its kernels again
    events = [e for e in prof.key_averages() if self_us(e) > 0 and (not rig.cuda or e.device_type == DeviceType.CUDA)]
    total = sum(self_us(e) for e in events)
    ranked = sorted(events, key=self_us, reverse=True)[:top]
    return [{"op": e.key, "self_ms_per_step": self_us(e) / 1e3 / steps, "calls_per_step": e.count / steps,
             "share": self_us(e) / total} for e in ranked]


def _compiles(lever: str) -> bool:
    """Whether the :data:`LEVERS` variant ``lever`` compiles the model."""
    return bool(LEVERS[lever].get("scale.compile"))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def build_parser():
    ap = harness.parser(__doc__, smoke="--quick dims, 1 warm-up step and 2 timed ones (with --compare: 2 rounds)")
    ap.add_argument("--device", default="cuda", help="cuda (default: cuda:0) or cpu (the script's own check)")
    ap.add_argument("--quick", action="store_true", help="tiny dims: checks the path, measures nothing useful")
    ap.add_argument("--variants", nargs="+", choices=["plain", "cached", "ring"], default=None,
                    help="workloads (default: all three; with --compare, plain)")
    ap.add_argument("--compare", action="store_true", help="eager, compiled and each DAVEnet layout, side by side")
    ap.add_argument("--levers", nargs="+", choices=list(LEVERS), default=None,
                    help="--compare: these variants only, beside eager (each holds its own model and Adam state)")
    ap.add_argument("--chunk", type=int, default=512, help="gradient-caching chunk of the cached variant (clips)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (with --compare: per variant and round)")
    ap.add_argument("--rounds", type=int, default=3, help="--compare: rounds of turns over the variants")
    ap.add_argument("--peak-size", type=int, default=8192, help="side of the square products of the peak")
    ap.add_argument("--budget", type=float, default=None,
                    help="--compare: seconds a workload's variants may take to build (compiling); a variant "
                         "that would end past it is left out, and said so (default: none)")
    ap.add_argument("--profile-top", type=int, default=15,
                    help="--compare: the operators shown from eager's and the fastest variant's profile (0: none)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.json = True  # the JSON line is always the output's last
    if args.smoke:
        args.quick, args.warmup, args.steps, args.rounds = True, 1, 2, 2
        args.peak_size = min(args.peak_size, 1024)  # large enough that the products, not their calls, are timed
    workloads = args.variants or (["plain"] if args.compare else ["plain", "cached", "ring"])
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device visible; `python -m bench.gpu_smoke --device cpu --smoke` checks the script")
            return 2
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = matmul_peak(device, args.peak_size)
    report = {"device": name, "torch": torch.__version__, "quick": args.quick, "matmul_peak": peak,
              "variants": {}, **({"compare": {}, "warm_up": {}, "skipped": {}} if args.compare else {})}
    print(f"device: {name}" + (" (a CPU: an fp32 peak, and figures that only check the path)"
                               if device.type == "cpu" else "")
          + f"; measured {peak['dtype']} matrix-product peak {peak['flops_per_s'] / 1e12:.3g} TFLOP/s")
    with one_rank_group(device), harness.Results("gpu_smoke", args) as results:
        for workload in workloads:
            settings = variants(args.quick, args.chunk)[workload]
            if args.compare:
                print(f"{workload}: {', '.join(args.levers or LEVERS)}")

                def keep(built, workload=workload):  # every build's figures, in the partial file at once
                    report["warm_up"][workload] = built
                    results.save(**report)

                rows, skipped = compare(settings, device, args.warmup, args.steps, args.rounds, peak["flops_per_s"],
                                        levers=args.levers, profile_top=args.profile_top, budget_s=args.budget,
                                        on_built=keep)
                report["compare"][workload] = rows
                report["skipped"][workload] = skipped
                results.save(**report)
                print(_compare_table(workload, rows))
                for name, reason in skipped.items():
                    print(f"{workload}, {name}: {reason}")
                for name, row in rows.items():
                    if "kernel_profile" in row:
                        print(_profile_table(workload, name, row["kernel_profile"], device.type))
                continue
            res = measure_step(Config().replace(settings), device, args.warmup, args.steps)
            report["variants"][workload] = res
            results.save(**report)
            peak_text = f"{res['peak_bytes'] / GIB:.2f} GiB" if res["peak_bytes"] else "n/a on CPU"
            ratio = f"{res['estimate_over_peak']:.2f}" if res["estimate_over_peak"] else "-"
            phases = " ".join(f"{k} {1000 * v:.1f}" for k, v in res["phases_s"].items())
            finite = all(math.isfinite(v) for v in res["losses"].values())
            print(f"{workload:>6}: {res['clips']} clips, {res['s_per_step_wall']:.3f} s/step, "
                  f"{res['samples_per_s']:.0f} samples/s; peak {peak_text}, estimate "
                  f"{res['estimate_bytes'] / GIB:.2f} GiB (est/peak {ratio}); ms: {phases}; "
                  f"losses {'finite' if finite else 'NOT FINITE'}")
        results.finish(report)
    return 0


def _compare_table(workload: str, rows: dict[str, dict]) -> str:
    lines = [f"| {workload} | clips/s | s/step | MFU | peak | est/peak | vs eager | warm-up s | compile s | repaid after |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        peak = f"{r['peak_bytes'] / GIB:.2f} GiB" if r["peak_bytes"] else "n/a (CPU)"
        ratio = f"{r['estimate_over_peak']:.2f}" if r["estimate_over_peak"] else "-"
        repay = ("-" if not r["compile_s"] else "never (slower)" if r["steps_to_repay_compile"] is None
                 else f"{r['steps_to_repay_compile']:.0f} steps")
        lines.append(f"| {name} | {r['clips'] / r['s_per_step_wall']:.0f} | {r['s_per_step_wall']:.4f} | "
                     f"{100 * r['mfu']:.1f} % | {peak} | {ratio} | {r['vs_eager']:.2f}x | {r['warmup_s']:.1f} | "
                     f"{r['compile_s']:.1f} | {repay} |")
    return "\n".join(lines)


def _profile_table(workload: str, variant: str, ops: list[dict], device_type: str) -> str:
    where = "device" if device_type == "cuda" else "CPU"
    lines = [f"{workload}, {variant}: where a step's {where} time goes (top {len(ops)})",
             "| operator | ms/step | share | calls/step |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {op['op'][:60]} | {op['self_ms_per_step']:.3f} | {100 * op['share']:.1f} % | "
              f"{op['calls_per_step']:.0f} |" for op in ops]
    return "\n".join(lines)


if __name__ == "__main__":
    end_rank(main())  # it ran a (one-rank) group: its gloo threads must not meet the interpreter's exit
