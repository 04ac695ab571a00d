"""Would lossless compression of the shards read faster? Ratio and decode speed of fast codecs on feature-like rows.

    python -m bench.compression                        # post-ReLU-like fp16 rows, zstd 1/3 and lz4 (~40 s)
    python -m bench.compression --disk-mb-s 750        # the disk's read rate (bench.loader's (d) row)
    python -m bench.compression --reader-ms 4.5        # the reader's own CPU per video (bench.loader's (c2))
    python -m bench.compression --shards DIR --videos 16  # your own shards' features instead (16 videos)
    python -m bench.compression --json

What runs: HowTo100M-like video features (600 rows of 2048) in fp16 as ``raymcn shards`` stores
them, plus the video's fp16 spectrogram (40 x 36 000 log-mel-like values), in 8 MiB pieces; each
codec of pyarrow (already a dependency) compresses and decompresses them, single-threaded, best of
3. Two kinds of features, since the ratio depends on them: ``relu`` = max(0, N(0, 1)), half of the
values zero (a ReLU's output: the most a codec can hope for), and ``pooled`` = exp(N(-1, 1)) with 10 %
zeros (non-negative and mostly non-zero, as a ReLU output averaged over a frame's positions is).

A shard read with a codec is bound by the slower of the disk (bytes / ratio) and the read tasks'
CPU: ``--cores`` cores, each spending the reader's own ``--reader-ms`` per video (CRC-32, clip
drawing: bench.loader's (c2) row) plus the decoding. The table gives the videos/s each codec
would reach against the uncompressed read (also bound by disk or by the reader's CPU). With
``--shards`` the features are the first ``--videos`` videos of a shard folder (``raymcn shards``
output, in the dtype it was written in): the ratio that decides, measured on the lab's own data.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pyarrow as pa

from bench import harness

CODECS = (("zstd", 1), ("zstd", 3), ("lz4", None))


def video_bytes(seed: int = 0, kind: str = "relu") -> bytes:
    rng = np.random.default_rng(seed)
    if kind == "relu":
        feats = np.maximum(rng.standard_normal((600, 2048), dtype=np.float32), 0).astype(np.float16)
    else:
        feats = (np.exp(rng.normal(-1, 1, (600, 2048))) * (rng.random((600, 2048)) >= 0.1)).astype(np.float16)
    spec = (np.round(rng.normal(-40, 12, (40, 36_000)) * 2) / 2).astype(np.float16)  # 0.5 dB steps, like log-mels
    return feats.tobytes() + spec.tobytes()


def shard_video_bytes(shards_dir: str, videos: int) -> list[bytes]:
    """The 2d, 3d and spectrogram bytes of the first ``videos`` videos of a shard folder."""
    from pathlib import Path

    from raymcn.data.formats.manifest import load_manifest
    from raymcn.data.read.stream import iter_shard_records

    out: list[bytes] = []
    for shard in load_manifest(shards_dir)["shards"]:
        for _, rec, _ in iter_shard_records(Path(shards_dir) / shard["name"], shard["videos"]):
            if rec is not None:
                out.append(rec.feat_2d.tobytes() + rec.feat_3d.tobytes() + rec.spec.tobytes())
            if len(out) == videos:
                return out
    if not out:
        raise SystemExit(f"no readable video in {shards_dir}")
    return out


def measure(data: bytes, codec: str, level: int | None, repeat: int = 3) -> dict:
    c = pa.Codec(codec, compression_level=level) if level is not None else pa.Codec(codec)
    pieces = [data[i:i + (8 << 20)] for i in range(0, len(data), 8 << 20)]
    best_c = best_d = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        packed = [c.compress(p, asbytes=True) for p in pieces]
        best_c = min(best_c, time.perf_counter() - t)
        t = time.perf_counter()
        for p, q in zip(pieces, packed):
            c.decompress(q, decompressed_size=len(p), asbytes=True)
        best_d = min(best_d, time.perf_counter() - t)
    size = sum(len(q) for q in packed)
    return {"codec": codec if level is None else f"{codec}-{level}", "ratio": len(data) / size,
            "compress_mb_s": len(data) / best_c / 1e6, "decode_mb_s": len(data) / best_d / 1e6}


SMOKE = {"videos": 1, "repeat": 1}  # one synthetic video per kind, each codec once


def build_parser():
    ap = harness.parser(__doc__, smoke="one video per kind of features, each codec run once")
    ap.add_argument("--disk-mb-s", type=float, default=750.0, help="the disk's sequential read rate, MB/s")
    ap.add_argument("--cores", type=int, default=2, help="cores running the read tasks")
    ap.add_argument("--reader-ms", type=float, default=0.0,
                    help="the reader's own CPU per video besides decoding, ms (bench/loader.py (c2); default 0)")
    ap.add_argument("--shards", help="measure on the first --videos videos of this shard folder instead")
    ap.add_argument("--videos", type=int, default=None,
                    help="videos taken from --shards (default 16), or synthetic videos per kind (default 4)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    repeat = 3
    if args.smoke:
        args.videos, repeat = SMOKE["videos"], SMOKE["repeat"]
    with harness.Results("compression", args) as results:
        rows = measure_all(args, repeat, results)
        results.finish({"disk_mb_s": args.disk_mb_s, "cores": args.cores, "reader_ms": args.reader_ms, "codecs": rows})
    return 0


def measure_all(args, repeat: int, results: harness.Results) -> list[dict]:
    """Every codec on every kind of features; the table printed as the rows come (saved too)."""
    rows = []
    for kind in ([args.shards] if args.shards else ["relu", "pooled"]):
        videos = (shard_video_bytes(kind, args.videos or 16) if args.shards
                  else [video_bytes(s, kind) for s in range(args.videos or 4)])
        data = b"".join(videos)
        per_video = len(data) / len(videos) / 1e6
        plain = min(args.disk_mb_s / per_video, args.cores * 1e3 / args.reader_ms if args.reader_ms else float("inf"))
        print(f"\n{kind} features: {len(data) / 1e6:.0f} MB of features + spectrograms ({per_video:.1f} MB per "
              f"video); disk {args.disk_mb_s:g} MB/s, {args.cores} cores at {args.reader_ms:g} ms per video besides "
              f"decoding; uncompressed: {plain:.0f} videos/s")
        print("| codec | ratio | compress MB/s | decode MB/s (1 core) | videos/s (disk-bound) | videos/s (CPU-bound) | "
              "read | vs uncompressed |\n|---|---:|---:|---:|---:|---:|---:|---:|")
        for codec, level in CODECS:
            r = measure(data, codec, level, repeat)
            disk = args.disk_mb_s * r["ratio"] / per_video
            cpu = args.cores * 1e3 / (args.reader_ms + per_video / r["decode_mb_s"] * 1e3)
            r.update(features=kind, mb_per_video=per_video, disk_bound_videos_s=disk, cpu_bound_videos_s=cpu,
                     videos_s=min(disk, cpu), uncompressed_videos_s=plain, vs_uncompressed=min(disk, cpu) / plain)
            rows.append(r)
            results.save(codecs=rows)
            print(f"| {r['codec']} | {r['ratio']:.2f} | {r['compress_mb_s']:.0f} | {r['decode_mb_s']:.0f} | "
                  f"{disk:.0f} | "
                  f"{cpu:.0f} | {r['videos_s']:.0f} | {r['vs_uncompressed']:.2f}x |")
    return rows


if __name__ == "__main__":
    sys.exit(main())
