"""The lab's whole corpus, rehearsed at its counts: what each process of a conversion and a run holds.

HowTo100M's caption pickle covers ~136 M ASR segments of ~1.17 M videos (~117 per video, 5-11
words each), whatever the lab converts. This bench builds such a pickle at ``--fractions`` of that
count (default 1/40 and 1/20) around a small corpus of tiny features (the point is the counts),
then measures, at each scale:

* the driver: unpickling the table (time, peak memory; the per-byte factor the conversion uses to
  refuse a machine that cannot hold it), the vocabulary pass over every caption (as when every
  video is listed), the caption store's build (time, bytes);
* ``raymcn shards`` with local worker processes and with ``--ray``: wall time, the driver's peak
  PSS, every writer's peak PSS (sampled every 0.1 s from /proc; PSS splits pages shared between
  processes, such as the memory-mapped store, among them);
* the training side at HowTo100M's 1.17 M listed videos (a manifest of that many spans, no tars):
  the manifest's size and load time, the inputs (the video index), the plan and the first step's
  reads, and that process's peak memory.

It prints each figure at both scales, the slope per million captions, the extrapolation to
HowTo100M's count, and one line on what it means for the lab's two 32-64-thread servers; ``--out``
writes the figures (docs/measurements/scale.json). About 6 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench import harness
from bench.procstat import processes
from raymcn.data import synthetic
from raymcn.data.formats.words import read_word2vec_bin

HOWTO100M_CAPTIONS = 136_000_000
HOWTO100M_VIDEOS = 1_170_000
CAPTIONS_PER_VIDEO = 117
WORDS = (5, 11)
GB, MB = 1e9, 1e6
# The smoke size: 1/4000 and 1/2000 of the captions around 60 converted videos (3 shards), a manifest
# of 20 000 videos on the training side (the --ray conversion starts its own Ray instance: the test
# suite runs the smoke size with --no-ray)
SMOKE = {"fractions": [4000, 2000], "convert_videos": 60, "train_videos": 20_000}


# --- the corpus ----------------------------------------------------------------------------------------
def caption_table(own: dict, words: list[str], captions: int, seed: int = 0) -> dict:
    """The corpus's own captions plus other videos' with HowTo100M's statistics, ``captions`` in all."""
    rng = np.random.default_rng(seed)
    table = dict(own)
    left, i = captions - sum(len(r["text"]) for r in own.values()), 0
    vocab = np.asarray(words, dtype=object)
    while left > 0:
        n = min(left, max(1, int(rng.poisson(CAPTIONS_PER_VIDEO))))
        lengths = rng.integers(WORDS[0], WORDS[1] + 1, n)
        picked = vocab[rng.integers(0, len(vocab), int(lengths.sum()))]
        ends = np.cumsum(lengths)
        starts = np.sort(rng.uniform(0, 600, n))
        table[f"howto{i:08d}"] = {"start": starts, "end": starts + rng.uniform(2, 8, n),
                                  "text": [" ".join(picked[e - k:e]) for e, k in zip(ends, lengths)]}
        left -= n
        i += 1
    return table


def build_corpus(root: Path, fraction: int, convert_videos: int) -> tuple[synthetic.CorpusPaths, int]:
    corpus = synthetic.write_corpus(root, synthetic.SynthSettings(videos=convert_videos, eval_clips=8, topics=4,
                                                                  word_dim=8, video_seconds=(6.0, 8.0)))
    with open(corpus.captions, "rb") as f:
        own = pickle.load(f)
    words = read_word2vec_bin(corpus.word_vectors).words
    table = caption_table(own, words, HOWTO100M_CAPTIONS // fraction)
    with open(corpus.captions, "wb") as f:
        pickle.dump(table, f, protocol=pickle.HIGHEST_PROTOCOL)
    return corpus, sum(len(r["text"]) for r in table.values())


# --- per-process memory ----------------------------------------------------------------------------------
def pss(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    m = re.search(r"^Pss:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else 0


class PeakMemory:
    """Samples the PSS of a process, its descendants and every Ray shard-writer actor until stopped."""

    def __init__(self, root: int, every_s: float = 0.1):
        self.root, self.every_s, self.peak = root, every_s, {}
        self.kind: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            procs = processes()
            tree, grew = {self.root}, True
            while grew:
                new = {p for p, (pp, _) in procs.items() if pp in tree} - tree
                grew, tree = bool(new), tree | new
            for pid in tree | {p for p, (_, cmd) in procs.items() if "ShardWriter" in cmd}:
                cmd = procs.get(pid, (0, ""))[1]
                if "ShardWriter" in cmd:  # a Ray worker process becomes a writer when its actor starts
                    self.kind[pid] = "ray writer"
                # local writers are the driver's grandchildren: forked by multiprocessing's server
                self.kind.setdefault(pid, "driver" if pid == self.root else
                                     "local writer" if pid in tree and procs.get(pid, (self.root,))[0] != self.root
                                     else "other")
                self.peak[pid] = max(self.peak.get(pid, 0), pss(pid))
            self._stop.wait(self.every_s)

    def of(self, kind: str) -> list[int]:
        return [v for p, v in self.peak.items() if self.kind.get(p) == kind and v > 0]


# --- the measurements ---------------------------------------------------------------------------------------
def driver_figures(corpus: synthetic.CorpusPaths) -> dict:
    """Unpickling, the vocabulary pass over every caption and the store's build, in a child process
    (its peak memory is the table's)."""
    code = f"""
import json, resource, time, sys
from pathlib import Path
from bench.procstat import status_bytes
from raymcn.data.formats.features import load_captions
from raymcn.data.formats.words import tokenize
from raymcn.data.write import captions
before = status_bytes("VmRSS")
t = time.perf_counter(); table = load_captions({str(corpus.captions)!r}); unpickle = time.perf_counter() - t
peak = status_bytes("VmHWM") - before  # the table's own memory: the interpreter and imports left out
t = time.perf_counter(); seen = {{}}
for rec in table.values():
    for text in rec["text"]:
        for tok in tokenize(text):
            seen.setdefault(tok)
vocab = time.perf_counter() - t
out = Path({str(corpus.root / "store-probe")!r})
t = time.perf_counter(); captions.build_store(out, Path({str(corpus.captions)!r}), table, list(table), "probe")
store = time.perf_counter() - t
size = sum(p.stat().st_size for p in (out / captions.STORE_DIR).iterdir())
print(json.dumps({{"unpickle_s": unpickle, "unpickle_peak": peak, "vocab_pass_s": vocab, "store_build_s": store,
                  "store_bytes": size}}))
"""
    # from the checkout's root: its raymcn and bench, installed or not
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=harness.REPO).stdout
    return json.loads(out.strip().splitlines()[-1])


def convert(corpus: synthetic.CorpusPaths, out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "raymcn.cli", "shards", "--features", str(corpus.features_root),
           "--audio-features", str(corpus.audio_root), "--captions", str(corpus.captions), "--video-list",
           str(corpus.video_csv), "--word-vectors", str(corpus.word_vectors), "--out", str(out),
           "--videos-per-shard", "20", "--no-progress", *extra]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, RAY_ADDRESS="local"), cwd=harness.REPO)
    with PeakMemory(proc.pid) as memory:
        log, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{log[-3000:]}")
    writers = memory.of("ray writer") if "--ray" in extra else memory.of("local writer")
    return {"seconds": time.perf_counter() - started, "driver_pss": max(memory.of("driver") or [0]),
            "writers": len(writers), "writer_pss_max": max(writers or [0]),
            "writer_pss_mean": float(np.mean(writers)) if writers else 0.0}


def training_side(where: Path, videos: int = HOWTO100M_VIDEOS, per_shard: int = 40, batch: int = 128,
                  world: int = 8) -> dict:
    """A manifest of ``videos`` spans (no tars), then in a child process: its load, the inputs
    (the video index), the plan and the first step's reads on rank 0, and that process's peak memory."""
    where.mkdir(parents=True, exist_ok=True)
    from raymcn.data.formats.manifest import FORMAT, FORMAT_VERSION, MANIFEST
    shards = []
    for s in range(0, videos, per_shard):
        ids = [f"v{i:08d}" for i in range(s, min(s + per_shard, videos))]
        shards.append({"name": f"shard-{s // per_shard:06d}.tar", "videos": ids,
                       "spans": [[j * 6_000_000, (j + 1) * 6_000_000] for j in range(len(ids))],
                       "feature_dtype": "float16", "bytes": len(ids) * 6_000_000, "sha256": "0" * 64})
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "plan": "scale", "settings": {},
                "counts": {"listed": videos, "videos": videos, "skipped": 0, "shards": len(shards), "bytes": 0,
                           "vocab_words": 0, "word_dim": 300}, "shards": shards, "skipped": []}
    (where / MANIFEST).write_text(json.dumps(manifest, indent=1))
    del manifest, shards
    code = f"""
import json, resource, time, sys
from raymcn.config import Config
from raymcn.data.formats.manifest import load_manifest
from raymcn.data.read.order import rank_steps
from raymcn.data.read.stream import step_jobs
from raymcn.train.inputs import resolve_inputs
from raymcn.train.run_plan import plan_of
cfg = Config().replace({{"data.shards": {str(where)!r}, "data.batch_size": {batch}, "scale.num_workers": {world},
                        "data.eval_set": "youcook:/nonexistent.pkl"}})
t = time.perf_counter(); load_manifest({str(where)!r}); load = time.perf_counter() - t
t = time.perf_counter(); inputs = resolve_inputs(cfg); index = time.perf_counter() - t
t = time.perf_counter(); plan = plan_of(cfg, inputs); planned = time.perf_counter() - t
t = time.perf_counter()
first = rank_steps(cfg.run.seed, 0, len(inputs.index), {batch}, plan.steps_per_epoch, 0, {world})[:1]
jobs = step_jobs(inputs.index, first)
step = time.perf_counter() - t
print(json.dumps({{"manifest_load_s": load, "inputs_s": index, "plan_s": planned, "first_step_s": step,
                  "steps_per_epoch": plan.steps_per_epoch, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=harness.REPO).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    figures["manifest_bytes"] = (where / MANIFEST).stat().st_size
    figures["videos"] = videos
    return figures


# --- the report -------------------------------------------------------------------------------------------
FIGURES = [  # (key, label, unit divisor, unit, what it means for the lab's two servers)
    ("pickle_bytes", "caption pickle on disk", MB, "MB", "read once per conversion"),
    ("unpickle_s", "driver: unpickle the table", 1, "s", "once per conversion (and not on a rerun: the store is reused)"),
    ("unpickle_peak", "driver: the table's memory, unpickled", GB, "GB",
     "the machine running `raymcn shards` needs this much free, once; --dry-run says it and refuses if short"),
    ("vocab_pass_s", "vocabulary pass, every caption", 1, "s", "once per conversion, in the driver"),
    ("store_build_s", "caption store: build", 1, "s", "once per conversion, in the driver"),
    ("store_bytes", "caption store on disk", GB, "GB", "beside the shards until the conversion completes"),
    ("local.seconds", "--workers 2: wall time", 1, "s", "dominated by the features, not the captions"),
    ("local.driver_pss", "--workers 2: driver peak PSS", GB, "GB", "the table, once (above)"),
    ("local.writer_pss_max", "--workers 2: a writer's peak PSS", GB, "GB",
     "flat: 64 writers per server need 64x this, whatever the corpus"),
    ("ray.seconds", "--ray: wall time", 1, "s", "Ray's start and actor spawn included"),
    ("ray.writer_pss_max", "--ray: a writer's peak PSS", GB, "GB",
     "flat: one actor per CPU of both servers (128) needs 128x this, whatever the corpus"),
]


def value(figures: dict, key: str) -> float:
    for part in key.split("."):
        figures = figures[part]
    return float(figures)


def report(scales: list[dict], train: dict, figures: list[tuple] = FIGURES) -> str:
    xs = [s["captions"] / 1e6 for s in scales]
    lines = [f"{'figure':<38}" + "".join(f"{'1/' + str(s['fraction']):>10}" for s in scales)
             + f"{'slope/M cap':>13}{'HowTo100M':>11}  what it means for the lab"]
    lines.append(f"{'captions (M)':<38}" + "".join(f"{x:>10.2f}" for x in xs) + f"{'':>13}{HOWTO100M_CAPTIONS / 1e6:>11.0f}")
    for key, label, div, unit, meaning in figures:
        ys = [value(s, key) / div for s in scales]
        slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0]) if len(xs) > 1 and xs[-1] != xs[0] else 0.0
        full = ys[-1] + slope * (HOWTO100M_CAPTIONS / 1e6 - xs[-1])
        lines.append(f"{label + ' (' + unit + ')':<38}" + "".join(f"{y:>10.3g}" for y in ys)
                     + f"{slope:>13.3g}{full:>11.3g}  {meaning}")
    lines.append("")
    lines.append(f"training side at {train['videos']:,} listed videos: manifest {train['manifest_bytes'] / MB:.0f} MB "
                 f"loaded in {train['manifest_load_s']:.2f} s; inputs (video index) {train['inputs_s']:.2f} s; plan "
                 f"{train['plan_s'] * 1e3:.1f} ms; first step's reads {train['first_step_s']:.2f} s; peak "
                 f"{train['peak'] / GB:.2f} GB in one process ({train['steps_per_epoch']} steps per epoch): the "
                 "driver does this once per run or sweep, and each rank receives the index")
    return "\n".join(lines)


def build_parser():
    ap = harness.parser(__doc__, smoke="1/4000 and 1/2000 of the captions, 60 videos converted, a manifest of "
                                       "20 000 videos on the training side")
    ap.add_argument("--fractions", type=int, nargs="+", default=[40, 20], help="of HowTo100M's caption count")
    ap.add_argument("--convert-videos", type=int, default=200, help="videos listed and converted (tiny features)")
    ap.add_argument("--train-videos", type=int, default=HOWTO100M_VIDEOS,
                    help=f"videos of the training side's manifest (default HowTo100M's {HOWTO100M_VIDEOS:,})")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-ray", action="store_true", help="skip the --ray conversion")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_args(build_parser(), argv, SMOKE)
    scales = []
    with tempfile.TemporaryDirectory(prefix="raymcn-scale-") as tmp, harness.Results("scale", args) as results:
        for fraction in sorted(args.fractions, reverse=True):
            root = Path(tmp) / f"1-{fraction}"
            t = time.perf_counter()
            corpus, count = build_corpus(root, fraction, args.convert_videos)
            print(f"1/{fraction}: {count:,} captions generated in {time.perf_counter() - t:.0f} s", file=sys.stderr)
            figures = {"fraction": fraction, "captions": count, "pickle_bytes": corpus.captions.stat().st_size,
                       **driver_figures(corpus)}
            figures["local"] = convert(corpus, root / "local", ["--workers", str(args.workers)])
            if not args.no_ray:
                figures["ray"] = convert(corpus, root / "ray", ["--ray", "--workers", str(args.workers)])
            figures["bytes_per_pickle_byte"] = figures["unpickle_peak"] / figures["pickle_bytes"]
            scales.append(figures)
            results.save(scales=scales)
            print(json.dumps(figures), file=sys.stderr)
        train = training_side(Path(tmp) / "howto100m-manifest", videos=args.train_videos)
        figures_shown = [f for f in FIGURES if not (args.no_ray and f[0].startswith("ray."))]
        print(f"bench.scale on {results.machine}; {args.convert_videos} videos converted at each scale, "
              f"{args.workers} writers\n")
        print(report(scales, train, figures_shown))
        print("\ndriver memory per byte of pickle: " + ", ".join(f"1/{s['fraction']}: {s['bytes_per_pickle_byte']:.2f}"
                                                                for s in scales))
        results.finish({"machine": results.machine, "scales": scales, "training": train})
    return 0


if __name__ == "__main__":
    sys.exit(main())
