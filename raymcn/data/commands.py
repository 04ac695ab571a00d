"""The ``raymcn synth`` and ``raymcn shards`` commands (argument definitions + runners; no Ray).

``cli.py`` wires them as sub-commands::

    p = sub.add_parser("shards", help=...); add_shards_arguments(p); p.set_defaults(func=run_shards)

Each runner returns an exit status: 0 on success, 2 on a problem with the inputs (the message,
printed to stderr, names the file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from raymcn.data import synthetic
from raymcn.data.formats.features import FeatureFileError

SHARDS_HELP = "convert the original feature layout into shuffled tar shards + vocabulary + manifest"


def _write_failure(error: OSError, out: Path) -> str:
    """What ``raymcn shards`` says of an OSError: the file and why; for a disk that cannot take the
    shards (full, over quota, read-only: a rerun would fail alike), also the free space where they
    go and how to go on (the finished shards are kept; the part of a shard written is removed)."""
    from raymcn.config import is_storage_error, storage_cause
    from raymcn.data.write.disk_space import free_bytes

    cause = storage_cause(error) or error  # (a Ray writer's error: Ray's task error around it)
    said = f"{getattr(cause, 'filename', None) or out}: {getattr(cause, 'strerror', None) or cause}"
    if not is_storage_error(cause):
        return said
    return (f"{said}; {free_bytes(out) / 1e9:.2f} GB free at {out}. The shards finished so far are kept: make room "
            "(the dry run, --dry-run, says what the rest needs), then run the same command again: it goes on")


def command_error(command: str, message: str) -> int:
    print(f"raymcn {command}: {message}", file=sys.stderr)
    return 2






# --- raymcn synth ------------------------------------------------------------------------------------
# --- raymcn synth ------------------------------------------------------------------------------------
SYNTH_HELP = "write a synthetic corpus in the original HowTo100M feature layout (+ a YouCook2-style eval pickle)"


# --- raymcn synth ------------------------------------------------------------------------------------
def add_synth_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = synthetic.SynthSettings()
    parser.add_argument("--out", required=True, help="directory to write (created; existing files are overwritten)")
    parser.add_argument("--videos", type=int, default=d.videos, help=f"training videos (default {d.videos})")
    parser.add_argument("--seed", type=int, default=synthetic.CORPUS_SEED, help=f"generator seed (default {synthetic.CORPUS_SEED})")
    parser.add_argument("--eval-clips", type=int, default=d.eval_clips,
                        help=f"clips of the YouCook2-style eval pickle (default {d.eval_clips})")
    parser.add_argument("--msrvtt-clips", type=int, default=0,
                        help="also write an MSR-VTT-style pickle with this many clips (default 0: none)")
    parser.add_argument("--topics", type=int, default=d.topics, help=f"latent topics (default {d.topics})")
    parser.add_argument("--word-dim", type=int, default=d.word_dim, help=f"word-vector size (default {d.word_dim})")
    parser.add_argument("--full-precision", action="store_true",
                        help="training features at full fp32 precision (default: fp16-representable values)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    return parser


def run_synth(args: argparse.Namespace) -> int:
    for name in ("videos", "topics", "word_dim"):
        if getattr(args, name) < 1:
            return command_error("synth", f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    for name in ("eval_clips", "msrvtt_clips"):
        if getattr(args, name) < 0:
            return command_error("synth", f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 0")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return command_error("synth", f"--out {out}: exists and is not a directory")
    settings = synthetic.SynthSettings(videos=args.videos, eval_clips=args.eval_clips, topics=args.topics,
                             word_dim=args.word_dim, seed=args.seed, msrvtt_clips=args.msrvtt_clips,
                             full_precision=args.full_precision)
    t0 = time.perf_counter()
    try:
        paths = synthetic.write_corpus(out, settings)
    except OSError as e:
        return command_error("synth", f"cannot write {e.filename or out}: {e.strerror or e}")
    print(f"wrote {args.videos} videos in the original layout to {out} ({time.perf_counter() - t0:.1f} s)")
    print(f"  video list   {paths.video_csv}\n  features     {paths.features_root}\n"
          f"  audio        {paths.audio_root}\n  captions     {paths.captions}\n"
          f"  word vectors {paths.word_vectors}\n  eval pickle  {paths.youcook_eval}")
    print(f"shard it with: raymcn shards --features {paths.features_root} --audio-features {paths.audio_root} "
          f"--captions {paths.captions} --video-list {paths.video_csv} --word-vectors {paths.word_vectors} "
          f"--out {out / 'shards'}")
    if args.json:
        print(json.dumps({"out": str(out), "videos": args.videos, "video_list": str(paths.video_csv),
                          "features": str(paths.features_root), "audio_features": str(paths.audio_root),
                          "captions": str(paths.captions), "word_vectors": str(paths.word_vectors),
                          "eval": str(paths.youcook_eval)}))
    return 0


# --- raymcn shards -----------------------------------------------------------------------------------
def add_shards_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from raymcn.data.formats.sample import FEATURE_DTYPES
    from raymcn.data.write.shards import DEFAULT_FEATURE_DTYPE, DEFAULT_SHARD_SIZE_MB

    parser.add_argument("--features", help="root of <path>/<id>_2d.npz and _3d.npz")
    parser.add_argument("--audio-features", help="root of <path>/<id>_spec.npz")
    parser.add_argument("--tars", nargs="+", metavar="TAR_OR_DIR",
                        help="instead of --features/--audio-features: tar files (or folders of *.tar) holding the "
                             "per-video files as <id>.2d.npz/<id>.3d.npz/<id>.spec.npz (WebDataset) or "
                             "<id>_2d.npz/... (the original names); .npy also accepted")
    parser.add_argument("--captions", required=True, help="caption pickle: video_id -> {start, end, text}")
    parser.add_argument("--video-list", help="CSV with header 'path' (category/subfolder/<id>); optional with "
                                             "--tars (default: every complete video in the tars, in their order)")
    parser.add_argument("--word-vectors", required=True, help="binary word2vec file (e.g. GoogleNews-...-300.bin)")
    parser.add_argument("--out", required=True, help="output directory (a rerun resumes / is a no-op)")
    parser.add_argument("--shard-size-mb", type=float, default=DEFAULT_SHARD_SIZE_MB,
                        help=f"target shard size in MB (default {DEFAULT_SHARD_SIZE_MB:g})")
    parser.add_argument("--videos-per-shard", type=int, default=None,
                        help="fixed videos per shard instead of --shard-size-mb")
    parser.add_argument("--seed", type=int, default=0, help="seed of the video -> shard permutation (default 0)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes writing shards in parallel (default min(4, CPUs); with --ray: one per CPU "
                             "of the cluster)")
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="write the shards with Ray actors on every node of the cluster at ADDRESS (default: "
                             "RAY_ADDRESS, else a new local Ray of its own; auto: the Ray instance running on this "
                             "machine); inputs and "
                             "--out must be on storage every node sees at the same path")
    parser.add_argument("--verify", choices=("sha256", "size"), default="sha256",
                        help="how a rerun checks finished shards (default sha256: rehash them)")
    parser.add_argument("--dtype", choices=tuple(FEATURE_DTYPES), default=DEFAULT_FEATURE_DTYPE,
                        help=f"storage of the 2d/3d features (default {DEFAULT_FEATURE_DTYPE}; float16 halves them)")
    parser.add_argument("--dry-run", action="store_true",
                        help="count the videos, print the bytes the shards will take per dtype and the free "
                             "space at --out, write nothing; an error (status 2) for whatever the conversion "
                             "would refuse (the settings, another conversion's shards in --out, the caption "
                             "table's memory, the space)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the manifest counts as one JSON line last")
    return parser


def run_shards(args: argparse.Namespace, writer=None) -> int:
    """``raymcn shards``; ``writer``: who writes the shards instead of local processes
    (``shards_from_layout``'s; the command line passes Ray's for ``--ray``)."""
    from raymcn.data.formats.manifest import MANIFEST, ShardError
    from raymcn.data.write.disk_space import plan_space
    from raymcn.data.write.shards import ConversionSettings, check_conversion, shards_from_layout
    from raymcn.data.write.sources import layout_sources

    if args.workers is not None and args.workers < 0:
        return command_error("shards", f"--workers={args.workers}: must be >= 0")
    workers = args.workers if args.workers is not None else min(4, os.cpu_count() or 1)
    if bool(args.tars) == bool(args.features or args.audio_features):
        return command_error("shards", "give either --features and --audio-features (the feature folders) or --tars")
    if not args.tars and not (args.features and args.audio_features and args.video_list):
        return command_error("shards", "--features, --audio-features and --video-list are needed together")
    try:
        if args.dry_run:
            src = layout_sources(args.features, args.audio_features, args.captions, args.video_list,
                                 args.word_vectors, args.tars or ())
            settings = ConversionSettings(shard_size_mb=args.shard_size_mb, seed=args.seed,
                                          videos_per_shard=args.videos_per_shard, verify=args.verify,
                                          feature_dtype=args.dtype)
            feats = check_conversion(src, Path(args.out), settings, progress=not args.no_progress)  # its refusals
            space = plan_space(src, args.out, seed=args.seed, progress=not args.no_progress, feats=feats)
            print(space.report(args.dtype))
            return 0 if space.fits(args.dtype) else command_error("shards", space.refusal(args.dtype))
        manifest = shards_from_layout(args.features, args.audio_features, args.captions, args.video_list,
                                      args.word_vectors, args.out, shard_size_mb=args.shard_size_mb, seed=args.seed,
                                      workers=workers, videos_per_shard=args.videos_per_shard,
                                      verify=args.verify, feature_dtype=args.dtype, tars=args.tars or (),
                                      progress=not args.no_progress, writer=writer)
    except (ShardError, FeatureFileError) as e:
        return command_error("shards", str(e))
    except OSError as e:
        return command_error("shards", _write_failure(e, Path(args.out)))
    c = manifest["counts"]
    print(f"{c['videos']} of {c['listed']} listed videos in {c['shards']} shard{'s' * (c['shards'] != 1)} "
          f"({c['bytes'] / 2**20:.1f} MiB), "
          f"{c['skipped']} skipped, vocabulary {c['vocab_words']} words x {c['word_dim']}: {Path(args.out) / MANIFEST}")
    for s in manifest["skipped"][:10]:
        print(f"  skipped {s['video']}: {s['reason']}")
    if len(manifest["skipped"]) > 10:
        print(f"  ... {len(manifest['skipped']) - 10} more in the manifest")
    if args.json:
        print(json.dumps({"out": str(args.out), **c}))
    return 0
