"""Ray Data reader over tar shards: batch contract, each rank's planned batches through Ray Data at
any world size, mid-epoch starts that read nothing of the consumed part, next-epoch requests, damage.

One module-scoped local Ray instance (2 CPUs, 150 MB object store) serves every test.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import shards_of

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

from raymcn.config import ConfigError, load_config  # noqa: E402
from raymcn.data import synthetic  # noqa: E402
from raymcn.data.formats import manifest as shard_manifest
from raymcn.data.formats import tarfmt
from raymcn.data.formats.features import FEATURE_DIM, MEL_BINS  # noqa: E402
from raymcn.data.read import datasource as reader
from raymcn.data.read import order, stream
from raymcn.train.run_plan import make_plan  # noqa: E402

VIDEOS, PER_SHARD = 24, 3
SETTINGS = synthetic.SynthSettings(videos=VIDEOS, eval_clips=2, topics=3, word_dim=16, meaning_words=60,
                                   filler_words=8, video_seconds=(6.0, 10.0))


@pytest.fixture(scope="module", autouse=True)
def ray_instance(ray_local):
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    yield


@pytest.fixture(scope="module")
def shard_dir(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    shards_of(corpus, out, videos_per_shard=PER_SHARD)
    return out


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    from raymcn.cli import preset_path

    return load_config(preset_path(), ["data.batch_size=8", "data.clips_per_video=4", "data.audio_frames=64",
                                       "data.max_words=6", "model.word_dim=16", "loss.num_clusters=4",
                                       "scale.num_workers=2", "run.seed=3"])


def stream_of(shard_dir, cfg, rank=0, world=1, epochs=3, **kw):
    manifest = shard_manifest.load_manifest(shard_dir)
    index = order.build_index(shard_dir, manifest)
    steps = make_plan(cfg, len(index)).steps_per_epoch
    return reader.RankStream(shard_dir, index, cfg, rank, world, steps_per_epoch=steps, epochs=epochs, **kw), index, steps


def ray_free_rows(shard_dir, index, cfg, epoch, rank, world, steps, start=0):
    jobs = stream.step_jobs(index, order.rank_steps(cfg.run.seed, epoch, len(index), cfg.data.batch_size, steps,
                                                    rank, world, start))
    return [b for b, _ in stream.step_rows(stream.read_steps(str(shard_dir), jobs, cfg, epoch))]


def test_batches_follow_the_contract(shard_dir, cfg):
    rank_stream, index, steps = stream_of(shard_dir, cfg)
    assert steps == VIDEOS // cfg.data.batch_size
    batches, stats = rank_stream.epoch(0)
    batches = list(batches)
    assert len(batches) == steps
    b = cfg.data.batch_size * cfg.data.clips_per_video
    import torch

    for batch in batches:
        assert set(batch) == {"video", "audio", "nframes", "text", "nwords", "key"}
        assert batch["video"].shape == (b, 2 * FEATURE_DIM) and batch["video"].dtype == torch.float32
        assert batch["audio"].shape == (b, MEL_BINS, cfg.data.audio_frames) and batch["audio"].dtype == torch.float16
        assert batch["nframes"].shape == (b,) and batch["nframes"].dtype == torch.int32
        assert batch["text"].shape == (b, cfg.data.max_words, 16) and batch["text"].dtype == torch.float32
        assert len(batch["key"]) == b
        vids = [k.split("#")[0] for k in batch["key"]]
        assert vids == [v for v in dict.fromkeys(vids) for _ in range(cfg.data.clips_per_video)]  # video-major
        norms = batch["video"][:, :FEATURE_DIM].norm(dim=1)
        assert torch.allclose(norms[norms > 0], torch.ones_like(norms[norms > 0]), atol=1e-4)
    assert stats.bad_samples == 0 and stats.videos == steps * cfg.data.batch_size


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ray_data_delivers_the_planned_batches_of_every_rank_in_order(shard_dir, cfg, world):
    """Through Ray Data (read tasks in other processes, several in flight) each rank gets exactly the
    Ray-free batches of its part of every step, in step order, whatever the world size."""
    for rank in range(world):
        rank_stream, index, steps = stream_of(shard_dir, cfg, rank, world, task_mb=1e-6)  # a task per step
        for epoch in (0, 1):
            got = [{k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in b.items()}
                   for b in rank_stream.epoch(epoch)[0]]
            want = ray_free_rows(shard_dir, index, cfg, epoch, rank, world, steps)
            assert len(got) == len(want) == steps
            for g, w in zip(got, want):
                assert list(g["key"]) == list(w["key"])
                assert all(np.array_equal(g[k], w[k]) for k in stream.TENSOR_KEYS)


def test_a_resumed_epoch_reads_only_the_steps_after_the_checkpoint(shard_dir, cfg):
    rank_stream, index, steps = stream_of(shard_dir, cfg, epochs=2)
    late = rank_stream.jobs(1, start=steps - 1)
    assert [j.step for j in late] == [2 * steps - 1]  # the planned reads: the last step's videos only
    source = reader.RankStepsDatasource(shard_dir, late, cfg, 1)
    assert source.estimate_inmemory_data_size() == late[0].nbytes
    batches, stats = rank_stream.epoch(1, start=steps - 1)
    got = list(batches)
    assert len(got) == 1 and stats.videos == cfg.data.batch_size  # nothing of the consumed part was read
    want = ray_free_rows(shard_dir, index, cfg, 1, 0, 1, steps, start=steps - 1)
    assert list(got[0]["key"]) == list(want[0]["key"])
    with pytest.raises(RuntimeError, match="epochs must be read in order"):
        rank_stream._next = reader._OpenEpoch(0, 0, iter(()))
        rank_stream.epoch(1, 0)


def test_stream_requests_each_next_epoch_before_the_loop_asks(shard_dir, cfg):
    epochs = 3
    rank_stream, index, steps = stream_of(shard_dir, cfg, epochs=epochs)
    ahead, counted = [], []
    for epoch in range(epochs):
        batches, stats = rank_stream.epoch(epoch)
        keys = [tuple(b["key"]) for b in batches]
        ahead.append(rank_stream.requested_ahead)  # asked of Ray Data before stream.epoch(epoch + 1)
        counted.append(stats.videos)
        assert keys == [tuple(b["key"]) for b in ray_free_rows(shard_dir, index, cfg, epoch, 0, 1, steps)]
    assert ahead == [1, 2, None]  # nothing is requested past the last epoch
    assert counted == [steps * cfg.data.batch_size] * epochs  # each epoch's counters are its own


def corrupt(src: Path, dst: Path) -> dict[str, int]:
    """Copy the shards and damage three of them; returns the bad videos per shard name."""
    shutil.copytree(src, dst)
    manifest = shard_manifest.load_manifest(dst)
    a, b, c = (dst / s["name"] for s in manifest["shards"][:3])
    raw = a.read_bytes()
    spans = list(tarfmt.scan_tar(raw))
    a.write_bytes(raw[:spans[1].members["3d.npy"][0] + 100])  # truncated: samples 1 and 2 lost
    raw = bytearray(b.read_bytes())
    spans = list(tarfmt.scan_tar(bytes(raw)))
    raw[spans[0].members["spec.npy"][0] + 300] ^= 0xFF  # flipped bytes: CRC fails
    b.write_bytes(bytes(raw))
    raw = c.read_bytes()
    spans = list(tarfmt.scan_tar(raw))
    data_off, size = spans[2].members["tokens.npy"]
    c.write_bytes(raw[:data_off - 512] + raw[data_off + size + (-size % 512):])  # a member removed
    first, second, third = manifest["shards"][:3]
    return {a.name: set(first["videos"][1:]), b.name: {second["videos"][0]}, c.name: {third["videos"][2]}}


def test_corrupted_shards_are_survived_and_counted(shard_dir, cfg, tmp_path):
    """Every epoch reads all 24 videos (3 steps of 8): the 4 damaged ones are counted by shard,
    logged with it, and their slots refilled; both ranks still run every step."""
    bad = corrupt(shard_dir, tmp_path / "damaged")
    d = tmp_path / "damaged"
    total = stream.EpochStats()
    logs: list[str] = []
    for rank in range(2):
        rank_stream, index, steps = stream_of(d, cfg, rank, 2, log=logs.append)
        batches, stats = rank_stream.epoch(0)
        assert sum(1 for _ in batches) == steps
        total.bad_samples += stats.bad_samples
        total.videos += stats.videos
        for shard, n in stats.bad_by_shard.items():
            total.bad_by_shard[shard] = total.bad_by_shard.get(shard, 0) + n
    assert total.bad_by_shard == {name: len(v) for name, v in bad.items()} and total.bad_samples == 4
    assert total.videos == VIDEOS - 4
    assert len(logs) == 4 and all(any(name in line for name in bad) for line in logs)
    assert any("CRC-32" in line for line in logs) and any("missing" in line for line in logs)


def test_missing_shard_file_is_counted(shard_dir, cfg, tmp_path):
    d = tmp_path / "missing"
    shutil.copytree(shard_dir, d)
    manifest = shard_manifest.load_manifest(d)
    (d / manifest["shards"][0]["name"]).unlink()
    rank_stream, _, steps = stream_of(d, cfg, log=None)
    batches, stats = rank_stream.epoch(0)
    assert sum(1 for _ in batches) == steps
    assert (stats.videos, stats.bad_samples) == (VIDEOS - PER_SHARD, PER_SHARD)


def test_helpers_raise_clear_errors(shard_dir, cfg, tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        shard_manifest.load_manifest(tmp_path)
    videos = shard_manifest.load_manifest(shard_dir)["counts"]["videos"]
    with pytest.raises(ConfigError, match="fewer than one step"):
        make_plan(cfg.replace({"data.batch_size": 64}), videos)
    assert make_plan(cfg.replace({"schedule.steps_per_epoch": 1}), videos).steps_per_epoch == 1
    with pytest.raises(ValueError, match="holds no video of step"):
        order.rank_steps(cfg.run.seed, 0, videos, 2, 3, 2, 3)


def test_read_webdataset_reads_the_shards_too(shard_dir):
    """The shards are plain WebDataset tars: Ray's own reader decodes them (slowly) as well."""
    manifest = shard_manifest.load_manifest(shard_dir)
    first = manifest["shards"][0]
    ds = ray.data.read_webdataset(str(shard_dir / first["name"]))
    row = ds.take(1)[0]
    ours = next(stream.iter_shard_records(shard_dir / first["name"]))[1]
    assert row["__key__"] == ours.video_id
    assert np.array_equal(row["3d.npy"], ours.feat_3d)


def test_shards_of_the_v1_writer_load_through_ray_data(cfg):
    """The committed shards of the first writer (tests/data/shards-v1, a manifest without byte
    spans): the index is found from the tar headers, and Ray Data reads their videos."""
    v1 = Path(__file__).parent / "data" / "shards-v1"
    manifest = shard_manifest.load_manifest(v1)
    assert "spans" not in manifest["shards"][0]
    index = order.build_index(v1, manifest)
    records = {}
    for v in range(len(index)):
        job = stream.step_jobs(index, [order.StepSlice(0, 0, 0, (v,))])[0]
        (slot,) = stream.read_step_records(v1, job)
        records[slot.video_id] = slot.record
    decoded = {vid: {name: {"dtype": str(a.dtype), "shape": list(a.shape),
                            "sha256": hashlib.sha256(a.tobytes()).hexdigest()}
                     for name in ("feat_2d", "feat_3d", "spec", "starts", "ends", "token_ids", "token_offsets")
                     for a in [getattr(rec, name)]} for vid, rec in records.items()}
    assert decoded == json.loads((v1.parent / "shards-v1.expected.json").read_text())
    small = cfg.replace({"data.batch_size": 3, "scale.num_workers": 1})
    rank_stream = reader.RankStream(v1, index, small, 0, 1, steps_per_epoch=1, epochs=1)
    batches, stats = rank_stream.epoch(0)
    (batch,) = list(batches)
    assert {k.split("#")[0] for k in batch["key"]} == set(records) and stats.videos == 3


def test_a_read_task_is_cut_by_the_bytes_it_emits_as_well_as_those_it_reads(shard_dir, cfg):
    """Clips multiply a short video's bytes (0.33 MB in, 3.8 MB of rows out at the paper's 32 clips):
    a task closes once the larger of each step's read bytes and row bytes adds up to task_mb, so a
    task never holds more rows than that, whatever the videos' size."""
    cfg = cfg.replace({"data.clips_per_video": 32})  # the paper's clips: the rows outweigh the videos
    index = order.build_index(shard_dir, shard_manifest.load_manifest(shard_dir))
    steps = make_plan(cfg, len(index)).steps_per_epoch
    jobs = stream.step_jobs(index, order.rank_steps(cfg.run.seed, 0, len(index), cfg.data.batch_size, steps, 0, 1))
    weight = [stream.step_row_nbytes(cfg, len(j.videos)) for j in jobs]
    assert all(w > 2 * j.nbytes for w, j in zip(weight, jobs))
    budget = weight[0] + weight[1] - 1  # two steps' worth
    groups = reader.RankStepsDatasource(shard_dir, jobs, cfg, 0, task_mb=budget / 2**20).task_groups()
    assert [job for g in groups for job in g] == jobs
    assert [len(g) for g in groups[:-1]] == [2] * (len(groups) - 1) and 1 <= len(groups[-1]) <= 2
