"""The Ray-free data path: the data order (a function of seed, epoch and step at every world size),
the read tasks' step rows, the in-memory and shard paths giving the same batches, damage, and the
import boundaries of the data path (no Ray here)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import shards_of

from bench.readers import LocalStream, TrainVideos
from raymcn.config import load_config
from raymcn.data import synthetic
from raymcn.data.formats import manifest as shard_manifest
from raymcn.data.formats import tarfmt
from raymcn.data.formats.sample import decode_sample_bytes
from raymcn.data.formats.words import load_vocab
from raymcn.data.read import order, stream
from raymcn.train.run_plan import make_plan

SETTINGS = synthetic.SynthSettings(videos=12, eval_clips=2, topics=3, word_dim=16, meaning_words=60,
                                   filler_words=8, video_seconds=(6.0, 10.0))
DATA_DIR = Path(stream.__file__).parents[1]  # raymcn/data


@pytest.fixture(scope="module")
def shard_dir(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    shards_of(corpus, out, videos_per_shard=5)
    return out


@pytest.fixture(scope="module")
def cfg():
    from raymcn.cli import preset_path

    return load_config(preset_path(), ["data.batch_size=4", "data.clips_per_video=3", "data.audio_frames=64",
                                       "data.max_words=6", "model.word_dim=16", "loss.num_clusters=2", "run.seed=5"])


def shard_records(shard_dir: Path) -> dict:
    manifest = shard_manifest.load_manifest(shard_dir)
    out = {}
    for s in manifest["shards"]:
        for vid, rec, err in stream.iter_shard_records(shard_dir / s["name"], s["videos"]):
            assert err is None
            out[vid] = rec
    return out


def same_arrays(a, b) -> bool:
    return all(getattr(a, n).tobytes() == getattr(b, n).tobytes()
               for n in ("feat_2d", "feat_3d", "spec", "starts", "ends", "token_ids", "token_offsets"))


# --- the data order: a function of (seed, epoch, step) alone ----------------------------------------
def index_of(shard_dir):
    return order.build_index(shard_dir, shard_manifest.load_manifest(shard_dir))


def rank_rows(shard_dir, index, cfg, epoch, rank, world, steps, start=0):
    """What a rank's read tasks deliver, the text as the run's text encoder asks for it."""
    from raymcn.model.parts import text_in_bf16

    jobs = stream.step_jobs(index, order.rank_steps(cfg.run.seed, epoch, len(index), cfg.data.batch_size, steps,
                                                    rank, world, start))
    text_bf16 = text_in_bf16(cfg.model, cfg.scale.use_gpu)
    return list(stream.step_rows(stream.read_steps(str(shard_dir), jobs, cfg, epoch, text_bf16=text_bf16)))


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert list(g["key"]) == list(w["key"])
        for k in stream.TENSOR_KEYS:
            a = g[k].numpy() if hasattr(g[k], "numpy") else g[k]
            b = w[k].numpy() if hasattr(w[k], "numpy") else w[k]
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), k


def test_a_step_holds_the_same_videos_and_clips_at_every_world_size(shard_dir, cfg):
    """The batch of a global step is a function of (seed, epoch, step): 1, 2 or 3 ranks together
    read exactly the world-1 batch, bitwise, each rank its rotating share."""
    index = index_of(shard_dir)
    steps = make_plan(cfg, len(index)).steps_per_epoch
    whole = [b for b, _ in rank_rows(shard_dir, index, cfg, 2, 0, 1, steps)]
    for world in (2, 3):
        parts = [rank_rows(shard_dir, index, cfg, 2, r, world, steps) for r in range(world)]
        for k in range(steps):
            shares = [len(parts[r][k][0]["key"]) // cfg.data.clips_per_video for r in range(world)]
            assert shares == [order.share(cfg.data.batch_size, r, world, 2 * steps + k) for r in range(world)]
            joined = {key: np.concatenate([parts[r][k][0][key] for r in range(world)]) for key in stream.TENSOR_KEYS}
            joined["key"] = [x for r in range(world) for x in parts[r][k][0]["key"]]
            assert_same_batches([joined], [whole[k]])


def test_the_order_changes_with_the_epoch_and_the_seed_and_a_resume_reads_the_tail(shard_dir, cfg):
    index = index_of(shard_dir)
    steps = make_plan(cfg, len(index)).steps_per_epoch
    epoch0 = rank_rows(shard_dir, index, cfg, 0, 0, 1, steps)
    videos = [tuple(b["key"]) for b, _ in epoch0]
    assert videos != [tuple(b["key"]) for b, _ in rank_rows(shard_dir, index, cfg, 1, 0, 1, steps)]
    assert videos != [tuple(b["key"]) for b, _ in rank_rows(shard_dir, index, cfg.replace({"run.seed": 6}), 0, 0, 1,
                                                             steps)]
    tail = rank_rows(shard_dir, index, cfg, 0, 0, 1, steps, start=2)  # a run resumed after step 2
    assert [info.step for _, info in tail] == [2]
    assert_same_batches([b for b, _ in tail], [b for b, _ in epoch0[2:]])
    seen = [k.split("#")[0] for b, _ in epoch0 for k in b["key"][::cfg.data.clips_per_video]]
    assert len(seen) == len(set(seen)) == steps * cfg.data.batch_size  # an epoch reads a video at most once


@pytest.mark.parametrize("epoch,rank,world,start", [(0, 0, 1, 0), (3, 1, 2, 1)])
def test_in_memory_and_shard_paths_give_the_same_batches(corpus, shard_dir, cfg, epoch, rank, world, start):
    tv = TrainVideos.from_layout(corpus, cfg.data.max_words)
    index = index_of(shard_dir)
    assert [r.video_id for r in tv.records] == list(index.ids)  # both sorted by id, whatever the sharding
    steps = make_plan(cfg, len(tv.records)).steps_per_epoch
    assert steps == 3
    in_memory = list(tv.batches(cfg, epoch, rank, world, steps, start))
    from_shards = [b for b, _ in rank_rows(shard_dir, index, cfg, epoch, rank, world, steps, start)]
    assert len(in_memory) == steps - start
    assert_same_batches(from_shards, in_memory)
    # the in-process reader (bench/overhead.py's Ray-free arms) gives them too, with its counters
    local, stats = LocalStream(shard_dir, index, cfg, rank, world, steps_per_epoch=steps).epoch(epoch, start)
    assert_same_batches(list(local), in_memory)
    assert stats.videos == sum(len(b["key"]) for b in in_memory) // cfg.data.clips_per_video


def test_bf16_bits_round_as_torch_does():
    import torch

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(100_000) * 10.0 ** rng.integers(-40, 38, 100_000),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-45, -1e-45], np.float32)])
    ties = (rng.integers(0, 1 << 16, 1000, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # exactly halfway
    x = np.concatenate([x, ties[np.isfinite(ties)]]).astype(np.float32)
    want = torch.from_numpy(x).to(torch.bfloat16)
    got = torch.from_numpy(stream.bf16_bits(x).view(np.int16)).view(torch.bfloat16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and nan.sum() == 1  # a NaN stays a NaN (torch's bits vary)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))  # the rest bit for bit


def test_gpu_runs_get_text_in_bf16_and_every_other_number_unchanged(corpus, shard_dir, cfg):
    """On GPU (bf16 autocast) the batches carry text as bfloat16: the fp32 batch's text rounded as
    autocast rounds it, every other array bit for bit the same; both data paths agree."""
    import torch

    gpu = cfg.replace({"scale.use_gpu": True})
    index = index_of(shard_dir)
    steps = make_plan(cfg, len(index)).steps_per_epoch
    fp32 = [stream.to_tensors(b) for b, _ in rank_rows(shard_dir, index, cfg, 1, 0, 2, steps)]
    bf16 = [stream.to_tensors(b) for b, _ in rank_rows(shard_dir, index, gpu, 1, 0, 2, steps)]
    in_memory = list(TrainVideos.from_layout(corpus, cfg.data.max_words).batches(gpu, 1, 0, 2, steps))
    for a, b, c in zip(fp32, bf16, in_memory, strict=True):
        assert b["text"].dtype == c["text"].dtype == torch.bfloat16
        assert torch.equal(b["text"], a["text"].to(torch.bfloat16)) and torch.equal(c["text"], b["text"])
        for k in ("video", "audio", "nframes"):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_the_model_computes_the_same_from_bf16_text_under_autocast():
    """Why bf16 text changes nothing: the text branch starts with a Linear, which autocast feeds
    bf16 values; given bf16 text it computes exactly what it computed from fp32 text."""
    import torch

    from raymcn.config import ModelConfig
    from raymcn.model.mcn import MCN

    torch.manual_seed(0)
    model = MCN(ModelConfig(video_dim=64, word_dim=16, embed_dim=32, audio_channels=(8, 8, 8, 8, 8), recon_hidden=16))
    text = torch.randn(5, 6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = model({"text": text}, ["text"])
        b = model({"text": text.to(torch.bfloat16)}, ["text"])
    assert torch.equal(a["text"], b["text"]) and torch.equal(a["recon_text"][0], b["recon_text"][0])


def test_the_index_from_tar_headers_equals_the_manifests_spans(shard_dir):
    manifest = shard_manifest.load_manifest(shard_dir)
    assert all(len(s["spans"]) == len(s["videos"]) for s in manifest["shards"])
    without = {**manifest, "shards": [{k: v for k, v in s.items() if k != "spans"} for s in manifest["shards"]]}
    a, b = order.build_index(shard_dir, manifest), order.build_index(shard_dir, without)
    assert list(a.ids) == list(b.ids) == sorted(a.ids)
    assert np.array_equal(a.start, b.start) and np.array_equal(a.end, b.end) and np.array_equal(a.shard, b.shard)
    for vid, shard, start, end in zip(a.ids, a.shard, a.start, a.end):  # each range decodes to its video alone
        blob = (shard_dir / a.shard_names[shard]).read_bytes()[start:end]
        assert decode_sample_bytes(blob, vid, verify=True).video_id == vid


def test_read_ranges_returns_each_range_whatever_the_order_and_gaps(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 1 << 18, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    ranges = [(5000, 9000), (10, 20), (8000, 200_000), (200_100, 300_000), (262_000, 262_200)]
    for gap in (0, 1 << 16):
        got = tarfmt.read_ranges(tmp_path / "f", ranges, merge_gap=gap)
        for (a, b), g in zip(ranges, got):
            assert np.array_equal(g, data[a:min(b, len(data))])  # the last one runs past the end: short
    # the read-ahead hint never fails a read: ranges past the end, empty ones, a file that is gone
    tarfmt.advise_ranges(tmp_path / "f", [*ranges, (300, 300), (1 << 40, (1 << 40) + 10)])
    tarfmt.advise_ranges(tmp_path / "gone", ranges)
    assert all(np.array_equal(g, data[a:min(b, len(data))])
               for (a, b), g in zip(ranges, tarfmt.read_ranges(tmp_path / "f", ranges)))


# --- damage ----------------------------------------------------------------------------------------------
def damaged_copy(shard_dir, dst):
    """Copy the shards; truncate the first (its last 2 samples lost), flip a byte in one sample of
    the second, delete the third. Returns {shard: bad videos}."""
    shutil.copytree(shard_dir, dst)
    manifest = shard_manifest.load_manifest(dst)
    a, b, c = manifest["shards"][:3]
    raw = (dst / a["name"]).read_bytes()
    spans = list(tarfmt.scan_tar(raw))
    (dst / a["name"]).write_bytes(raw[:spans[3].members["2d.npy"][0] + 10])
    raw = bytearray((dst / b["name"]).read_bytes())
    spans = list(tarfmt.scan_tar(bytes(raw)))
    raw[spans[1].members["spec.npy"][0] + 100] ^= 0xFF
    (dst / b["name"]).write_bytes(bytes(raw))
    (dst / c["name"]).unlink()
    return {a["name"]: set(a["videos"][3:]), b["name"]: {b["videos"][1]}, c["name"]: set(c["videos"])}


def test_bad_samples_are_counted_by_shard_and_refilled_from_their_step(shard_dir, cfg, tmp_path):
    bad = damaged_copy(shard_dir, tmp_path / "damaged")
    index = index_of(tmp_path / "damaged")
    steps = make_plan(cfg, len(index)).steps_per_epoch
    logs: list[str] = []
    stats = stream.EpochStats()
    batches = []
    for batch, info in rank_rows(tmp_path / "damaged", index, cfg, 0, 0, 1, steps):
        stats.add_step(info, log=logs.append)
        batches.append(batch)
    read = {k.split("#")[0] for b in batches for k in b["key"]}
    expected_bad = {v for vs in bad.values() for v in vs} & set(
        str(index.ids[v]) for s in order.rank_steps(cfg.run.seed, 0, len(index), cfg.data.batch_size, steps, 0, 1)
        for v in s.videos)
    assert stats.bad_samples == len(expected_bad) > 0
    assert stats.bad_by_shard == {s: len(vs & expected_bad) for s, vs in bad.items() if vs & expected_bad}
    assert not read & expected_bad  # a bad video never reaches a batch
    assert all(len(b["key"]) == cfg.data.batch_size * cfg.data.clips_per_video for b in batches)  # slots refilled
    assert stats.videos == steps * cfg.data.batch_size - len(expected_bad)
    assert len(logs) == len(expected_bad) and all(" in shard " in line for line in logs)
    assert any("CRC-32" in line for line in logs) and any("unreadable" in line for line in logs)
    assert stats.as_metrics() == {"bad_samples": float(len(expected_bad)), "videos_read": float(stats.videos)}


def test_a_step_without_a_readable_video_takes_the_previous_steps_or_fails_naming_them(shard_dir, cfg):
    records = list(shard_records(shard_dir).values())
    vocab = load_vocab(shard_dir).matrix
    slots = [stream.SlotRecord("x", "shard-000009.tar", None, "shard unreadable: gone")] * 2
    batch, used = stream.assemble_step(slots, 0, cfg, 0, vocab, fallback=records[:1])
    assert [r.video_id for r in used] == [records[0].video_id] * 2
    with pytest.raises(RuntimeError, match="no readable video.*x in shard-000009.tar: shard unreadable"):
        stream.assemble_step(slots, 0, cfg, 0, vocab)


# --- import boundaries ------------------------------------------------------------------------------
# raymcn modules each data-path module may import (at module level); everything points one way:
# tarfmt <- sample <- shards / order <- stream <- reader, synthetic -> shards; tarinput -> shards.
ALLOWED = {
    "formats/tarfmt": set(),
    "formats/sample": {"config", "features", "tarfmt"},
    "formats/manifest": {"config", "sample"},
    "read/order": {"tarfmt"},
    "write/tarinput": {"features"},
    "write/captions": {"features", "files", "manifest"},
    "write/writer": {"captions", "features", "files", "sample", "words"},
    "write/shards": {"captions", "disk_space", "features", "files", "manifest", "sample", "shard_plan", "sources",
                     "vocab", "words", "write", "writer"},
    "read/stream": {"config", "features", "order", "sample", "tarfmt", "words"},
    "read/datasource": {"config", "order", "stream"},
    "synthetic": {"features", "files", "manifest", "shards", "words"},
}


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_data_path_imports_point_one_way(module):
    tree = ast.parse((DATA_DIR / f"{module}.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in top if isinstance(n, ast.ImportFrom) and n.module]
    names += [f"{n.module}.{a.name}" for n in top if isinstance(n, ast.ImportFrom) and n.module  # from raymcn.data.write import captions
              and n.module.count(".") == 2 and n.module.startswith("raymcn.data.") for a in n.names]
    ours = {n.split(".")[-1] if n.startswith("raymcn.data.") else n.split(".")[1]
            for n in names if n.startswith("raymcn.")}
    assert ours <= ALLOWED[module], ours - ALLOWED[module]
    third_party = {n.split(".")[0] for n in names} - {"raymcn"} - set(sys.stdlib_module_names)
    # no torch in the data path (the read tasks must not load it); isal: the fast CRC-32
    assert third_party <= ({"numpy", "pyarrow", "ray"} if module == "read/datasource"
                           else {"numpy", "pyarrow", "tqdm", "isal"})


@pytest.mark.parametrize("module", ["formats.tarfmt", "formats.sample", "read.order", "write.tarinput", "write.shards",
                                    "read.stream", "synthetic", "read.datasource"])
def test_importing_the_data_path_loads_no_torch(module):
    """The read tasks import stream (and the datasource's module); torch is for the workers' batches only."""
    code = (f"import sys, raymcn.data.{module}; "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("['ray']" if module == "read.datasource" else "[]")
