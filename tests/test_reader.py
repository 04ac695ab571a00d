"""Ray Data reader over tar shards: batch contract, per-rank disjointness, per-epoch shard order, damage.

One module-scoped local Ray instance (2 CPUs, 100 MB object store) serves every test.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

from ray.data import DataContext  # noqa: E402

from raymcn.config import ConfigError, load_config  # noqa: E402
from raymcn.data import reader, shards, stream, synthetic, tarfmt  # noqa: E402
from raymcn.data.features import FEATURE_DIM, MEL_BINS  # noqa: E402
from raymcn.data.words import load_vocab  # noqa: E402
from raymcn.train.plan import make_plan  # noqa: E402

VIDEOS, PER_SHARD = 24, 3
SETTINGS = synthetic.SynthSettings(videos=VIDEOS, eval_clips=2, topics=3, word_dim=16, meaning_words=60,
                                   filler_words=8, video_seconds=(6.0, 10.0))


@pytest.fixture(scope="module", autouse=True)
def ray_instance(ray_local):
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    yield


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    corpus = synthetic.write_corpus(tmp_path_factory.mktemp("corpus"), SETTINGS)
    out = tmp_path_factory.mktemp("shards")
    shards.shards_from_layout(corpus.features_root, corpus.audio_root, corpus.captions, corpus.video_csv,
                              corpus.word_vectors, out, videos_per_shard=PER_SHARD, progress=False,
                              log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    from raymcn.cli import preset_path

    return load_config(preset_path(), ["data.batch_size=8", "data.clips_per_video=4", "data.audio_frames=64",
                                       "data.max_words=6", "model.word_dim=16", "loss.num_clusters=4",
                                       "scale.num_workers=2", "run.seed=3"])


def consume_split(its, fn):
    """Run fn(rank, iterator) for every split concurrently (a split must be consumed in parallel)."""
    out, errors = {}, []

    def run(rank):
        try:
            out[rank] = fn(rank, its[rank])
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(its))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a split consumer did not finish within 300 s"
    if errors:
        raise errors[0]
    return out


def test_batches_follow_the_contract(shard_dir, cfg):
    manifest = shards.load_manifest(shard_dir)
    vocab = load_vocab(shard_dir)
    steps = make_plan(cfg, manifest["counts"]["videos"]).steps_per_epoch
    assert steps == VIDEOS // cfg.data.batch_size
    ds = reader.build_dataset(shard_dir, cfg)
    stats = stream.EpochStats()
    batches = list(reader.iter_batches(ds, cfg, epoch=0, rank=0, videos=cfg.data.batch_size, steps=steps, vocab=vocab,
                                       stats=stats))
    assert len(batches) == steps
    b = cfg.data.batch_size * cfg.data.clips_per_video
    import torch

    for batch in batches:
        assert set(batch) == {"video", "audio", "nframes", "text", "key"}
        assert batch["video"].shape == (b, 2 * FEATURE_DIM) and batch["video"].dtype == torch.float32
        assert batch["audio"].shape == (b, MEL_BINS, cfg.data.audio_frames) and batch["audio"].dtype == torch.float16
        assert batch["nframes"].shape == (b,) and batch["nframes"].dtype == torch.int32
        assert batch["text"].shape == (b, cfg.data.max_words, 16) and batch["text"].dtype == torch.float32
        assert len(batch["key"]) == b
        vids = [k.split("#")[0] for k in batch["key"]]
        assert vids == [v for v in dict.fromkeys(vids) for _ in range(cfg.data.clips_per_video)]  # video-major
        norms = batch["video"][:, :FEATURE_DIM].norm(dim=1)
        assert torch.allclose(norms[norms > 0], torch.ones_like(norms[norms > 0]), atol=1e-4)
    assert stats.bad_samples == 0 and stats.videos >= steps * cfg.data.batch_size


def test_clip_sampling_is_deterministic_per_seed_epoch_rank(shard_dir, cfg):
    """Same (seed, epoch, rank) and same videos -> the same clips (generator default_rng([seed, epoch, rank]))."""
    from raymcn.data.features import collate, sample_clips

    vocab = load_vocab(shard_dir)
    ds = reader.build_dataset(shard_dir, cfg)
    batch = next(reader.iter_batches(ds, cfg, epoch=2, rank=1, videos=cfg.data.batch_size // 2, steps=1, vocab=vocab,
                                     shuffle_buffer=1))  # buffer 1: videos in stream order
    ids = list(dict.fromkeys(k.split("#")[0] for k in batch["key"]))
    records = {r.video_id: r for r in reader.iter_records(reader.build_dataset(shard_dir, cfg))}
    rng = np.random.default_rng([cfg.run.seed, 2, 1])
    d = cfg.data
    clips = [sample_clips(records[v], d.clips_per_video, d.min_time, d.audio_frames, d.max_words, rng,
                          vocab.matrix) for v in ids]
    expected = collate(clips, ids)
    assert np.array_equal(batch["video"].numpy(), expected["video"])
    assert np.array_equal(batch["audio"].numpy(), expected["audio"])
    assert np.array_equal(batch["text"].numpy(), expected["text"])


def test_two_ranks_are_disjoint_and_cover_everything(shard_dir, cfg):
    vocab = load_vocab(shard_dir)
    steps = make_plan(cfg, shards.load_manifest(shard_dir)["counts"]["videos"]).steps_per_epoch
    its = reader.build_dataset(shard_dir, cfg).streaming_split(2, equal=True)  # what Ray Train's DataConfig does
    every = sorted(v for s in shards.load_manifest(shard_dir)["shards"] for v in s["videos"])
    for epoch in range(2):
        def run(rank, it, epoch=epoch):
            seen = []
            for batch in reader.iter_batches(it, cfg, epoch, rank, cfg.data.batch_size // 2, steps, vocab):
                seen += list(dict.fromkeys(k.split("#")[0] for k in batch["key"]))
            return seen

        seen = consume_split(its, run)
        assert len(seen[0]) == len(seen[1]) == steps * cfg.data.batch_size // 2
        assert not set(seen[0]) & set(seen[1])
        assert len(set(seen[0])) == len(seen[0])  # no video twice within a rank either
        assert sorted(seen[0] + seen[1]) == every


@pytest.mark.parametrize("world", [3, 1])
def test_any_world_reads_every_video_once_per_epoch_with_rotating_shares(shard_dir, cfg, world):
    """An elastic group that restarted with 3 or 1 workers: each rank takes its plan share per step
    (batch 8 over 3 ranks: 3, 3, 2, rotating), and the epoch still reads every video exactly once."""
    import functools

    vocab = load_vocab(shard_dir)
    plan = make_plan(cfg, shards.load_manifest(shard_dir)["counts"]["videos"])
    its = reader.build_dataset(shard_dir, cfg).streaming_split(world, equal=True)  # as Ray Train splits it
    every = sorted(v for s in shards.load_manifest(shard_dir)["shards"] for v in s["videos"])

    def run(rank, it):
        per_step = []
        for batch in reader.iter_batches(it, cfg, 0, rank, functools.partial(plan.share, rank, world),
                                         plan.steps_per_epoch, vocab):
            per_step.append(list(dict.fromkeys(k.split("#")[0] for k in batch["key"])))
        return per_step

    seen = consume_split(its, run)
    for step in range(plan.steps_per_epoch):
        assert [len(seen[r][step]) for r in range(world)] == list(plan.shares(world, step))
    videos = [v for r in range(world) for step in seen[r] for v in step]
    assert sorted(videos) == every  # each once: none twice, none left out


def test_shard_order_changes_every_epoch(shard_dir, cfg):
    manifest = shards.load_manifest(shard_dir)
    names = [s["name"] for s in manifest["shards"]]
    ds = reader.build_dataset(shard_dir, cfg, task_mb=1e-6)  # one read task per shard
    ds.context.execution_options.preserve_order = True  # output order = read-task order
    orders = []
    for epoch in range(3):  # each iteration is one execution = one epoch
        shard_seq = []
        for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for name in table.column("shard").to_pylist():
                if not shard_seq or shard_seq[-1] != name:
                    shard_seq.append(name)
        assert shard_seq == [names[i] for i in reader.shard_order(cfg.run.seed, epoch, len(names))]
        orders.append(shard_seq)
    assert orders[0] != orders[1] != orders[2]
    resumed = reader.ShardDatasource(shard_dir, manifest, cfg.run.seed, start_epoch=2)
    planned = [f.rsplit("/", 1)[1] for t in resumed.get_read_tasks(1) for f in t.metadata.input_files]
    assert planned == orders[2]  # a run resumed at epoch 2 continues the sequence
    small_tasks = reader.ShardDatasource(shard_dir, manifest, cfg.run.seed, task_mb=1e-6)  # one shard per task
    assert [len(t.metadata.input_files) for t in small_tasks.get_read_tasks(1)] == [1] * len(names)


def test_announced_epoch_sets_the_planned_shard_order(shard_dir, cfg):
    manifest = shards.load_manifest(shard_dir)
    names = [s["name"] for s in manifest["shards"]]
    reader.start_epoch_clock("order-test")
    clock = reader.clock_name("order-test")
    source = reader.ShardDatasource(shard_dir, manifest, cfg.run.seed, task_mb=1e-6,
                                    epoch_fn=functools.partial(reader.announced_epoch, clock))

    def planned():  # as an execution plans it (Ray Data passes its context; metadata probes do not)
        tasks = source.get_read_tasks(1, data_context=DataContext.get_current())
        return [t.metadata.input_files[0].rsplit("/", 1)[1] for t in tasks]

    assert len(source.get_read_tasks(1)) == len(names)  # a metadata probe needs no announcement
    with pytest.raises(stream.DataEpochError, match="before the trainer announced"):
        planned()  # a missing signal is an error, never a silent epoch 0
    reader.announce_epoch(clock, 0)
    assert planned() == [names[i] for i in reader.shard_order(cfg.run.seed, 0, len(names))]
    reader.announce_epoch(clock, 5)
    assert planned() == [names[i] for i in reader.shard_order(cfg.run.seed, 5, len(names))]
    reader.stop_epoch_clock("order-test")
    with pytest.raises(stream.DataEpochError, match="does not exist"):
        reader.announced_epoch(clock)


def test_a_late_announcement_is_an_error_not_a_silent_order(shard_dir, cfg):
    """The blocks carry the epoch they were planned for; a rank reading another epoch refuses them."""
    reader.start_epoch_clock("late-test")
    clock = reader.clock_name("late-test")
    reader.announce_epoch(clock, 3)
    ds = reader.build_dataset(shard_dir, cfg, epoch_fn=functools.partial(reader.announced_epoch, clock))
    assert {r["epoch"] for r in ds.select_columns(["epoch"]).take_all()} == {3}
    assert sum(1 for _ in reader.iter_records(ds, epoch=3, log=None)) == VIDEOS
    with pytest.raises(stream.DataEpochError, match="epoch 4 received shards ordered for epoch 3"):
        next(reader.iter_records(ds, epoch=4, log=None))  # epoch 4 was asked for, 3 was still announced
    reader.stop_epoch_clock("late-test")


def test_stream_requests_each_next_epoch_before_the_loop_asks(shard_dir, cfg):
    manifest = shards.load_manifest(shard_dir)
    vocab = load_vocab(shard_dir)
    steps = make_plan(cfg, manifest["counts"]["videos"]).steps_per_epoch
    every = sorted(v for s in manifest["shards"] for v in s["videos"])
    reader.start_epoch_clock("stream-test")
    clock = reader.clock_name("stream-test")
    ds = reader.build_dataset(shard_dir, cfg, epoch_fn=functools.partial(reader.announced_epoch, clock))
    its = ds.streaming_split(2, equal=True)
    epochs = 3

    def run(rank, it):
        announce = functools.partial(reader.announce_epoch, clock) if rank == 0 else None
        stream = reader.RankStream(it, cfg, rank, cfg.data.batch_size // 2, steps, vocab, epochs=epochs, announce=announce, log=None)
        seen, ahead, counted = [], [], []
        for epoch in range(epochs):
            batches, stats = stream.epoch(epoch)
            videos = []
            for batch in batches:
                videos += list(dict.fromkeys(k.split("#")[0] for k in batch["key"]))
            seen.append(videos)
            ahead.append(stream.requested_ahead)  # asked of Ray Data before stream.epoch(epoch + 1)
            counted.append(stats.videos)
        return seen, ahead, counted

    out = consume_split(its, run)
    for rank in range(2):
        assert out[rank][1] == [1, 2, None]  # nothing is requested past the last epoch
    assert reader.announced_epoch(clock) == epochs - 1
    for epoch in range(epochs):  # early requests change nothing of what each epoch holds
        a, b = out[0][0][epoch], out[1][0][epoch]
        assert len(a) == len(b) == steps * cfg.data.batch_size // 2
        assert not set(a) & set(b)
        assert sorted(a + b) == every
        assert out[0][2][epoch] + out[1][2][epoch] == VIDEOS  # each epoch's counters are its own


def corrupt(src: Path, dst: Path) -> dict[str, int]:
    """Copy the shards and damage three of them; returns the expected bad count per shard name."""
    shutil.copytree(src, dst)
    manifest = shards.load_manifest(dst)
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
    return {a.name: 2, b.name: 1, c.name: 1}


def test_corrupted_shards_are_survived_and_counted(shard_dir, cfg, tmp_path):
    bad_by_shard = corrupt(shard_dir, tmp_path / "damaged")
    d = tmp_path / "damaged"
    logs: list[str] = []
    stats = stream.EpochStats()
    keys = [r.video_id for r in reader.iter_records(reader.build_dataset(d, cfg), stats, log=logs.append)]
    assert stats.bad_samples == sum(bad_by_shard.values()) == 4
    assert stats.bad_by_shard == bad_by_shard
    assert len(keys) == len(set(keys)) == VIDEOS - 4
    assert len(logs) == 4 and all(any(name in line for name in bad_by_shard) for line in logs)
    assert any("CRC-32" in line for line in logs) and any("missing" in line for line in logs)

    # the training iterator still runs every step on both ranks; the shortfall is refilled and counted
    vocab = load_vocab(d)
    steps = make_plan(cfg, shards.load_manifest(d)["counts"]["videos"]).steps_per_epoch
    its = reader.build_dataset(d, cfg).streaming_split(2, equal=True)
    per_rank = {}

    def run(rank, it):
        st = stream.EpochStats()
        n = sum(1 for _ in reader.iter_batches(it, cfg, 0, rank, cfg.data.batch_size // 2, steps, vocab, stats=st, log=None))
        per_rank[rank] = st
        return n

    assert consume_split(its, run) == {0: steps, 1: steps}
    assert sum(st.bad_samples for st in per_rank.values()) == 4
    assert sum(st.reused for st in per_rank.values()) >= 1
    assert per_rank[0].as_metrics()["bad_samples"] == per_rank[0].bad_samples


def test_missing_shard_file_is_counted(shard_dir, cfg, tmp_path):
    d = tmp_path / "missing"
    shutil.copytree(shard_dir, d)
    manifest = shards.load_manifest(d)
    (d / manifest["shards"][0]["name"]).unlink()
    stats = stream.EpochStats()
    n = sum(1 for _ in reader.iter_records(reader.build_dataset(d, cfg), stats, log=None))
    assert (n, stats.bad_samples) == (VIDEOS - PER_SHARD, PER_SHARD)


def test_helpers_raise_clear_errors(shard_dir, cfg, tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        reader.build_dataset(tmp_path, cfg)
    videos = shards.load_manifest(shard_dir)["counts"]["videos"]
    with pytest.raises(ConfigError, match="fewer than one step"):
        make_plan(cfg.replace({"data.batch_size": 64}), videos)
    assert make_plan(cfg.replace({"schedule.steps_per_epoch": 1}), videos).steps_per_epoch == 1


def test_read_webdataset_reads_the_shards_too(shard_dir):
    """The shards are plain WebDataset tars: Ray's own reader decodes them (slowly) as well."""
    manifest = shards.load_manifest(shard_dir)
    first = manifest["shards"][0]
    ds = ray.data.read_webdataset(str(shard_dir / first["name"]))
    row = ds.take(1)[0]
    ours = next(stream.iter_shard_records(shard_dir / first["name"]))[1]
    assert row["__key__"] == ours.video_id
    assert np.array_equal(row["3d.npy"], ours.feat_3d)


def test_shards_of_the_v1_writer_load_through_ray_data(cfg):
    """The committed shards of the first writer (tests/data/shards-v1) through the datasource."""
    v1 = Path(__file__).parent / "data" / "shards-v1"
    stats = stream.EpochStats()
    records = {r.video_id: r for r in reader.iter_records(reader.build_dataset(v1, cfg), stats, log=None)}
    assert (stats.videos, stats.bad_samples) == (3, 0)
    decoded = {vid: {name: {"dtype": str(a.dtype), "shape": list(a.shape),
                            "sha256": hashlib.sha256(a.tobytes()).hexdigest()}
                     for name in ("feat_2d", "feat_3d", "spec", "starts", "ends", "token_ids", "token_offsets")
                     for a in [getattr(rec, name)]} for vid, rec in records.items()}
    assert decoded == json.loads((v1.parent / "shards-v1.expected.json").read_text())
