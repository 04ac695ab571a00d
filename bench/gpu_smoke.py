"""GPU smoke: the real training step on one GPU, in one command, without Ray.

    python -m bench.gpu_smoke                         # paper dims on cuda:0 (~2-4 min on an A100/H100)
    python -m bench.gpu_smoke --out gpu_smoke.json    # also write the JSON to a file
    python -m bench.gpu_smoke --device cpu --smoke    # the script's own check on a machine without a GPU

The step is measured by ``raymcn.train.preflight.step_probe.measure_step``, the same function
``raymcn doctor --step`` runs on every node: one process, a 1-rank process group (NCCL on CUDA,
gloo on CPU), the model wrapped in DDP as a Ray Train worker wraps it, ``build.assemble`` and
``loop.train_one_epoch`` over prefetched batches, bf16 autocast, losses and k-means in fp32.
Three variants:

* ``plain``: one rank's share of the paper's step (32 videos x 32 clips = 1024 clips);
* ``cached``: the paper's whole step on this one GPU (128 videos x 32 clips = 4096 clips) with
  gradient caching in chunks of ``--chunk`` clips;
* ``ring``: the ``plain`` share with the ring contrastive loss (on 1 rank: one hop, no transfer).

The batches are random tensors of the batch contract at paper dims (2048 + 2048 video features,
40 x 1000 mel frames in fp16, 20 words x 300); no shards are read. Each variant runs
``--warmup`` steps (cuDNN autotuning, the first k-means fit; not timed) and then ``--steps`` timed
steps. Reported per variant: the peak of allocated device memory against the preflight's estimate
(``footprint.estimate_worker_memory``; the estimate must not be below it), seconds per step by
phase (CUDA events, no synchronisation inside the step), samples/s and the last step's loss terms.
The JSON line (last line of the output, and ``--out``) holds every figure.

Runs without Ray: nothing it imports needs it.
"""

from __future__ import annotations

import math

import torch

from bench import harness
from bench.rank_exit import end_rank
from raymcn.config import Config
from raymcn.train.preflight.footprint import GIB
from raymcn.train.preflight.step_probe import measure_step, one_rank_group

PAPER_SHARE = {"data.batch_size": 32, "data.clips_per_video": 32}  # one of 4 ranks' share of 128 videos
PAPER_STEP = {"data.batch_size": 128, "data.clips_per_video": 32}
QUICK = {"model.embed_dim": 64, "model.audio_channels": [8, 8, 16, 16, 32], "model.recon_hidden": 32,
         "data.audio_frames": 64, "loss.num_clusters": 8, "loss.kmeans_iters": 5, "loss.queue_steps": 2}


def variants(quick: bool, chunk: int) -> dict[str, dict]:
    if quick:
        share = {**QUICK, "data.batch_size": 4, "data.clips_per_video": 4}
        return {"plain": share, "cached": {**share, "data.batch_size": 8, "scale.grad_cache_clips": 8},
                "ring": {**share, "scale.ring_contrastive": True}}
    return {"plain": PAPER_SHARE, "cached": {**PAPER_STEP, "scale.grad_cache_clips": chunk},
            "ring": {**PAPER_SHARE, "scale.ring_contrastive": True}}


def run_variant(name: str, overrides: dict, device: torch.device, warmup: int, steps: int) -> dict:
    return measure_step(Config().replace(overrides), device, warmup, steps)


def build_parser():
    ap = harness.parser(__doc__, smoke="--quick dims, 1 warm-up step and 2 timed ones")
    ap.add_argument("--device", default="cuda", help="cuda (default: cuda:0) or cpu (the script's own check)")
    ap.add_argument("--quick", action="store_true", help="tiny dims: checks the path, measures nothing useful")
    ap.add_argument("--variants", nargs="+", default=["plain", "cached", "ring"])
    ap.add_argument("--chunk", type=int, default=512, help="gradient-caching chunk of the cached variant (clips)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.json = True  # the JSON line is always the output's last
    if args.smoke:
        args.quick, args.warmup, args.steps = True, 1, 2
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device visible; `python -m bench.gpu_smoke --device cpu --smoke` checks the script")
            return 2
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "quick": args.quick, "variants": {}}
    with one_rank_group(device), harness.Results("gpu_smoke", args) as results:
        for name in args.variants:
            res = run_variant(name, variants(args.quick, args.chunk)[name], device, args.warmup, args.steps)
            report["variants"][name] = res
            results.save(**report)
            peak = f"{res['peak_bytes'] / GIB:.2f} GiB" if res["peak_bytes"] else "n/a on CPU"
            ratio = f"{res['estimate_over_peak']:.2f}" if res["estimate_over_peak"] else "-"
            phases = " ".join(f"{k} {1000 * v:.1f}" for k, v in res["phases_s"].items())
            finite = all(math.isfinite(v) for v in res["losses"].values())
            print(f"{name:>6}: {res['clips']} clips, {res['s_per_step_wall']:.3f} s/step, "
                  f"{res['samples_per_s']:.0f} samples/s; peak {peak}, estimate "
                  f"{res['estimate_bytes'] / GIB:.2f} GiB (est/peak {ratio}); ms: {phases}; "
                  f"losses {'finite' if finite else 'NOT FINITE'}")
        results.finish(report)
    return 0


if __name__ == "__main__":
    end_rank(main())  # it ran a (one-rank) group: its gloo threads must not meet the interpreter's exit
