"""The caption store: the lab's caption pickle covers all of HowTo100M, the conversion reads it
once, and no writer is given (or loads) the whole table; the shards stay byte for byte the same."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil

import numpy as np
import pytest
from conftest import shards_of

from raymcn.data import synthetic
from raymcn.data.formats import features
from raymcn.data.formats.features import FeatureFileError, load_captions, read_video_paths, video_id_of
from raymcn.data.formats.manifest import ShardError
from raymcn.data.write import captions, disk_space, shards, writer
from raymcn.data.write.captions import CaptionsChanged
from raymcn.data.write.sources import layout_sources

SETTINGS = synthetic.SynthSettings(videos=10, eval_clips=2, topics=3, word_dim=8, meaning_words=40,
                                   filler_words=6, video_seconds=(6.0, 8.0))


def convert(corpus, out, caption_pickle=None, **kw) -> dict:
    return shards_of(corpus, out, captions=caption_pickle or corpus.captions, **{"videos_per_shard": 4, **kw})


def with_other_videos(corpus, path, extra: int) -> dict:
    """The corpus's caption pickle plus ``extra`` videos it does not list (the lab's pickle covers
    all of HowTo100M), written to ``path``; returns the table."""
    table = dict(load_captions(corpus.captions))
    words = sorted({w for rec in table.values() for t in rec["text"] for w in str(t).split()})
    rng = np.random.default_rng(5)
    for i in range(extra):
        n = int(rng.integers(1, 12))
        starts = np.sort(rng.uniform(0, 300, n))
        table[f"other{i:05d}"] = {"start": starts, "end": starts + rng.uniform(1, 8, n),
                                  "text": [" ".join(rng.choice(words, rng.integers(5, 12))) for _ in range(n)]}
    path.write_bytes(pickle.dumps(table))
    return table


def shard_hashes(out, manifest) -> list[tuple[str, str]]:
    return [(s["name"], hashlib.sha256((out / s["name"]).read_bytes()).hexdigest()) for s in manifest["shards"]]


def test_a_pickle_of_many_more_videos_gives_the_same_shards(corpus, tmp_path, monkeypatch):
    """The shards of the listed videos are byte for byte those written from a pickle of exactly
    them, and the store the writers read holds the listed videos only."""
    alone = convert(corpus, tmp_path / "alone")
    big = tmp_path / "howto100m_like.pickle"
    with_other_videos(corpus, big, extra=2000)
    seen = {}
    real = writer.init_writer

    def spy(state):
        seen["state"] = state
        seen["store_videos"] = len(state.captions)
        real(state)

    monkeypatch.setattr(writer, "init_writer", spy)
    within = convert(corpus, tmp_path / "within", caption_pickle=big, workers=1)
    assert shard_hashes(tmp_path / "alone", alone) == shard_hashes(tmp_path / "within", within)
    assert [s["videos"] for s in alone["shards"]] == [s["videos"] for s in within["shards"]]
    assert alone["vocab"]["sha256"] == within["vocab"]["sha256"]
    # what a writer is given: the store of the 10 listed videos, not the table of 2010
    assert isinstance(seen["state"].captions, captions.CaptionStore)
    assert seen["store_videos"] == len(read_video_paths(corpus.video_csv)) == 10
    assert len(pickle.dumps(seen["state"])) < 2000  # a path and a few names: what travels to a Ray actor
    assert not (tmp_path / "within" / captions.STORE_DIR).exists()  # removed once the conversion completed


def test_no_writer_process_loads_the_caption_pickle(corpus, tmp_path, monkeypatch):
    """With 2 local writer processes: the pickle is unpickled once, in the driver, and then
    taken away; the forked writers, which inherit any patch of this process, could not load it."""
    loads = []
    real = shards.load_captions

    def load_once(path):
        loads.append(os.getpid())
        table = real(path)
        monkeypatch.setattr(features, "load_pickle", lambda *a, **k: pytest.fail("a writer unpickled"))
        return table

    monkeypatch.setattr(shards, "load_captions", load_once)
    manifest = convert(corpus, tmp_path / "o", workers=2)
    assert loads == [os.getpid()] and manifest["counts"]["videos"] == 10


def test_the_store_gives_what_the_pickle_gives_problems_included(corpus, tmp_path):
    table = dict(load_captions(corpus.captions))
    ids = [video_id_of(p) for p in read_video_paths(corpus.video_csv)]
    table[ids[0]] = {"start": [1.0, 2.0], "end": [3.0], "text": ["a", "b"]}  # unequal lengths
    del table[ids[1]]
    table[ids[2]] = {"start": [0.5], "end": [2.0], "text": [42]}  # not a string: tokenised as str()
    store = captions.build_store(tmp_path, corpus.captions, table, ids, "caption.pickle")
    for vid in ids:
        try:
            want = features.caption_fields(vid, table, "caption.pickle")
        except FeatureFileError as e:
            with pytest.raises(FeatureFileError) as got:
                store.fields(vid)
            assert str(got.value) == str(e)
            continue
        got = pickle.loads(pickle.dumps(store)).fields(vid)  # as a writer process opens it
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]
    with pytest.raises(FeatureFileError, match="not listed"):
        store.fields("somebody-else")


def test_a_pickle_changed_between_a_crash_and_the_rerun_is_named(corpus, tmp_path, monkeypatch):
    """The conversion stops after its first shard; the pickle is then rewritten (same size, new
    time): the rerun refuses, naming the pickle, and keeps what was written."""
    pickle_path = tmp_path / "caption.pickle"
    shutil.copy(corpus.captions, pickle_path)
    real, done = writer.write_shard, []

    def crash_after_one(job):
        if done:
            raise KeyboardInterrupt
        done.append(real(job))
        return done[-1]

    monkeypatch.setattr(writer, "write_shard", crash_after_one)
    with pytest.raises(KeyboardInterrupt):
        convert(corpus, tmp_path / "o", caption_pickle=pickle_path)
    monkeypatch.setattr(writer, "write_shard", real)
    written = sorted(p.name for p in (tmp_path / "o").glob("shard-*.tar"))
    assert written and (tmp_path / "o" / captions.STORE_DIR / captions.STORE_FILE).is_file()
    pickle_path.write_bytes(pickle_path.read_bytes())
    os.utime(pickle_path, ns=(1, 1))
    with pytest.raises(CaptionsChanged, match=f"--captions {pickle_path}: changed since this conversion began"):
        convert(corpus, tmp_path / "o", caption_pickle=pickle_path)
    assert sorted(p.name for p in (tmp_path / "o").glob("shard-*.tar")) == written


def test_a_rerun_reuses_the_store_without_unpickling(corpus, tmp_path, monkeypatch):
    uninterrupted = convert(corpus, tmp_path / "uninterrupted")
    real, done = writer.write_shard, []

    def crash_after_one(job):
        if done:
            raise KeyboardInterrupt
        done.append(real(job))
        return done[-1]

    monkeypatch.setattr(writer, "write_shard", crash_after_one)
    with pytest.raises(KeyboardInterrupt):
        convert(corpus, tmp_path / "o")
    monkeypatch.setattr(writer, "write_shard", real)
    monkeypatch.setattr(shards, "load_captions", lambda path: pytest.fail("the rerun unpickled the captions"))
    manifest = convert(corpus, tmp_path / "o")
    assert manifest["counts"]["videos"] == 10
    assert shard_hashes(tmp_path / "o", manifest) == shard_hashes(tmp_path / "uninterrupted", uninterrupted)


def test_too_little_memory_for_the_caption_table_is_refused_naming_both_figures(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(captions, "available_memory", lambda: 1000)
    needed = captions.unpickle_bytes(corpus.captions)
    for attempt in (lambda: convert(corpus, tmp_path / "o"),
                    lambda: disk_space.plan_space(layout_sources(corpus.features_root, corpus.audio_root,
                                                                   corpus.captions, corpus.video_csv,
                                                                   corpus.word_vectors), tmp_path / "o",
                                             progress=False)):
        with pytest.raises(ShardError) as e:
            attempt()
        assert f"~{needed / 1e9:.1f} GB" in str(e.value) and "0.0 GB available" in str(e.value)
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_the_dry_run_says_the_memory_the_conversion_needs(corpus, tmp_path):
    plan = disk_space.plan_space(layout_sources(corpus.features_root, corpus.audio_root, corpus.captions,
                                                  corpus.video_csv, corpus.word_vectors), tmp_path / "o",
                            progress=False)
    assert plan.memory_needed == captions.unpickle_bytes(corpus.captions) > 0
    assert plan.memory_available > 0 and "caption table: ~" in plan.report("float16")
