"""Shards that fit the lab's disks: 2-byte features (``raymcn shards --dtype float16``), a folder of
one dtype only, and ``--dry-run``'s space check before anything is written.

The corpus has full-precision fp32 features (``SynthSettings(full_precision=True)``), so an fp16
shard really rounds them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import shards_of

from raymcn.data.commands import add_shards_arguments, run_shards
from raymcn.data.formats import manifest as shard_manifest
from raymcn.data.read.stream import iter_shard_records
from raymcn.data.synthetic import CorpusPaths, SynthSettings
from raymcn.data.write import shards

SETTINGS = SynthSettings(videos=24, eval_clips=8, full_precision=True)


def _write(corpus: CorpusPaths, out: Path, dtype: str) -> dict:
    return shards_of(corpus, out, videos_per_shard=8, feature_dtype=dtype)


def _records(out: Path, manifest: dict) -> dict:
    return {vid: rec for s in manifest["shards"]
            for vid, rec, err in iter_shard_records(out / s["name"], s["videos"]) if rec is not None}


@pytest.fixture(scope="module")
def both(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return {dtype: (root / dtype, _write(corpus, root / dtype, dtype)) for dtype in ("float32", "float16")}


def test_an_fp16_shard_holds_the_fp16_rounding_of_the_features_and_everything_else_bitwise(both):
    (d32, m32), (d16, m16) = both["float32"], both["float16"]
    assert m16["settings"]["feature_dtype"] == "float16" and m32["settings"]["feature_dtype"] == "float32"
    assert {s["feature_dtype"] for s in m16["shards"]} == {"float16"}
    r32, r16 = _records(d32, m32), _records(d16, m16)
    assert r32.keys() == r16.keys() and len(r32) == 24
    rounded_somewhere = False
    for vid, a in r32.items():
        b = r16[vid]
        for name in ("feat_2d", "feat_3d"):
            full, half = getattr(a, name), getattr(b, name)
            assert full.dtype == np.float32 and half.dtype == np.float16
            assert np.array_equal(half, full.astype(np.float16)), (vid, name)
            rounded_somewhere |= not np.array_equal(half.astype(np.float32), full)
        for name in ("spec", "starts", "ends", "token_ids", "token_offsets"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and np.array_equal(x, y), (vid, name)
    assert rounded_somewhere  # the corpus has full-precision values: the test can tell the dtypes apart
    # 2 bytes instead of 4 for every feature value, nothing else changes (up to tar padding: 512 bytes per member)
    saved = sum(2 * (r.feat_2d.size + r.feat_3d.size) for r in r32.values())
    assert abs(m32["counts"]["bytes"] - m16["counts"]["bytes"] - saved) <= 2 * 512 * len(r32)


def test_a_folder_of_mixed_dtypes_is_refused_naming_the_shards(both, tmp_path):
    (d32, m32), (d16, m16) = both["float32"], both["float16"]
    mixed = json.loads(json.dumps(m16))
    mixed["shards"][1]["feature_dtype"] = "float32"  # e.g. one shard rewritten by another writer
    with pytest.raises(shard_manifest.ShardError, match=r"mixed feature dtypes.*float16: shard-000000.tar, shard-000002.tar"
                                                r".*float32: shard-000001.tar"):
        shard_manifest.feature_dtype(mixed, "/data/shards")
    assert shard_manifest.feature_dtype(m16, d16) == "float16"
    legacy = json.loads(json.dumps(m32))  # written before the dtype was recorded: fp32
    del legacy["settings"]["feature_dtype"]
    for s in legacy["shards"]:
        del s["feature_dtype"]
    assert shard_manifest.feature_dtype(legacy, d32) == "float32"


def _cli(argv: list[str]) -> int:
    import argparse

    return run_shards(add_shards_arguments(argparse.ArgumentParser()).parse_args(argv))


def _layout_args(corpus: CorpusPaths, out: Path) -> list[str]:
    return ["--features", str(corpus.features_root), "--audio-features", str(corpus.audio_root), "--captions",
            str(corpus.captions), "--video-list", str(corpus.video_csv), "--word-vectors", str(corpus.word_vectors),
            "--out", str(out), "--videos-per-shard", "8", "--no-progress"]


def test_dry_run_prints_the_sizes_per_dtype_and_writes_nothing(corpus, tmp_path, capsys, both):
    out = tmp_path / "planned"
    assert _cli([*_layout_args(corpus, out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert not out.exists() or not any(out.iterdir())
    assert "24 videos" in text and "float32" in text and "float16" in text and "free at" in text, text
    # the estimate is close to what the writer then writes (within 15 %)
    est = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
           if line.startswith(("float32 ", "float16 "))}
    for dtype, (_, manifest) in both.items():
        assert abs(est[dtype] * 2**20 / manifest["counts"]["bytes"] - 1) < 0.15, (dtype, est, manifest["counts"])


def test_a_target_without_space_is_refused_before_writing_saying_by_how_much(corpus, tmp_path, capsys, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=100_000))  # a 100 kB quota
    out = tmp_path / "full"
    for extra in (["--dry-run"], []):
        assert _cli([*_layout_args(corpus, out), *extra]) == 2
        err = capsys.readouterr().err
        assert "do not fit" in err and "short by" in err and str(out) in err, err
        assert not any(out.glob("shard-*.tar")) if out.exists() else True


def _tar_the_layout(corpus: CorpusPaths, out: Path, style: str, per_tar: int = 10) -> list[Path]:
    """The lab's preparation: each video's three files into tars, as WebDataset members
    (``<id>.2d.npz``) or under their original names inside folders (``Cat/Sub/<id>_2d.npz``)."""
    import tarfile

    from raymcn.data.formats.features import read_video_paths, video_id_of

    paths = read_video_paths(corpus.video_csv)
    out.mkdir()
    tars = []
    for t in range(0, len(paths), per_tar):
        tars.append(out / f"part-{t // per_tar:03d}.tar")
        with tarfile.open(tars[-1], "w") as tf:
            for path in reversed(paths[t:t + per_tar]):  # another order than the list's: the list decides
                vid = video_id_of(path)
                files = {"2d": corpus.features_root / path / f"{vid}_2d.npz",
                         "3d": corpus.features_root / path / f"{vid}_3d.npz",
                         "spec": corpus.audio_root / path / f"{vid}_spec.npz"}
                for kind, f in files.items():
                    tf.add(f, arcname=f"{vid}.{kind}.npz" if style == "webdataset" else f"{path}/{vid}_{kind}.npz")
    return tars


@pytest.mark.parametrize("style", ["webdataset", "original names"])
def test_tars_of_the_npz_files_convert_to_the_same_shards_as_the_folders(corpus, both, tmp_path, style):
    d16, m16 = both["float16"]
    _tar_the_layout(corpus, tmp_path / "tars", style)
    got = shards.shards_from_layout(None, None, corpus.captions, corpus.video_csv, corpus.word_vectors,
                                    tmp_path / "from-tars", tars=[tmp_path / "tars"], videos_per_shard=8,
                                    feature_dtype="float16", progress=False, log=lambda m: None)
    assert [(s["name"], s["videos"], s["sha256"]) for s in got["shards"]] == \
        [(s["name"], s["videos"], s["sha256"]) for s in m16["shards"]]
    assert got["counts"]["videos"] == 24 and len(got["sources"]["tars"]) == 3


def test_without_a_video_list_the_tars_videos_are_taken_and_a_damaged_member_is_skipped_naming_it(corpus, tmp_path):
    tars = _tar_the_layout(corpus, tmp_path / "tars", "webdataset")
    import tarfile

    with tarfile.open(tars[0]) as tf:
        first = tf.getmembers()[0]
    with open(tars[0], "r+b") as f:  # damage the first member's data (an npz: its zip header)
        f.seek(first.offset_data)
        f.write(b"\0" * 64)
    assert _cli(["--tars", str(tmp_path / "tars"), "--captions", str(corpus.captions), "--word-vectors",
                 str(corpus.word_vectors), "--out", str(tmp_path / "out"), "--videos-per-shard", "8",
                 "--no-progress"]) == 0
    manifest = shard_manifest.load_manifest(tmp_path / "out")
    assert manifest["counts"]["videos"] == 23 and manifest["sources"]["video_list"] is None
    (skipped,) = manifest["skipped"]
    assert f"{tars[0]}:" in skipped["reason"] and "unreadable" in skipped["reason"], skipped


def test_the_command_says_which_inputs_go_together(corpus, tmp_path, capsys):
    assert _cli(["--captions", str(corpus.captions), "--word-vectors", str(corpus.word_vectors),
                 "--out", str(tmp_path / "o")]) == 2
    assert "either --features and --audio-features" in capsys.readouterr().err


def test_the_command_writes_fp16_features_by_default(corpus, tmp_path):
    assert _cli(_layout_args(corpus, tmp_path / "default")) == 0
    manifest = shard_manifest.load_manifest(tmp_path / "default")
    assert manifest["settings"]["feature_dtype"] == "float16"
    assert shard_manifest.feature_dtype(manifest, tmp_path / "default") == "float16"


def test_the_fp16_column_max_equals_the_fp32_max_for_every_sign():
    from raymcn.data.formats.features import fp16_max_bits

    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((40, 2048)) * 50).astype(np.float16)
    rows[3, :5] = [-0.0, 0.0, np.inf, -np.inf, 65504]
    rows[:, 7] = -rng.random(40).astype(np.float16) - 1  # a column of negatives only
    rows[:, 8] = -0.0  # negatives and -0.0: the max is -0.0
    rows[5, 8] = -3
    rows[:, 9] = -np.inf
    for lo, hi in ((0, 1), (0, 40), (5, 17), (3, 4)):
        got = fp16_max_bits(rows[lo:hi], np.empty(2048, np.int16)).view(np.float16)
        want = rows[lo:hi].max(axis=0)
        assert np.array_equal(got.view(np.int16), want.view(np.int16)), (lo, hi)  # bit for bit, signed zeros too
    assert np.signbit(fp16_max_bits(rows, np.empty(2048, np.int16)).view(np.float16)[8])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pooling_all_clips_at_once_equals_pooling_each_clip(dtype):
    """pool_clips (one output array, one normalisation) equals the per-clip recipe bit for bit:
    rows floor(start·fps)..floor(end·fps) clamped, column max, L2 norm; spans past the end too."""
    from raymcn.data.formats.features import l2_normalize, pool_clips, video_rows

    rng = np.random.default_rng(1)
    feat = (rng.standard_normal((30, 2048)) * 4).astype(dtype)
    starts = rng.uniform(0, 35, 50)
    ends = starts + rng.uniform(0, 12, 50)
    got = pool_clips(feat, starts, ends, 1.5)
    assert got.dtype == np.float32 and got.shape == (50, 2048)
    for j, (s, e) in enumerate(zip(starts, ends)):
        lo, hi = video_rows(30, s, e, 1.5)
        want = l2_normalize(feat[lo:hi + 1].astype(np.float32).max(axis=0))
        assert np.array_equal(got[j], want), j
    assert np.array_equal(pool_clips(feat[:0], starts, ends, 1.0), np.zeros((50, 2048), np.float32))