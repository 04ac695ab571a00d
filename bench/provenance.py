"""What keeping the provenance record adds to a run's start (``train/run_record.py``): the driver's entry
(the code with git, every installed package, the host, the data's digests) added to the run's record,
each part timed, and one rank's node part; then the data's digests at the lab's sizes.

    python -m bench.provenance                        # this checkout, the embedded default's inputs
    python -m bench.provenance --manifest-mb 300      # a larger manifest

The lab's manifest is digested whole: the synthetic corpus's holds about 126 bytes a video (each
shard's name, size and SHA-256, each video's byte spans), so HowTo100M's 1.2 M videos make about
150 MB (``--manifest-mb``). The word vectors (GoogleNews, 3.6 GB) are digested by their two ends: a
sparse file of that size stands for them. Both files are read from the page cache just after they
are written: a first read from NFS adds its transfer. Each part is timed ``--repeat`` times and
the median reported; the code's part depends on the checkout's state (a dirty tree diffs its files).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import harness

SMOKE = {"repeat": 1, "manifest_mb": 1.0, "word_vectors_gb": 0.1, "videos": 64}  # the tests' tiny corpus


def timed(fn, repeat: int) -> tuple[float, object]:
    """(the median seconds of ``repeat`` calls of ``fn``, its last result)."""
    seconds, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out


def driver_parts(repeat: int, folder: Path, videos: int | None) -> dict[str, float]:
    """Each part of the driver's entry on the embedded default's inputs (``videos``: its corpus's
    training videos and eval clips instead), and the whole with its append."""
    import torch

    from raymcn.cli import preset_path
    from raymcn.config import load_config
    from raymcn.provenance import collect, record
    from raymcn.train import run_record
    from raymcn.train.inputs import resolve_inputs

    cfg = load_config(preset_path(), [f"data.synthetic_videos={videos}", f"data.synthetic_eval_clips={videos}"]
                      if videos else [])
    inputs = resolve_inputs(cfg)  # the corpus generated once, before any timing
    parts = {"code_s": timed(collect.code_identity, repeat)[0],
             "environment_s": timed(collect.environment, repeat)[0],
             "host_s": timed(collect.host, repeat)[0],
             "data_s": timed(lambda: run_record.data_identity(cfg, inputs), repeat)[0]}
    runs = iter(range(repeat))
    parts["entry_and_append_s"] = timed(lambda: record.append(str(folder / f"run-{next(runs)}"),
                                                              run_record.driver_entry(cfg, inputs)), repeat)[0]
    parts["node_part_s"] = timed(lambda: run_record.node_part(0, torch.device("cpu")), repeat)[0]
    return parts


def data_digests(repeat: int, folder: Path, manifest_mb: float, word_vectors_gb: float) -> dict[str, float]:
    """The digest of a manifest of ``manifest_mb`` (whole) and of word vectors of ``word_vectors_gb`` (ends)."""
    import os

    from raymcn.provenance import collect

    manifest, words = folder / "manifest.json", folder / "word2vec.bin"
    with manifest.open("wb") as f:
        for _ in range(int(manifest_mb)):
            f.write(os.urandom(1 << 20))
        f.write(os.urandom(int((manifest_mb % 1) * (1 << 20))))
    with words.open("wb") as f:
        f.truncate(int(word_vectors_gb * 1e9))  # sparse: only its two ends are read
    return {"manifest_mb": manifest.stat().st_size / 1e6, "manifest_digest_s": timed(
                lambda: collect.file_identity(manifest, whole=True), repeat)[0],
            "word_vectors_gb": words.stat().st_size / 1e9, "word_vectors_digest_s": timed(
                lambda: collect.file_identity(words), repeat)[0]}


def build_parser():
    ap = harness.parser(__doc__, smoke="each part once on a 64-video corpus, a 1 MB manifest, 0.1 GB of word vectors")
    ap.add_argument("--repeat", type=int, default=5, help="times each part is timed (the median reported)")
    ap.add_argument("--manifest-mb", type=float, default=150.0, help="the manifest's size, MB (default: HowTo100M's)")
    ap.add_argument("--word-vectors-gb", type=float, default=3.6, help="the word vectors' size, GB (GoogleNews)")
    ap.add_argument("--videos", type=int, default=None, help="the synthetic corpus's videos and eval clips "
                    "(default: the embedded default's)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_args(build_parser(), argv, SMOKE)
    with harness.Results("provenance", args) as results, tempfile.TemporaryDirectory() as tmp:
        driver = driver_parts(args.repeat, Path(tmp), args.videos)
        results.save(driver=driver)
        data = data_digests(args.repeat, Path(tmp), args.manifest_mb, args.word_vectors_gb)
        start = driver["entry_and_append_s"] + data["manifest_digest_s"] + data["word_vectors_digest_s"]
        figures = {"repeat": args.repeat, "driver": driver, "data": data, "lab_run_start_s": start}
        print(f"| part | seconds (median of {args.repeat}) |\n|---|---:|")
        for name, seconds in {**driver, "manifest_digest_s": data["manifest_digest_s"],
                              "word_vectors_digest_s": data["word_vectors_digest_s"]}.items():
            print(f"| {name.removesuffix('_s')} | {seconds:.4f} |")
        print(f"the driver's entry with a {data['manifest_mb']:.0f} MB manifest and {data['word_vectors_gb']:.1f} GB "
              f"of word vectors: {start:.3f} s added to a run's start")
        results.finish(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
