"""What fp16 shards change for learning: the same runs on fp32 and fp16 shards of full-precision features.

    python -m bench.shard_dtype                  # 4 seeds x 2 dtypes, the embedded default (~6 min, 2 cores)
    python -m bench.shard_dtype --seeds 1 2      # fewer seeds
    python -m bench.shard_dtype --json           # the tables, then one JSON line with every figure
    python -m bench.shard_dtype --plot FILE.png  # the loss and R@10 curves per dtype

What runs: a synthetic corpus like the embedded default's (256 videos, 8 topics) but with
full-precision fp32 features (``SynthSettings(full_precision=True)``; the default corpus holds
fp16-representable values, which an fp16 shard would store exactly), written twice by the real
writer: ``--dtype float32`` and ``--dtype float16``. Then, for every seed (``run.seed``: model
initialisation, data order, clips, k-means), the embedded default's run (``raymcn.train.on_ray.launch.fit``:
2 Ray Train workers, 4 epochs, Ray Data reading the shards, evaluation on the synthetic held-out
split every epoch) once per dtype. Same seed, same everything but the features' rounding, so the
comparison is paired: per metric the mean over seeds per dtype with its 95 % t-interval, and the
mean paired difference (fp16 - fp32) with its interval. Metrics: the last epoch's R@1/5/10 and
MedR, and the training loss per epoch (the curves).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.harness import read_jsonl

DTYPES = ("float32", "float16")
METRICS = ("text_to_video_R@1", "text_to_video_R@5", "text_to_video_R@10", "text_to_video_MedR")
# The smoke size: one seed, 1 epoch, one worker, a full-precision corpus of 64 videos (the test
# suite's size; its eval set is the suite's corpus)
SMOKE = {"seeds": [1], "epochs": 1, "videos": 64}
SMOKE_SETTINGS = ["data.synthetic_videos=64", "data.synthetic_eval_clips=64", "scale.num_workers=1"]


def shard_dirs(cache: Path, videos: int = 256) -> dict[str, Path]:
    """The full-precision corpus of ``videos`` videos and its shards in both dtypes (generated once
    into ``cache``)."""
    from raymcn.data.synthetic import SYNTHETIC_SHARDS, CorpusPaths, SynthSettings, ensure_settings
    from raymcn.data.write import shards

    settings = SynthSettings(videos=videos, full_precision=True)
    corpus = CorpusPaths(ensure_settings(cache, settings))
    out = {}
    for dtype in DTYPES:
        where = cache / f"fullprec-shards-{settings.digest()}-{dtype}"
        shards.shards_from_layout(corpus.features_root, corpus.audio_root, corpus.captions, corpus.video_csv,
                                  corpus.word_vectors, where, videos_per_shard=settings.videos // SYNTHETIC_SHARDS,
                                  feature_dtype=dtype, workers=1, progress=False, log=lambda m: None)
        out[dtype] = where
    return out


def recorder(path: Path):
    from ray.train.v2.api.callback import UserCallback

    class Record(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            m = metrics[0]
            if "total_loss" in m:  # epoch ends (mid-epoch checkpoints report no loss)
                with open(path, "a") as f:
                    f.write(json.dumps({k: m[k] for k in ("epoch", "total_loss", *METRICS)}) + "\n")

    return Record()


def interval(values) -> tuple[float, float, float]:
    from raymcn.results.stats import t_interval

    v = np.asarray(values, float)
    lo, hi = t_interval(v) if len(v) > 1 else (float("nan"), float("nan"))
    return float(v.mean()), lo, hi


def build_parser():
    ap = harness.parser(__doc__, smoke="one seed, 1 epoch, one worker, a corpus of 64 videos")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--plot", default="", help="write the curves to this PNG")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.videos, extra = 256, []
    if args.smoke:
        args.seeds, args.epochs, args.videos = SMOKE["seeds"], SMOKE["epochs"], SMOKE["videos"]
        extra = SMOKE_SETTINGS

    import ray

    from raymcn.config import default_cache_dir, load_config, preset_path
    from raymcn.train.on_ray import launch

    base = load_config(preset_path(), [f"schedule.epochs={args.epochs}"])
    dirs = shard_dirs(Path(default_cache_dir(base)), args.videos)
    sizes = {d: json.loads((p / "manifest.json").read_text())["counts"]["bytes"] for d, p in dirs.items()}
    print(f"shards of the full-precision corpus: float32 {sizes['float32'] / 2**20:.1f} MiB, "
          f"float16 {sizes['float16'] / 2**20:.1f} MiB ({sizes['float16'] / sizes['float32']:.2f}x)", flush=True)
    runs: dict[str, dict[int, list[dict]]] = {d: {} for d in DTYPES}
    started = time.time()
    own = not ray.is_initialized()  # else this process's instance (the smoke run's)
    if own:
        ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    results = harness.Results("shard_dtype", args)
    try:
        with tempfile.TemporaryDirectory(prefix="raymcn-dtype-") as tmp, results:
            for seed in args.seeds:
                for dtype in DTYPES:
                    cfg = load_config(preset_path(), [f"schedule.epochs={args.epochs}", f"run.seed={seed}",
                                                      f"data.shards={dirs[dtype]}", *extra])
                    log = Path(tmp) / f"{dtype}-{seed}.jsonl"
                    launch.fit(cfg, Path(tmp) / f"{dtype}-{seed}", callbacks=[recorder(log)])
                    runs[dtype][seed] = read_jsonl(log)
                    results.save(runs={d: {str(s): r for s, r in v.items()} for d, v in runs.items()})
                    last = runs[dtype][seed][-1]
                    print(f"seed {seed} {dtype}: loss {last['total_loss']:.4f}, R@1/5/10 "
                          f"{last['text_to_video_R@1']:.1f}/{last['text_to_video_R@5']:.1f}/"
                          f"{last['text_to_video_R@10']:.1f}, MedR {last['text_to_video_MedR']:.0f}", flush=True)
    finally:
        if own:
            ray.shutdown()

    rows = {}
    print(f"\n{len(args.seeds)} seeds, last epoch ({args.epochs}); mean [95 % interval]")
    print("| metric | float32 | float16 | fp16 - fp32 (paired) |\n|---|---|---|---|")
    for metric in (*METRICS, "total_loss"):
        per = {d: [runs[d][s][-1][metric] for s in args.seeds] for d in DTYPES}
        diff = [b - a for a, b in zip(per["float32"], per["float16"])]
        rows[metric] = {d: interval(per[d]) for d in DTYPES} | {"difference": interval(diff)}
        cells = [f"{m:.3f} [{lo:.3f}, {hi:.3f}]" for m, lo, hi in (rows[metric][d] for d in (*DTYPES, "difference"))]
        print(f"| {metric} | " + " | ".join(cells) + " |")
    curves = {d: [[r["total_loss"] for r in runs[d][s]] for s in args.seeds] for d in DTYPES}
    gap = max(abs(a - b) / abs(a) for s in range(len(args.seeds))
              for a, b in zip(curves["float32"][s], curves["float16"][s]))
    print(f"training loss per epoch: largest relative difference between the dtypes (same seed, any epoch): {gap:.2e}")
    print(f"bench time {time.time() - started:.0f} s")
    if args.plot:
        plot(curves, runs, args, Path(args.plot))
    results.finish({"seeds": args.seeds, "epochs": args.epochs, "bytes": sizes, "summary": rows,
                    "loss_curves": curves, "largest_loss_gap": gap,
                    "runs": {d: {str(s): r for s, r in v.items()} for d, v in runs.items()}})
    return 0


def plot(curves: dict, runs: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    colours = {"float32": "tab:blue", "float16": "tab:orange"}
    epochs = np.arange(1, args.epochs + 1)
    for dtype in DTYPES:
        for i, seed in enumerate(args.seeds):
            label = f"{dtype} shards" if i == 0 else None
            style = "-" if dtype == "float32" else "--"
            axes[0].plot(epochs, curves[dtype][i], style, color=colours[dtype], alpha=0.7, label=label)
            axes[1].plot(epochs, [r["text_to_video_R@10"] for r in runs[dtype][seed]], style, color=colours[dtype],
                         alpha=0.7, label=label)
    axes[0].set(xlabel="epoch", ylabel="training loss", title="loss per seed")
    axes[1].set(xlabel="epoch", ylabel="text-to-video R@10 (%)", title="held-out R@10 per seed")
    for ax in axes:
        ax.set_xticks(epochs)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"fp32 vs fp16 shards of full-precision features ({len(args.seeds)} seeds, paired)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
