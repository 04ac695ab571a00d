"""Would lossless compression of the shards read faster? Ratio and decode speed of fast codecs on feature-like rows.

    python bench/compression.py                        # post-ReLU-like fp16 rows, zstd 1/3 and lz4 (~20 s)
    python bench/compression.py --disk-mb-s 750        # the disk's read rate (bench/loader.py's (d) row)
    python bench/compression.py --json

What runs: HowTo100M-like video features (600 rows of 2048: max(0, N(0, 1)) per value, about half
of them zero, as after a ReLU) in fp16 as ``raymcn shards`` stores them, plus the video's fp16
spectrogram (40 x 36 000 log-mel-like values), in 8 MiB pieces; each codec of pyarrow (already a
dependency) compresses and decompresses them, single-threaded, best of 3. A shard read with a
codec is bound by the slower of the disk (bytes / ratio) and the decoding (per core); the table
gives the videos/s each codec would reach for ``--disk-mb-s`` and ``--cores`` decoding cores,
against the uncompressed read at the disk's rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import pyarrow as pa

CODECS = (("zstd", 1), ("zstd", 3), ("lz4", None))


def video_bytes(seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    feats = np.maximum(rng.standard_normal((600, 2048), dtype=np.float32), 0).astype(np.float16)
    spec = (np.round(rng.normal(-40, 12, (40, 36_000)) * 2) / 2).astype(np.float16)  # 0.5 dB steps, like log-mels
    return feats.tobytes() + spec.tobytes()


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--disk-mb-s", type=float, default=750.0, help="the disk's sequential read rate, MB/s")
    ap.add_argument("--cores", type=int, default=2, help="cores decoding (the read tasks)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    data = b"".join(video_bytes(s) for s in range(4))
    per_video = len(data) / 4 / 1e6
    plain = args.disk_mb_s / per_video
    print(f"{len(data) / 1e6:.0f} MB of fp16 features + spectrograms ({per_video:.1f} MB per video); "
          f"disk {args.disk_mb_s:g} MB/s, {args.cores} decoding cores; uncompressed: {plain:.0f} videos/s")
    print("| codec | ratio | compress MB/s | decode MB/s (1 core) | videos/s (disk-bound) | videos/s (decode-bound) | "
          "read | vs uncompressed |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for codec, level in CODECS:
        r = measure(data, codec, level)
        disk = args.disk_mb_s * r["ratio"] / per_video
        decode = r["decode_mb_s"] * args.cores / per_video
        r.update(disk_bound_videos_s=disk, decode_bound_videos_s=decode, videos_s=min(disk, decode),
                 vs_uncompressed=min(disk, decode) / plain)
        rows.append(r)
        print(f"| {r['codec']} | {r['ratio']:.2f} | {r['compress_mb_s']:.0f} | {r['decode_mb_s']:.0f} | {disk:.0f} | "
              f"{decode:.0f} | {r['videos_s']:.0f} | {r['vs_uncompressed']:.2f}x |")
    if args.json:
        print(json.dumps({"disk_mb_s": args.disk_mb_s, "cores": args.cores, "mb_per_video": per_video,
                          "uncompressed_videos_s": plain, "codecs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
