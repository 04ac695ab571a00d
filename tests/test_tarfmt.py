"""tarfmt and sample on hand-made bytes: the tar scanner, reading in pieces, .npy views, the sample codec."""

from __future__ import annotations

import io
import json
import tarfile
import zlib

import numpy as np
import pytest
from shard_scan import check_shard

from raymcn.data.formats import sample, tarfmt
from raymcn.data.formats.features import FEATURE_DIM, MEL_BINS, VideoRecord
from raymcn.data.write import writer


def member(name: str, data: bytes, kind: bytes = tarfile.REGTYPE) -> bytes:
    """One member as tarfile writes it in USTAR format: header, data, padding to 512 bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.type = len(data), kind
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape") + data + bytes(-len(data) % 512)


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tw:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tw.addfile(info, io.BytesIO(data))
    return out.getvalue()


def data_of(buf, span: tarfmt.SampleSpan, suffix: str) -> bytes:
    off, size = span.members[suffix]
    return bytes(buf[off:off + size])


# --- the scanner ------------------------------------------------------------------------------------
def test_members_are_grouped_by_key_in_archive_order():
    payload = {"a.x": b"abc", "a.y.npy": bytes(range(256)) * 3, "b.x": b"", "b.z": b"z" * 512}
    buf = member("dir", b"", tarfile.DIRTYPE) + member("a.link", b"", tarfile.SYMTYPE) + \
        tar_bytes(list(payload.items()))
    spans, stop = tarfmt.scan_spans(buf)
    assert [s.key for s in spans] == ["a", "b"] and stop == len(buf)  # no sample from the dir or the link
    a, b = spans
    assert sorted(a.members) == ["x", "y.npy"] and sorted(b.members) == ["x", "z"]  # suffix: after the first dot
    for span in spans:
        for suffix in span.members:
            assert data_of(buf, span, suffix) == payload[f"{span.key}.{suffix}"]
    assert a.start == 1024 and a.end == a.members["y.npy"][0] + 768  # first header .. last data byte
    assert b.end == b.members["z"][0] + 512 and a.error is None and b.error is None
    # a sample's own region scans again on its own (how decode_sample_bytes reads it)
    again = list(tarfmt.scan_tar(buf[a.start:a.end]))
    assert [s.key for s in again] == ["a"] and data_of(buf[a.start:a.end], again[0], "x") == b"abc"


def test_damaged_header_is_skipped_and_the_scan_resynchronises():
    first, second = member("a.x", b"1" * 600) + member("a.y", b"2"), member("b.x", b"3") + member("b.y", b"4")
    garbage = np.random.default_rng(0).integers(0, 256, 1024, dtype=np.uint8).tobytes()
    buf = bytearray(first + garbage + b"...ustar..." + bytes(501) + second + bytes(1024))
    damage: list[str] = []
    spans = list(tarfmt.scan_tar(buf, damage=damage))
    assert [(s.key, sorted(s.members)) for s in spans] == [("a", ["x", "y"]), ("b", ["x", "y"])]
    assert damage and damage[0] == f"damaged tar header at byte {len(first)}"
    buf[len(first) + len(garbage) + 512 + 3] ^= 0x10  # now b.x's own header fails its checksum
    spans = list(tarfmt.scan_tar(bytes(buf)))
    assert [(s.key, sorted(s.members)) for s in spans] == [("a", ["x", "y"]), ("b", ["y"])]


def test_truncated_member_marks_its_sample_and_ends_the_scan():
    buf = member("a.x", b"1") + member("b.x", b"2") + member("b.y", b"3" * 2000)
    cut = len(buf) - 1000
    spans, stop = tarfmt.scan_spans(buf, 0, cut)
    assert [s.key for s in spans] == ["a", "b"] and spans[0].error is None
    assert spans[1].error == "member b.y truncated (1048 of 2000 bytes present)"
    assert stop == 2048  # b.y's header: where a reader with more bytes resumes


def test_zero_blocks_and_record_padding_end_nothing_early():
    """tarfile pads an archive to 10240 bytes; zeroed blocks in the middle are skipped too."""
    buf = member("a.x", b"1") + bytes(2048) + member("b.x", b"2") + bytes(10240)
    assert [s.key for s in tarfmt.scan_tar(buf)] == ["a", "b"]


@pytest.mark.parametrize("chunk", [512, 1536, 4096, 1 << 20])
def test_read_pieces_yields_every_sample_once_whole(tmp_path, chunk):
    rng = np.random.default_rng(1)
    payload = [(f"k{i}.{m}", rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8).tobytes())
               for i in range(6) for m in ("p", "q")]
    path = tmp_path / "t.tar"
    path.write_bytes(tar_bytes(payload))
    damage: list[str] = []
    seen = []
    for buf, spans in tarfmt.read_pieces(path, chunk, damage):
        for span in spans:
            seen.append(span.key)
            assert span.error is None
            assert [data_of(buf, span, s) for s in ("p", "q")] == \
                [d for n, d in payload if n.startswith(f"{span.key}.")]
    assert seen == [f"k{i}" for i in range(6)] and damage == []


def test_read_pieces_reports_a_truncated_file(tmp_path):
    raw = tar_bytes([("a.x", b"1" * 100), ("b.x", b"2" * 5000)])
    path = tmp_path / "t.tar"
    path.write_bytes(raw[:3000])
    damage: list[str] = []
    pieces = list(tarfmt.read_pieces(path, 1024, damage))
    spans = [s for _, sp in pieces for s in sp]
    assert [s.key for s in spans] == ["a", "b"] and "truncated" in spans[1].error
    assert damage == ["shard truncated at byte 3000"]
    with pytest.raises(OSError):
        next(tarfmt.read_pieces(tmp_path / "absent.tar", 1024, []))


# --- .npy members -------------------------------------------------------------------------------------
@pytest.mark.parametrize("array", [np.arange(12, dtype="<f4").reshape(3, 4),
                                   np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)),
                                   np.zeros((0, 5), np.float16),
                                   np.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f8")])])
def test_npy_view_maps_what_np_save_wrote(array):
    data = np.frombuffer(tarfmt.npy_bytes(array), np.uint8)  # an array buffer, as the reader holds
    view = tarfmt.npy_view(memoryview(data))
    assert view.dtype == array.dtype and view.shape == array.shape and np.array_equal(view, array)
    assert view.size == 0 or np.shares_memory(view, data)  # a view, not a copy


def test_npy_view_reads_version_2_headers():
    out = io.BytesIO()
    np.lib.format.write_array(out, np.arange(3, dtype=np.int32), version=(2, 0))
    assert tarfmt.npy_view(memoryview(out.getvalue())).tolist() == [0, 1, 2]


# --- the sample codec ---------------------------------------------------------------------------------
def video(key: str, seconds: int = 3, seed: int = 0) -> VideoRecord:
    rng = np.random.default_rng(seed)
    starts = np.array([0.0, 1.5])
    return VideoRecord(key, rng.random((seconds, FEATURE_DIM), np.float32),
                       rng.random((int(1.5 * seconds), FEATURE_DIM), np.float32),
                       (rng.random((MEL_BINS, 100 * seconds)) * -80).astype(np.float16), starts, starts + 1.0,
                       np.array([3, 1, 4, 1, 5], np.int32), np.array([0, 2, 5], np.int64))


def written(records: list[VideoRecord]) -> bytes:
    """Samples as raymcn's writer puts them in a shard (writer.write_sample on a USTAR tarfile)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for rec in records:
            writer.write_sample(tar, rec.video_id, sample.encode_record(rec))
    return out.getvalue()


def assert_same_record(a: VideoRecord, b: VideoRecord) -> None:
    assert a.video_id == b.video_id
    for name in ("feat_2d", "feat_3d", "spec", "starts", "ends", "token_ids", "token_offsets"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name


def test_sample_round_trip_through_the_writer():
    recs = [video("vid-A", 3, 0), video("vid_B", 5, 1)]
    buf = written(recs)
    with tarfile.open(fileobj=io.BytesIO(buf)) as tf:
        assert tf.getnames() == [f"{r.video_id}.{m}" for r in recs for m in sample.MEMBERS]
        info = tf.getmembers()[0]
        assert (info.mtime, info.uid, info.gid, info.mode, info.uname) == (0, 0, 0, 0o644, "")  # reproducible
    scan = check_shard(buf, ["vid-A", "vid_B"])
    assert scan.bad == [] and [s.key for s in scan.good] == ["vid-A", "vid_B"]
    for rec, got, span in zip(recs, scan.records, scan.good):
        assert_same_record(got, rec)
        region = buf[span.start:span.end]
        assert_same_record(sample.decode_sample_bytes(region, span.key, verify=True), rec)


def test_the_crc_list_holds_zlib_crc32_values():
    """The json member's checksums are zlib's CRC-32 (the fast library computing them is a drop-in):
    any tool can check a shard, and shards written before keep passing."""
    buf = written([video("vid-A", 3, 0)])
    with tarfile.open(fileobj=io.BytesIO(buf)) as tf:
        data = {m.name.split(".", 1)[1]: tf.extractfile(m).read() for m in tf.getmembers()}
    crcs = json.loads(data.pop(sample.META_MEMBER))["crc32"]
    assert crcs == {name: zlib.crc32(blob) for name, blob in data.items()}
    big = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()  # the fast path's sizes
    assert sample.crc32(big) == zlib.crc32(big) and sample.crc32(memoryview(big)[7:]) == zlib.crc32(big[7:])


def test_checker_reports_duplicates_unlisted_damaged_and_missing_samples():
    a, b, z = video("a", seed=0), video("b", seed=1), video("z", seed=2)
    buf = bytearray(written([a, b, z, a]))
    scan = check_shard(bytes(buf), ["a", "b", "c"])
    assert [s.key for s in scan.good] == ["a", "b"]
    assert dict(scan.bad) == {"z": "sample not listed in the manifest for this shard",
                              "a": "sample appears twice in the shard",
                              "c": "missing from the shard (truncated or damaged tar)"}
    off, _ = scan.good[1].members["spec.npy"]
    buf[off + 200] ^= 0xFF
    bad = dict(check_shard(bytes(buf), ["a", "b", "z"]).bad)
    assert bad["b"] == "member spec.npy fails its CRC-32 check (damaged bytes)"
    assert "b" not in dict(check_shard(bytes(buf), ["a", "b", "z"], verify=False).bad)  # CRC not checked


def test_decoding_refuses_wrong_shapes_and_dtypes():
    rec = video("a")
    members = dict(sample.encode_record(rec))
    members["spec.npy"] = tarfmt.npy_bytes(np.zeros((MEL_BINS + 1, 10), np.float16))
    buf = tar_bytes([(f"a.{m}", members[m]) for m in sample.MEMBERS])
    with pytest.raises(sample.SampleError, match="spec shape"):
        sample.decode_span(buf, next(tarfmt.scan_tar(buf)), verify=False)
    members["spec.npy"] = b"not an npy member at all"
    buf = tar_bytes([(f"a.{m}", members[m]) for m in sample.MEMBERS])
    with pytest.raises(sample.SampleError, match="bad magic"):  # tarfmt's NpyError, as a SampleError
        sample.decode_span(buf, next(tarfmt.scan_tar(buf)), verify=False)


def test_key_problem_keeps_every_member_name_in_the_ustar_field():
    assert sample.key_problem("dQw4w9WgXcQ") is None
    assert sample.key_problem("x" * 88) is None  # + ".offsets.npy" = 100 bytes
    assert sample.key_problem("x" * 89) is not None and sample.key_problem("a.b") is not None
    assert sample.key_problem("é" * 45) is not None  # bytes count, not characters
