"""Shard writer and tar-level decoding (no Ray): placement, resume, round trip, manifest, damage."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import last_json, shards_of
from shard_scan import check_shard

from raymcn.config import load_config
from raymcn.data import commands, synthetic
from raymcn.data.formats import manifest as shard_manifest
from raymcn.data.formats import sample, tarfmt
from raymcn.data.formats.features import FeatureFileError, load_captions, read_video, read_video_paths, video_id_of
from raymcn.data.formats.manifest import ShardError
from raymcn.data.formats.sample import SampleError
from raymcn.data.formats.words import load_vocab
from raymcn.data.read import stream
from raymcn.data.write import writer

ARRAYS = ("feat_2d", "feat_3d", "spec", "starts", "ends", "token_ids", "token_offsets")
V1 = Path(__file__).parent / "data" / "shards-v1"  # written by the FORMAT_VERSION 1 writer (make_shards_v1.py)
SETTINGS = synthetic.SynthSettings(videos=12, eval_clips=2, topics=3, word_dim=16, meaning_words=60,
                                   filler_words=8, video_seconds=(6.0, 10.0))


# --- fixtures ----------------------------------------------------------------------------------------


def write(corpus, out, **kw) -> dict:
    # fp32 features: these tests pin the format's bytes (bit-exact round trip, the v1 fixture);
    # fp16 shards are tests/test_shard_dtype.py's
    return shards_of(corpus, out, **{"feature_dtype": "float32", "videos_per_shard": 5, **kw})


@pytest.fixture(scope="module")
def written(corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("shards")
    return out, write(corpus, out)


def file_state(directory: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.rglob("*")) if p.is_file()}


def corpus_ids(corpus) -> list[str]:
    return [video_id_of(p) for p in read_video_paths(corpus.video_csv)]


# --- placement, manifest ------------------------------------------------------------------------------
def test_every_video_lands_in_exactly_one_shard(corpus, written):
    out, manifest = written
    listed = [v for s in manifest["shards"] for v in s["videos"]]
    assert sorted(listed) == sorted(corpus_ids(corpus))
    assert len(listed) == len(set(listed))
    assert [len(s["videos"]) for s in manifest["shards"]] == [5, 5, 2]
    for s in manifest["shards"]:  # the tar holds exactly the listed samples, in that order
        keys = [span.key for span in tarfmt.scan_tar((out / s["name"]).read_bytes())]
        assert keys == s["videos"]
    c = manifest["counts"]
    assert (c["listed"], c["videos"], c["skipped"], c["shards"]) == (12, 12, 0, 3)
    assert manifest["skipped"] == []


def test_manifest_sizes_and_sha256(written):
    out, manifest = written
    for s in manifest["shards"]:
        data = (out / s["name"]).read_bytes()
        assert s["bytes"] == len(data)
        assert s["sha256"] == hashlib.sha256(data).hexdigest()
    assert manifest["counts"]["bytes"] == sum(s["bytes"] for s in manifest["shards"])
    assert json.loads((out / shard_manifest.MANIFEST).read_text()) == manifest
    assert shard_manifest.load_manifest(out) == manifest


def test_videos_are_shuffled_across_shards(corpus, written):
    _, manifest = written
    assert [v for s in manifest["shards"] for v in s["videos"]] != sorted(corpus_ids(corpus))


def test_round_trip_is_bit_exact(corpus, written):
    out, manifest = written
    vocab = load_vocab(out)
    assert vocab.matrix.shape == (len(vocab.words) + 1, SETTINGS.word_dim) and not vocab.matrix[0].any()
    captions = load_captions(corpus.captions)
    paths = {video_id_of(p): p for p in read_video_paths(corpus.video_csv)}
    seen = 0
    for s in manifest["shards"]:
        for vid, rec, err in stream.iter_shard_records(out / s["name"], s["videos"]):
            assert err is None
            ref = read_video(paths[vid], corpus.features_root, corpus.audio_root, captions, vocab.word_to_id)
            for name in ARRAYS:
                a, b = getattr(rec, name), getattr(ref, name)
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (vid, name)
            seen += 1
    assert seen == 12


def test_samples_are_standard_npy_members(written):
    """Any tar/npy tool reads the shards: tarfile + np.load give the same arrays as our zero-copy decoder."""
    out, manifest = written
    s = manifest["shards"][0]
    with tarfile.open(out / s["name"]) as tf:
        names = tf.getnames()
        spec = np.load(io.BytesIO(tf.extractfile(f"{s['videos'][0]}.spec.npy").read()))
    assert names[:8] == [f"{s['videos'][0]}.{m}" for m in sample.MEMBERS]
    first = next(stream.iter_shard_records(out / s["name"]))[1]
    assert np.array_equal(spec, first.spec) and spec.dtype == np.float16


def test_webdataset_library_reads_the_shards(written):
    wds = pytest.importorskip("webdataset")
    out, manifest = written
    s = manifest["shards"][0]
    ds = wds.WebDataset(str(out / s["name"]), shardshuffle=False).decode()
    sample = next(iter(ds))
    ours = next(stream.iter_shard_records(out / s["name"]))[1]
    assert sample["__key__"] == ours.video_id
    assert np.array_equal(sample["3d.npy"], ours.feat_3d) and np.array_equal(sample["tokens.npy"], ours.token_ids)


def array_digests(rec) -> dict:
    return {name: {"dtype": str(a.dtype), "shape": list(a.shape), "sha256": hashlib.sha256(a.tobytes()).hexdigest()}
            for name in ARRAYS for a in [getattr(rec, name)]}


@pytest.mark.parametrize("chunk", [2048, 32 << 20])
def test_shards_of_the_v1_writer_still_load(chunk):
    """A shard directory written by the first writer (committed bytes) decodes to its source arrays."""
    manifest = shard_manifest.load_manifest(V1)
    assert (manifest["version"], manifest["counts"]["videos"], manifest["counts"]["shards"]) == (1, 3, 2)
    assert [s["video"] for s in manifest["skipped"]] == ["gone0001"]
    assert load_vocab(V1).matrix.shape == (9, 4)
    decoded = {}
    for s in manifest["shards"]:
        assert hashlib.sha256((V1 / s["name"]).read_bytes()).hexdigest() == s["sha256"]
        for vid, rec, err in stream.iter_shard_records(V1 / s["name"], s["videos"], chunk_bytes=chunk):
            assert err is None, (vid, err)
            decoded[vid] = array_digests(rec)
    assert decoded == json.loads((V1.parent / "shards-v1.expected.json").read_text())


def test_todays_writer_writes_the_v1_bytes():
    """The v1 samples written again (decode, encode, tarfile USTAR): the very same bytes, then zeros
    up to a multiple of 10240 (tarfile pads the end-of-archive to a full record; the v1 writer
    stopped after two zero blocks). One scanner reads both."""
    for s in shard_manifest.load_manifest(V1)["shards"]:
        old = (V1 / s["name"]).read_bytes()
        old_spans = list(tarfmt.scan_tar(old))
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for span in old_spans:
                writer.write_sample(tar, span.key, sample.encode_record(sample.decode_span(old, span)))
        new = out.getvalue()
        assert new[:len(old)] == old and len(new) % 10240 == 0 and not any(new[len(old):])
        assert [(sp.key, sp.start, sp.end, sp.members) for sp in tarfmt.scan_tar(new)] == \
            [(sp.key, sp.start, sp.end, sp.members) for sp in old_spans]
        assert [sp.key for sp in old_spans] == s["videos"]


# --- resume, determinism ------------------------------------------------------------------------------
def test_rerun_is_a_no_op(corpus, written):
    out, manifest = written
    before = file_state(out)
    lines = []
    again = write(corpus, out, log=lines.append)
    assert again == manifest
    assert file_state(out) == before  # not a single file rewritten (same mtimes)
    assert any("nothing to do" in line for line in lines)


def test_resume_rewrites_only_missing_or_damaged_shards(corpus, written, tmp_path):
    src, manifest = written
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    names = [s["name"] for s in manifest["shards"]]
    (out / names[0]).unlink()
    data = bytearray((out / names[1]).read_bytes())
    data[2000] ^= 0xFF
    (out / names[1]).write_bytes(bytes(data))
    before = file_state(out)
    lines = []
    again = write(corpus, out, log=lines.append)
    after = file_state(out)
    assert again["shards"] == manifest["shards"]  # same bytes and sha256 as the first run
    assert after[names[2]] == before[names[2]]  # the intact shard was not touched
    assert after[names[1]] != before[names[1]]
    assert any("2 of 3 shards to write" in line for line in lines)


def test_interrupted_write_leaves_no_partial_shard(corpus, tmp_path, monkeypatch):
    """A crash mid-shard leaves no shard of its name, nor its temp file; the rerun completes the set."""
    calls = {"n": 0}
    real = writer.write_sample

    def crash_on_7th(out, key, members):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt
        return real(out, key, members)

    monkeypatch.setattr(writer, "write_sample", crash_on_7th)
    with pytest.raises(KeyboardInterrupt):
        write(corpus, tmp_path / "o")
    visible = sorted(p.name for p in (tmp_path / "o").glob("shard-*.tar"))
    assert visible == ["shard-000000.tar"] and not (tmp_path / "o" / shard_manifest.MANIFEST).exists()
    assert not list((tmp_path / "o").glob(".shard-*"))  # the partial shard's temp file went with it
    monkeypatch.setattr(writer, "write_sample", real)
    manifest = write(corpus, tmp_path / "o")
    assert manifest["counts"]["videos"] == 12


def test_a_disk_that_fills_mid_conversion_keeps_the_finished_shards_and_says_how_to_go_on(corpus, tmp_path,
                                                                                          monkeypatch, capsys):
    """The 7th sample's write fails as a full disk does: the command names the file, the free space
    where the shards go and what to do; the finished shard stays, the partial one goes; the same
    command then finishes the set."""
    import errno

    from raymcn.cli import main

    calls = {"n": 0}
    real = writer.write_sample

    def full_at_7th(out, key, members):
        calls["n"] += 1
        if calls["n"] == 7:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "o" / "the-shard"))
        return real(out, key, members)

    monkeypatch.setattr(writer, "write_sample", full_at_7th)
    out = tmp_path / "o"
    argv = ["shards", "--features", str(corpus.features_root), "--audio-features", str(corpus.audio_root),
            "--captions", str(corpus.captions), "--video-list", str(corpus.video_csv), "--word-vectors",
            str(corpus.word_vectors), "--out", str(out), "--workers", "1", "--dtype", "float32",
            "--videos-per-shard", "5", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{out / 'the-shard'}: No space left on device; " in err
    assert re.search(rf"; [\d.]+ GB free at {re.escape(str(out))}\. The shards finished so far are kept", err), err
    assert "run the same command again: it goes on" in err
    assert sorted(p.name for p in out.glob("*shard-*")) == ["shard-000000.tar"]
    (out / ".shard-000002.tar.tmp-99999").write_bytes(b"a writer ended mid-shard")  # its pool stopped
    monkeypatch.setattr(writer, "write_sample", real)
    assert main(argv) == 0
    assert sorted(p.name for p in out.glob("*shard-*")) == ["shard-000000.tar", "shard-000001.tar",
                                                              "shard-000002.tar"]


def test_assignment_is_deterministic_from_the_seed(corpus, written, tmp_path):
    _, manifest = written
    same = write(corpus, tmp_path / "same", workers=2)  # parallel writer, same bytes
    assert [(s["videos"], s["sha256"]) for s in same["shards"]] == \
        [(s["videos"], s["sha256"]) for s in manifest["shards"]]
    other = write(corpus, tmp_path / "other", seed=1)
    assert [s["videos"] for s in other["shards"]] != [s["videos"] for s in manifest["shards"]]


def test_other_settings_into_the_same_directory_are_refused(corpus, written, tmp_path):
    src, _ = written
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    with pytest.raises(ShardError, match="plan.json"):
        write(corpus, out, seed=7)


def test_shard_size_target(corpus, tmp_path):
    manifest = write(corpus, tmp_path / "o", videos_per_shard=None, shard_size_mb=1.0)
    sizes = [s["bytes"] for s in manifest["shards"]]
    assert manifest["settings"]["videos_per_shard"] >= 1 and len(sizes) >= 2
    assert max(sizes[:-1]) < 2.5 * 2**20


# --- skipped videos -----------------------------------------------------------------------------------
def test_unreadable_videos_are_skipped_with_reasons(corpus, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(corpus.root, root)
    broken = synthetic.CorpusPaths(root)
    rows = read_video_paths(broken.video_csv)
    gone, nocap, bad = video_id_of(rows[0]), video_id_of(rows[1]), video_id_of(rows[2])
    (broken.features_root / rows[0] / f"{gone}_3d.npz").unlink()
    (broken.audio_root / rows[2] / f"{bad}_spec.npz").write_bytes(b"not a zip")
    caps = load_captions(broken.captions)
    del caps[nocap]
    import pickle

    broken.captions.write_bytes(pickle.dumps(caps))
    broken.video_csv.write_text("path\n" + "".join(r + "\n" for r in rows + [rows[5]]))  # a duplicate row
    manifest = write(broken, tmp_path / "o")
    reasons = {s["video"]: s["reason"] for s in manifest["skipped"]}
    assert set(reasons) == {gone, nocap, bad, video_id_of(rows[5])}
    assert "_3d.npz" in reasons[gone] and "missing" in reasons[gone]
    assert "no entry" in reasons[nocap]
    assert "_spec.npz" in reasons[bad] and "unreadable" in reasons[bad]
    assert "more than once" in reasons[video_id_of(rows[5])]
    placed = [v for s in manifest["shards"] for v in s["videos"]]
    assert sorted(placed) == sorted(set(video_id_of(r) for r in rows) - {gone, nocap, bad})
    assert manifest["counts"]["skipped"] == 4 and manifest["counts"]["videos"] == 9


# --- damaged shards (tar-level decoding) --------------------------------------------------------------
def damaged(raw: bytes, how: str, spans) -> bytes:
    b = bytearray(raw)
    if how == "truncated":
        return raw[:spans[2].members["3d.npy"][0] + 1000]
    if how == "flipped_data":
        off, _ = spans[1].members["2d.npy"]
        b[off + 500] ^= 0xFF
    elif how == "flipped_header":
        off, _ = spans[3].members["spec.npy"]
        b[off - 512 + 3] ^= 0x10  # inside the member name: the header checksum fails
    elif how == "missing_member":
        src, out = tarfile.open(fileobj=io.BytesIO(raw)), io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tw:
            for m in src.getmembers():
                if m.name != f"{spans[0].key}.tokens.npy":
                    tw.addfile(m, src.extractfile(m))
        return out.getvalue()
    return bytes(b)


EXPECTED_BAD = {"truncated": {2: "truncated", 3: "missing from the shard", 4: "missing from the shard"},
                "flipped_data": {1: "CRC-32"}, "flipped_header": {3: "missing member(s) spec.npy"},
                "missing_member": {0: "missing member(s) tokens.npy"}}


@pytest.mark.parametrize("how", sorted(EXPECTED_BAD))
@pytest.mark.parametrize("chunk", [2048, 100_000, 32 << 20])
def test_damaged_shard_costs_only_its_bad_samples(written, tmp_path, how, chunk):
    out, manifest = written
    s = manifest["shards"][0]
    raw = (out / s["name"]).read_bytes()
    spans = list(tarfmt.scan_tar(raw))
    path = tmp_path / "bad.tar"
    path.write_bytes(damaged(raw, how, spans))
    results = list(stream.iter_shard_records(path, s["videos"], chunk_bytes=chunk))
    bad = {vid: err for vid, rec, err in results if rec is None}
    want = {s["videos"][i]: text for i, text in EXPECTED_BAD[how].items()}
    assert set(bad) == set(want)
    for vid, text in want.items():
        assert text in bad[vid]
    good = {vid: rec for vid, rec, err in results if rec is not None}
    assert len(good) + len(bad) == len(s["videos"])
    reference = {vid: rec for vid, rec, _ in stream.iter_shard_records(out / s["name"])}
    for vid, rec in good.items():  # the survivors are intact
        for name in ARRAYS:
            assert getattr(rec, name).tobytes() == getattr(reference[vid], name).tobytes()
    whole = check_shard(path.read_bytes(), s["videos"])
    assert sorted(k for k, _ in whole.bad) == sorted(bad)


def test_unreadable_shard_reports_every_expected_video(tmp_path):
    results = list(stream.iter_shard_records(tmp_path / "absent.tar", ["a", "b"]))
    assert [(k, r) for k, r, _ in results] == [("a", None), ("b", None)]
    assert all("shard unreadable" in e for _, _, e in results)


def test_decode_sample_bytes_checks_the_region(written):
    out, manifest = written
    raw = (out / manifest["shards"][0]["name"]).read_bytes()
    span = next(tarfmt.scan_tar(raw))
    rec = sample.decode_sample_bytes(memoryview(raw)[span.start:span.end], span.key)
    assert rec.video_id == span.key and not rec.feat_2d.flags.writeable  # a view, not a copy
    with pytest.raises(SampleError, match="expected"):
        sample.decode_sample_bytes(memoryview(raw)[span.start:span.end], "other")
    cut = span.members["ends.npy"][0] + 10  # a member runs past the end of the region
    with pytest.raises(SampleError, match="truncated"):
        sample.decode_sample_bytes(memoryview(raw)[span.start:cut])


def test_npy_view_refuses_bad_members():
    good = tarfmt.npy_bytes(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert tarfmt.npy_view(memoryview(good)).tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(tarfmt.NpyError, match="magic"):
        tarfmt.npy_view(memoryview(b"x" * 200))
    with pytest.raises(tarfmt.NpyError, match="data bytes"):
        tarfmt.npy_view(memoryview(good[:-4]))
    obj = io.BytesIO()
    np.lib.format.write_array(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(tarfmt.NpyError, match="object"):
        tarfmt.npy_view(memoryview(obj.getvalue()))


# --- load_manifest, the embedded default, the commands ------------------------------------------------
def test_load_manifest_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        shard_manifest.load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ShardError, match="manifest.json"):
        shard_manifest.load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ShardError, match="not a raymcn-shards manifest"):
        shard_manifest.load_manifest(tmp_path)


def test_ensure_synthetic_shards_once(tmp_path):
    from raymcn.cli import preset_path

    cfg = load_config(preset_path(), [f"data.cache_dir={tmp_path}", "data.synthetic_videos=6",
                                      "data.synthetic_eval_clips=2", "data.synthetic_topics=2", "model.word_dim=8",
                                      "data.batch_size=2", "loss.num_clusters=2"])
    d = synthetic.ensure_synthetic_shards(cfg)
    manifest = shard_manifest.load_manifest(d)
    assert manifest["counts"]["videos"] == 6 and d.parent == tmp_path
    before = file_state(d)
    assert synthetic.ensure_synthetic_shards(cfg) == d and file_state(d) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".shards-")]  # no temp dir left
    assert load_vocab(d).dim == 8
    from raymcn.config import ConfigError
    from raymcn.train.inputs import resolve_inputs, shard_folder

    assert shard_folder(cfg) == d
    assert resolve_inputs(cfg.replace({"data.shards": str(d)})).shards_dir == str(d.resolve())
    with pytest.raises(ConfigError, match="directory does not exist"):
        resolve_inputs(cfg.replace({"data.shards": str(tmp_path / "nowhere")}))


def shards_args(corpus, out, **kw) -> argparse.Namespace:
    parser = commands.add_shards_arguments(argparse.ArgumentParser())
    argv = ["--features", str(corpus.features_root), "--audio-features", str(corpus.audio_root),
            "--captions", str(kw.get("captions", corpus.captions)),
            "--video-list", str(kw.get("video_list", corpus.video_csv)),
            "--word-vectors", str(corpus.word_vectors), "--out", str(out), "--videos-per-shard", "4",
            "--workers", "1", "--no-progress", "--json"]
    return parser.parse_args(argv)


def test_shards_command(corpus, tmp_path, capsys):
    assert commands.run_shards(shards_args(corpus, tmp_path / "o")) == 0
    last = last_json(capsys.readouterr().out)
    assert last["videos"] == 12 and last["shards"] == 3


def test_shards_command_errors_name_the_files(corpus, tmp_path, capsys):
    assert commands.run_shards(shards_args(corpus, tmp_path / "o", video_list=tmp_path / "nope.csv")) == 2
    assert "nope.csv" in capsys.readouterr().err
    bad_pickle = tmp_path / "caps.pickle"
    bad_pickle.write_bytes(b"garbage")
    assert commands.run_shards(shards_args(corpus, tmp_path / "o2", captions=bad_pickle)) == 2
    err = capsys.readouterr().err
    assert "caps.pickle" in err and "unreadable" in err
    bad_csv = tmp_path / "list.csv"
    bad_csv.write_text("video\nx\n")
    assert commands.run_shards(shards_args(corpus, tmp_path / "o3", video_list=bad_csv)) == 2
    assert "list.csv" in capsys.readouterr().err


def test_synth_command_writes_the_original_layout(tmp_path, capsys):
    parser = commands.add_synth_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--out", str(tmp_path / "s"), "--videos", "2", "--eval-clips", "2",
                              "--word-dim", "8", "--json"])
    assert commands.run_synth(args) == 0
    info = last_json(capsys.readouterr().out)
    rows = read_video_paths(info["video_list"])
    vid = video_id_of(rows[0])
    assert len(rows) == 2 and (Path(info["features"]) / rows[0] / f"{vid}_2d.npz").is_file()
    assert (Path(info["audio_features"]) / rows[0] / f"{vid}_spec.npz").is_file()
    assert Path(info["eval"]).is_file() and Path(info["captions"]).is_file()
    assert commands.run_synth(parser.parse_args(["--out", str(tmp_path / "t"), "--videos", "0"])) == 2


def test_feature_file_error_is_exported():
    assert issubclass(FeatureFileError, ValueError)
