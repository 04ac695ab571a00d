"""The Ray-free stream: read-task tables -> records, the in-memory and shard paths through one batching
function, and the import boundaries of the data path (no Ray here)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from raymcn.config import load_config
from raymcn.data import shards, stream, synthetic, tarfmt
from raymcn.train.plan import make_plan
from raymcn.data.features import collate, sample_clips
from raymcn.data.words import load_vocab

SETTINGS = synthetic.SynthSettings(videos=12, eval_clips=2, topics=3, word_dim=16, meaning_words=60,
                                   filler_words=8, video_seconds=(6.0, 10.0))
DATA_DIR = Path(stream.__file__).parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> synthetic.CorpusPaths:
    return synthetic.write_corpus(tmp_path_factory.mktemp("corpus"), SETTINGS)


@pytest.fixture(scope="module")
def shard_dir(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    shards.shards_from_layout(corpus.features_root, corpus.audio_root, corpus.captions, corpus.video_csv,
                              corpus.word_vectors, out, videos_per_shard=5, progress=False, log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def cfg():
    from raymcn.cli import preset_path

    return load_config(preset_path(), ["data.batch_size=4", "data.clips_per_video=3", "data.audio_frames=64",
                                       "data.max_words=6", "model.word_dim=16", "loss.num_clusters=2", "run.seed=5"])


def shard_records(shard_dir: Path) -> dict:
    manifest = shards.load_manifest(shard_dir)
    out = {}
    for s in manifest["shards"]:
        for vid, rec, err in stream.iter_shard_records(shard_dir / s["name"], s["videos"]):
            assert err is None
            out[vid] = rec
    return out


def same_arrays(a, b) -> bool:
    return all(getattr(a, n).tobytes() == getattr(b, n).tobytes()
               for n in ("feat_2d", "feat_3d", "spec", "starts", "ends", "token_ids", "token_offsets"))


# --- read-task tables -> records ------------------------------------------------------------------
def test_read_task_tables_give_the_records_of_the_sequential_reader(shard_dir):
    manifest = shards.load_manifest(shard_dir)
    reference = shard_records(shard_dir)
    tables = [t for s in manifest["shards"]
              for t in stream.read_shard_blocks(str(shard_dir / s["name"]), s["name"], s["videos"], 1 << 16)]
    assert len(tables) > len(manifest["shards"])  # several pieces per shard at 64 KB
    assert all(t.schema == stream.SCHEMA for t in tables)
    stats = stream.EpochStats()
    # one table of many chunks, as Ray Data may hand a block over
    records = list(stream.records_from_tables([pa.concat_tables(tables)], stats, log=None, epoch=0))
    assert [r.video_id for r in records] == [v for s in manifest["shards"] for v in s["videos"]]
    assert all(same_arrays(r, reference[r.video_id]) for r in records)
    assert (stats.videos, stats.bad_samples) == (12, 0)
    assert stats.bytes == sum(t.column("sample").chunks[0].buffers()[2].size for t in tables)
    with pytest.raises(stream.DataEpochError, match="epoch 1 received shards ordered for epoch 0"):
        next(stream.records_from_tables(tables, epoch=1))


def test_bad_samples_travel_as_rows_and_are_counted_by_shard(shard_dir, tmp_path):
    manifest = shards.load_manifest(shard_dir)
    first, second = manifest["shards"][:2]
    raw = (shard_dir / first["name"]).read_bytes()
    spans = list(tarfmt.scan_tar(raw))
    truncated = tmp_path / first["name"]
    truncated.write_bytes(raw[:spans[3].members["2d.npy"][0] + 10])  # samples 3 and 4 lost
    jobs = [(str(truncated), first["name"], first["videos"]),
            (str(tmp_path / "absent.tar"), second["name"], second["videos"])]
    logs: list[str] = []
    stats = stream.EpochStats()
    records = list(stream.records_from_tables(stream.read_shards_blocks(jobs, 1 << 20), stats, log=logs.append))
    assert [r.video_id for r in records] == first["videos"][:3]
    assert stats.bad_by_shard == {first["name"]: 2, second["name"]: 5} and stats.bad_samples == 7
    assert len(logs) == 7 and sum("shard unreadable" in line for line in logs) == 5
    assert stats.as_metrics()["bad_samples"] == 7.0


# --- one batching function for the in-memory and the shard path ---------------------------------------
def in_memory_batches_before_the_split(tv, cfg, epoch, rank, world, steps):
    """``raymcn.data.memory.TrainVideos.batches`` as it was (its own loop), as numpy batches."""
    order = np.random.default_rng([cfg.run.seed, epoch]).permutation(len(tv.records))
    mine = order[rank::world]
    per_rank = cfg.data.batch_size // world
    rng = np.random.default_rng([cfg.run.seed, epoch, rank])
    d = cfg.data
    for step in range(steps):
        chosen = [tv.records[i] for i in mine[step * per_rank:(step + 1) * per_rank]]
        clips = [sample_clips(r, d.clips_per_video, d.min_time, d.audio_frames, d.max_words, rng,
                              tv.vocab_matrix) for r in chosen]
        yield collate(clips, [r.video_id for r in chosen])


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["key"] == w["key"]
        for k in stream.TENSOR_KEYS:
            a = g[k].numpy() if hasattr(g[k], "numpy") else g[k]
            b = w[k].numpy() if hasattr(w[k], "numpy") else w[k]
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), k


@pytest.mark.parametrize("epoch,rank,world", [(0, 0, 1), (3, 1, 2)])
def test_in_memory_and_shard_paths_give_the_same_batches(corpus, shard_dir, cfg, epoch, rank, world):
    tv = stream.TrainVideos.from_layout(corpus, cfg.data.max_words)
    steps = make_plan(cfg, len(tv.records)).steps_per_epoch
    assert steps == make_plan(cfg, shards.load_manifest(shard_dir)["counts"]["videos"]).steps_per_epoch == 3
    videos = cfg.data.batch_size // world
    in_memory = list(tv.batches(cfg, epoch, rank, world, videos, steps))
    assert in_memory[0]["video"].shape == (cfg.data.batch_size // world * cfg.data.clips_per_video, 4096)
    # behaviour kept: the batches of the in-memory path's former loop
    assert_same_batches(in_memory, list(in_memory_batches_before_the_split(tv, cfg, epoch, rank, world, steps)))
    # the shard path through the same function, fed the same videos in the same order
    decoded = shard_records(shard_dir)
    order = np.random.default_rng([cfg.run.seed, epoch]).permutation(len(tv.records))
    mine = iter([decoded[tv.records[i].video_id] for i in order[rank::world]])
    stats = stream.EpochStats()
    from_shards = list(stream.batches_from_records(mine, cfg, epoch, rank, videos, steps, load_vocab(shard_dir),
                                                   stats=stats, shuffle_buffer=1))
    assert_same_batches(from_shards, in_memory)
    assert stats.unused == len(tv.records[rank::world]) - steps * cfg.data.batch_size // world


def test_a_short_stream_is_refilled_and_counted(shard_dir, cfg):
    records = list(shard_records(shard_dir).values())[:5]
    stats = stream.EpochStats()
    batches = list(stream.batches_from_records(iter(records), cfg, 0, 0, cfg.data.batch_size, 3, load_vocab(shard_dir),
                                               stats=stats))
    assert len(batches) == 3 and stats.reused == 3 * cfg.data.batch_size - 5
    with pytest.raises(RuntimeError, match="no readable video"):
        next(stream.batches_from_records(iter([]), cfg, 0, 0, cfg.data.batch_size, 1, load_vocab(shard_dir)))


# --- import boundaries ------------------------------------------------------------------------------
# raymcn modules each data-path module may import (at module level); everything points one way:
# tarfmt <- sample <- shards / stream <- reader, synthetic -> shards.
ALLOWED = {
    "tarfmt": set(),
    "sample": {"features", "tarfmt"},
    "shards": {"config", "features", "files", "sample", "words"},
    "stream": {"config", "features", "sample", "tarfmt", "words"},
    "reader": {"config", "features", "shards", "stream", "words"},
    "synthetic": {"features", "files", "shards", "words"},
}


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_data_path_imports_point_one_way(module):
    tree = ast.parse((DATA_DIR / f"{module}.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in top if isinstance(n, ast.ImportFrom) and n.module]
    ours = {n.split(".")[-1] if n.startswith("raymcn.data.") else n.split(".")[1]
            for n in names if n.startswith("raymcn.")}
    assert ours <= ALLOWED[module], ours - ALLOWED[module]
    third_party = {n.split(".")[0] for n in names} - {"raymcn"} - set(sys.stdlib_module_names)
    assert third_party <= ({"numpy", "pyarrow", "ray"} if module == "reader" else {"numpy", "pyarrow", "tqdm"})


@pytest.mark.parametrize("module", ["tarfmt", "sample", "shards", "stream", "synthetic", "reader"])
def test_importing_the_data_path_loads_no_torch(module):
    """The read tasks import stream (and reader's module); torch is for the workers' batches only."""
    code = (f"import sys, raymcn.data.{module}; "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("['ray']" if module == "reader" else "[]")
