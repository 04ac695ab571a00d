"""Data layer: word vectors, the original feature layout, the clip sampler, eval pickles, synthetic corpus."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import pickle
from pathlib import Path

import numpy as np
import pytest

from raymcn.config import load_config
from raymcn.data import evalsets, synthetic
from raymcn.data.formats import features, words
from raymcn.data.formats.features import (
    VideoRecord,
    audio_clip,
    audio_frame,
    grow_span,
    pack_tokens,
    read_video,
    read_video_paths,
    read_videos,
    sample_clips,
    text_clip_ids,
    video_rows,
)
from raymcn.data.formats.words import Vocab, build_vocab, encode, read_word2vec_bin, tokenize, write_word2vec_bin
from raymcn.train.inputs import eval_set_of

DATA_DIR = Path(features.__file__).parents[1]  # raymcn/data


# --- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_settings() -> synthetic.SynthSettings:
    return synthetic.SynthSettings(videos=4, eval_clips=6, topics=3, word_dim=24, meaning_words=60,
                                   filler_words=8)


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory, tiny_settings) -> synthetic.CorpusPaths:
    return synthetic.write_corpus(tmp_path_factory.mktemp("corpus"), tiny_settings)


@pytest.fixture(scope="module")
def tiny_vocab(tiny_corpus) -> Vocab:
    captions = features.load_captions(tiny_corpus.captions)
    texts = [t for rec in captions.values() for t in rec["text"]]
    return build_vocab(texts, read_word2vec_bin(tiny_corpus.word_vectors))


def hand_record(starts, ends, tokens, t2=40, t3=60, ta=4000, seed=0) -> VideoRecord:
    """A VideoRecord with given caption times/tokens and random nonnegative features."""
    rng = np.random.default_rng(seed)
    flat, offsets = pack_tokens([np.asarray(t, np.int32) for t in tokens])
    return VideoRecord("hand", rng.random((t2, 2048), dtype=np.float32), rng.random((t3, 2048), dtype=np.float32),
                       (-rng.random((40, ta)) * 80).astype(np.float16),
                       np.asarray(starts, np.float64), np.asarray(ends, np.float64), flat, offsets)


# --- words -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("trailing_newline", [True, False])
def test_word2vec_binary_round_trip(tmp_path, trailing_newline):
    wv = ["the", "Dog", "don't", "naïve", "New_York"]
    vecs = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    path = tmp_path / "w.bin"
    if trailing_newline:
        write_word2vec_bin(path, wv, vecs)
    else:  # the variant without a newline after each vector
        path.write_bytes(b"5 7\n" + b"".join(w.encode() + b" " + v.astype("<f4").tobytes() for w, v in zip(wv, vecs)))
    back = read_word2vec_bin(path)
    assert back.words == wv
    assert back.vectors.dtype == np.float32 and np.array_equal(back.vectors, vecs)
    kept = read_word2vec_bin(path, keep={"Dog", "naïve", "absent"})
    assert kept.words == ["Dog", "naïve"] and np.array_equal(kept["naïve"], vecs[3])


def test_word2vec_truncated_file_names_it(tmp_path):
    path = tmp_path / "bad.bin"
    write_word2vec_bin(path, ["a", "b"], np.ones((2, 4), np.float32))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="bad.bin.*truncated"):
        read_word2vec_bin(path)


def test_tokenizer_and_encode():
    assert tokenize("Don't stop, the dog's-bowl!") == ["Don't", "stop", "the", "dog's", "bowl"]
    w2i = {"the": 1, "dog": 2, "Cat": 3}
    ids = encode("The dog and the Cat cat the dog", w2i, 4)  # case-sensitive; OOV dropped; first 4 kept
    assert ids.dtype == np.int32 and ids.tolist() == [2, 1, 3, 1]
    assert encode("dog zzz", w2i, 5).tolist() == [2, 0, 0, 0, 0]  # zero padding
    assert encode("nothing here", w2i, 3).tolist() == [0, 0, 0]


def test_build_save_load_vocab(tmp_path):
    vocab = build_vocab(["b a", "c b x"], {"a": np.ones(3), "b": np.full(3, 2.0), "c": np.full(3, 3.0)})
    words_, matrix = vocab
    assert words_ == ["b", "a", "c"] and matrix.shape == (4, 3) and matrix.dtype == np.float32
    assert not matrix[0].any() and matrix[vocab.word_to_id["c"]].tolist() == [3, 3, 3]
    words.save_vocab(tmp_path, vocab)
    loaded = words.load_vocab(tmp_path)
    assert isinstance(loaded.matrix, np.memmap) and loaded.words == words_
    assert np.array_equal(loaded.matrix, matrix)
    assert loaded.lookup(np.array([[3, 0]])).shape == (1, 2, 3)


# --- clip sampling: the original sampler's steps on hand-made captions ------------------------------------
def test_grow_span_takes_the_shorter_neighbour():
    starts, ends = np.array([0.0, 4.0, 6.0, 8.0]), np.array([4.0, 6.0, 8.0, 15.0])
    # from caption 1 [4,6]: prev gives [0,6]=6, next gives [4,8]=4 -> next; then [4,8]: prev [0,8]=8 vs next [4,15]=11
    assert grow_span(starts, ends, 1, 8.0) == (0, 2, [1, 2, 0])


def test_grow_span_tie_takes_previous_and_words_are_appended():
    starts, ends = np.array([0.0, 3.0, 6.0]), np.array([3.0, 6.0, 9.0])
    first, last, order = grow_span(starts, ends, 1, 5.0)  # both sides give a 6 s span: tie -> previous
    assert (first, last, order) == (0, 1, [1, 0])
    rec = hand_record(starts, ends, [[1, 2], [3, 4], [5]])
    # the absorbed previous caption's words come AFTER the sampled caption's words (original behaviour)
    assert text_clip_ids(rec, order, 6).tolist() == [3, 4, 1, 2, 0, 0]
    assert text_clip_ids(rec, [1, 0, 2], 4).tolist() == [3, 4, 1, 2]  # truncation to max_words


def test_grow_span_boundaries_and_single_caption():
    starts, ends = np.array([0.0, 2.0, 4.0]), np.array([2.0, 4.0, 6.0])
    assert grow_span(starts, ends, 0, 5.0) == (0, 2, [0, 1, 2])  # only the next side exists
    assert grow_span(starts, ends, 2, 3.0) == (1, 2, [2, 1])  # only the previous side exists
    assert grow_span(starts, ends, 1, 100.0) == (0, 2, [1, 0, 2])  # stops when nothing is left
    assert grow_span(np.array([1.0]), np.array([2.0]), 0, 10.0) == (0, 0, [0])
    assert grow_span(starts, ends, 1, 1.5) == (1, 1, [1])  # already long enough


def test_audio_frame_formula_and_clamp():
    assert audio_frame(1.0) == (16000 - 200) // 160 == 98
    assert audio_frame(2.345) == (37520 - 200) // 160
    assert audio_frame(0.0226) == 1
    for t in (0.0, 0.005, 0.0124):  # raw formula is negative: the original got an empty (silent) clip
        assert audio_frame(t) == 0
    spec = (np.arange(40 * 3000).reshape(40, 3000) % 7 - 7).astype(np.float16)
    audio, n = audio_clip(spec, 0.0, 12.0, 1000)
    assert audio.shape == (40, 1000) and audio.dtype == np.float16 and n == 1000
    assert np.array_equal(audio, spec[:, :1000])
    audio, n = audio_clip(spec, 1.0, 3.0, 1000)  # frames [98, 298): 200 real frames, then zeros
    assert n == 200 and np.array_equal(audio[:, :200], spec[:, 98:298]) and not audio[:, 200:].any()
    audio, n = audio_clip(spec, 40.0, 50.0, 1000)  # past the end of the audio
    assert n == 0 and not audio.any()


def test_video_rows_inclusive_and_clamped():
    assert video_rows(100, 3.2, 7.9, 1.0) == (3, 7)
    assert video_rows(100, 3.2, 7.9, 1.5) == (4, 11)  # floor(4.8) .. floor(11.85), inclusive
    assert video_rows(10, 8.0, 12.0, 1.0) == (8, 9)  # never past the last row
    assert video_rows(10, 15.0, 20.0, 1.0) == (9, 9)  # beyond the end: the nearest (last) row
    assert video_rows(0, 1.0, 2.0, 1.0) == (0, -1)


def test_sample_clips_matches_the_spec_on_a_hand_made_video():
    starts, ends = [0.0, 4.0, 6.0, 8.0], [4.0, 6.0, 8.0, 15.0]
    rec = hand_record(starts, ends, [[1], [2, 3], [4], [5, 6, 7]], t2=16, t3=23)
    vocab_matrix = np.arange(8 * 5, dtype=np.float32).reshape(8, 5)
    vocab_matrix[0] = 0
    rng = np.random.default_rng(3)
    idx = features.draw_caption_indices(4, 6, np.random.default_rng(3))
    out = sample_clips(rec, 6, 8.0, 1000, 5, rng, vocab_matrix)
    assert out["video"].shape == (6, 4096) and out["video"].dtype == np.float32
    assert out["audio"].shape == (6, 40, 1000) and out["audio"].dtype == np.float16
    assert out["nframes"].dtype == np.int32 and out["text"].shape == (6, 5, 5) and out["text"].dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(out["video"][:, :2048], axis=1), 1, rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(out["video"][:, 2048:], axis=1), 1, rtol=1e-5)
    for j, i in enumerate(idx):
        first, last, order = grow_span(rec.starts, rec.ends, int(i), 8.0)
        s, e = starts[first], ends[last]
        assert (out["start"][j], out["end"][j]) == (s, e)
        v2 = rec.feat_2d[int(s):int(e) + 1].max(0)
        v3 = rec.feat_3d[int(s * 1.5):min(int(e * 1.5), 22) + 1].max(0)
        np.testing.assert_allclose(out["video"][j], np.r_[v2 / np.linalg.norm(v2), v3 / np.linalg.norm(v3)], rtol=1e-5)
        assert out["nframes"][j] == min(1000, audio_frame(e) - audio_frame(s))
        assert np.array_equal(out["text"][j], vocab_matrix[out["text_ids"][j]])
        assert out["text_ids"][j].tolist() == text_clip_ids(rec, order, 5).tolist()
    other = dataclasses.replace(hand_record([0.0, 9.0], [9.0, 15.0], [[2], [4]], t2=16, t3=23, seed=1), video_id="b")
    batch = features.sample_batch([rec, other], [np.random.default_rng(3), np.random.default_rng(4)], 6, 8.0, 1000, 5,
                                  vocab_matrix)
    assert batch["video"].shape == (12, 4096) and batch["key"][:2] == [f"{rec.video_id}#0", f"{rec.video_id}#1"]
    assert batch["key"][6] == "b#0"
    alone = sample_clips(other, 6, 8.0, 1000, 5, np.random.default_rng(4), vocab_matrix)
    for k, v in out.items():  # written in place, each video's rows equal its own sample_clips
        assert np.array_equal(batch[k][:6], v) and np.array_equal(batch[k][6:], alone[k]), k


# --- the on-disk layout ------------------------------------------------------------------------------------
def test_read_layout_round_trips_bit_exact(tiny_corpus, tiny_settings, tiny_vocab):
    paths = read_video_paths(tiny_corpus.video_csv)
    captions = features.load_captions(tiny_corpus.captions)
    assert len(paths) == tiny_settings.videos
    for i, path in enumerate(paths):
        want = synthetic.train_video(tiny_settings, i)
        rec = read_video(path, tiny_corpus.features_root, tiny_corpus.audio_root, captions, tiny_vocab.word_to_id)
        assert rec.video_id == want["video_id"] == path.split("/")[-1]
        for name in ("feat_2d", "feat_3d", "spec"):
            assert getattr(rec, name).dtype == want[name].dtype and np.array_equal(getattr(rec, name), want[name])
        assert np.array_equal(rec.starts, want["starts"]) and np.array_equal(rec.ends, want["ends"])
        for c, text in enumerate(want["texts"]):
            assert rec.caption_tokens(c).tolist() == words.token_ids(text, tiny_vocab.word_to_id).tolist()
    rng = np.random.default_rng(0)
    clips = sample_clips(rec, 4, 10.0, 1000, 20, rng, tiny_vocab.matrix)
    assert clips["text"].shape == (4, 20, tiny_settings.word_dim)


def test_video_csv_strips_none_prefix(tmp_path):
    (tmp_path / "v.csv").write_text("path\nNone/Cat/Sub/abc\nCat/Sub/def\n")
    assert read_video_paths(tmp_path / "v.csv") == ["Cat/Sub/abc", "Cat/Sub/def"]
    assert features.video_id_of("Cat/Sub/abc") == "abc"


def test_missing_and_unreadable_files_are_reported_per_video(tiny_corpus, tiny_vocab, tmp_path):
    paths = read_video_paths(tiny_corpus.video_csv)
    captions = dict(features.load_captions(tiny_corpus.captions))
    root = tmp_path / "feat"
    import shutil
    shutil.copytree(tiny_corpus.features_root, root)
    vid0, vid1, vid2 = (p.split("/")[-1] for p in paths[:3])
    (root / paths[0] / f"{vid0}_3d.npz").unlink()
    (root / paths[1] / f"{vid1}_2d.npz").write_bytes(b"not a zip")
    del captions[vid2]
    records, problems = read_videos(paths, root, tiny_corpus.audio_root, captions, tiny_vocab.word_to_id)
    assert [r.video_id for r in records] == [p.split("/")[-1] for p in paths[3:]]
    reasons = dict(problems)
    assert list(reasons) == [vid0, vid1, vid2]
    assert "missing file" in reasons[vid0] and f"{vid0}_3d.npz" in reasons[vid0]
    assert "unreadable" in reasons[vid1] and f"{vid1}_2d.npz" in reasons[vid1]
    assert "no entry" in reasons[vid2]
    with pytest.raises(features.FeatureFileError, match=f"{vid0}_3d.npz"):
        read_video(paths[0], root, tiny_corpus.audio_root, captions, tiny_vocab.word_to_id)


# --- evaluation pickles ---------------------------------------------------------------------------------
def test_youcook_pickle(tiny_corpus, tiny_settings):
    ev = evalsets.load_eval_set(f"youcook:{tiny_corpus.youcook_eval}", tiny_corpus.word_vectors, max_words=20)
    raw = pickle.load(open(tiny_corpus.youcook_eval, "rb"))
    n = tiny_settings.eval_clips
    assert len(ev) == n and ev.num_queries_total == n and ev.note == ""
    assert ev.video.shape == (n, 4096) and ev.audio.shape == (n, 40, 5120) and ev.audio.dtype == np.float32
    assert ev.text.shape == (n, 20, tiny_settings.word_dim) and ev.ids[0] == raw[0]["id"]
    np.testing.assert_allclose(np.linalg.norm(ev.video.reshape(n, 2, 2048), axis=2), 1, rtol=1e-5)
    lengths = [c["audio"].shape[1] for c in raw]
    assert ev.nframes.tolist() == lengths
    assert np.array_equal(ev.audio[0, :, :lengths[0]], raw[0]["audio"].float().numpy())
    assert not ev.audio[0, :, lengths[0]:].any()
    short = evalsets.load_eval_set(f"youcook:{tiny_corpus.youcook_eval}", tiny_corpus.word_vectors, 20,
                                   audio_frames_override=256)
    assert short.audio.shape[2] == 256 and short.nframes.tolist() == lengths  # true length may exceed T


def _msrvtt_clip(i, rng):
    import torch
    return {"id": f"video{i}", "2d_pooled": rng.random(2048).astype(np.float32),
            "3d_pooled": torch.rand(2048), "audio": torch.zeros(40, 100 + i),
            "caption": ["a dog runs", "x"], "eval_caption": "the dog runs"}


def test_msrvtt_pickle_and_the_1000_rule(tmp_path):
    rng = np.random.default_rng(0)
    clips = [_msrvtt_clip(i, rng) for i in range(5)]
    del clips[4]["eval_caption"]  # falls back to the first training caption
    path = tmp_path / "msr.pkl"
    path.write_bytes(pickle.dumps(clips))
    wv = {"the": np.ones(4), "dog": np.full(4, 2.0), "runs": np.full(4, 3.0)}
    ev = evalsets.load_eval_set(f"msrvtt:{path}", wv, max_words=6)
    assert ev.audio.shape == (5, 40, 3072) and ev.nframes.tolist() == [100, 101, 102, 103, 104]
    assert ev.num_queries_total == 1000 and "995 missing clips count as misses" in ev.note
    assert ev.captions[0] == "the dog runs" and ev.captions[4] == "a dog runs"
    assert ev.text_ids[0].tolist() == [1, 2, 3, 0, 0, 0]
    assert evalsets.load_eval_set(f"msrvtt:{path}", wv, 6, num_queries_total=5).note == ""


def test_bad_eval_pickle_names_file_entry_and_key(tmp_path):
    rng = np.random.default_rng(0)
    clips = [_msrvtt_clip(i, rng) for i in range(3)]
    del clips[1]["3d_pooled"]
    path = tmp_path / "broken.pkl"
    path.write_bytes(pickle.dumps(clips))
    with pytest.raises(evalsets.EvalSetError, match=r"broken\.pkl: entry 1 \(id=video1\) lacks key '3d_pooled'"):
        evalsets.load_eval_set(f"msrvtt:{path}", {"dog": np.ones(4)})
    path.write_bytes(pickle.dumps({"not": "a list"}))
    with pytest.raises(evalsets.EvalSetError, match="broken.pkl: expected a non-empty list"):
        evalsets.load_eval_set(f"youcook:{path}", {"dog": np.ones(4)})
    with pytest.raises(ValueError, match="allowed forms"):
        evalsets.load_eval_set("lsmdc:x.pkl", {})


# --- the synthetic corpus ---------------------------------------------------------------------------------
def _digest_files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.suffix != ".pkl" and p.name != "corpus.json"}


def test_synthetic_corpus_is_deterministic(tiny_corpus, tiny_settings, tmp_path):
    again = synthetic.write_corpus(tmp_path / "again", tiny_settings)
    assert _digest_files(again.root) == _digest_files(tiny_corpus.root)  # npz, csv, caption pickle, .bin
    a = evalsets.load_eval_set(f"youcook:{tiny_corpus.youcook_eval}", tiny_corpus.word_vectors)
    b = evalsets.load_eval_set(f"youcook:{again.youcook_eval}", again.word_vectors)
    assert np.array_equal(a.video, b.video) and np.array_equal(a.audio, b.audio) and a.captions == b.captions
    other = synthetic.train_video(dataclasses.replace(tiny_settings, seed=1), 0)
    assert not np.array_equal(other["feat_2d"][:5], synthetic.train_video(tiny_settings, 0)["feat_2d"][:5])


def test_synthetic_spectrogram_and_features_look_like_the_originals(tiny_settings):
    v = synthetic.train_video(tiny_settings, 1)
    assert v["spec"].dtype == np.float16 and v["spec"].shape[0] == 40 and v["spec"].max() == 0
    assert v["spec"].min() >= -80 and (v["feat_2d"] >= 0).all() and v["feat_3d"].dtype == np.float32
    assert v["feat_2d"].shape[0] == int(np.ceil(v["duration"])) and v["feat_3d"].shape[0] == int(v["duration"] * 1.5)
    assert np.all(np.diff(v["starts"]) > 0) and np.all(v["ends"][:-1] <= v["starts"][1:] + 1e-9)


def test_ensure_corpus_generates_once_and_reuses(tmp_path, monkeypatch):
    cfg = load_config(overrides={"data.cache_dir": str(tmp_path), "data.synthetic_videos": 2,
                                 "data.synthetic_eval_clips": 3, "data.synthetic_topics": 2, "model.word_dim": 8})
    root = synthetic.ensure_corpus(cfg)
    assert root.parent == tmp_path and root.name.startswith("synthetic-") and (root / "corpus.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [root.name]  # no temporary directory left behind
    calls = []
    monkeypatch.setattr(synthetic, "write_corpus", lambda *a, **k: calls.append(a))
    assert synthetic.ensure_corpus(cfg) == root and calls == []
    ev = eval_set_of(cfg.replace({"data.max_words": 7}))  # the corpus's held-out set, as the entry points load it
    assert len(ev) == 3 and ev.audio.shape == (3, 40, evalsets.SYNTHETIC_FRAMES) and ev.text.shape == (3, 7, 8)
    bigger = cfg.replace({"data.synthetic_videos": 3})
    assert synthetic.settings_from_config(bigger).digest() != synthetic.settings_from_config(cfg).digest()


def test_ensure_corpus_keeps_the_winner_of_a_race(tmp_path, monkeypatch):
    settings = synthetic.SynthSettings(videos=1, eval_clips=1, topics=1, word_dim=4)
    final = tmp_path / f"synthetic-{settings.digest()}"
    real_write = synthetic.write_corpus

    def write_then_lose(out_dir, s):  # another process finishes first, while we are writing
        real_write(final, s)
        return real_write(out_dir, s)

    monkeypatch.setattr(synthetic, "write_corpus", write_then_lose)
    assert synthetic.ensure_settings(tmp_path, settings) == final
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_synthetic_task_is_learnable(tmp_path):
    """A ridge map from bag-of-words to pooled video beats chance R@10 on held-out clips by far."""
    s = synthetic.SynthSettings(videos=40, eval_clips=50, topics=4, word_dim=16, meaning_words=200)
    corpus = synthetic.write_corpus(tmp_path, s, seed=2)
    captions = features.load_captions(corpus.captions)
    vocab = build_vocab([t for r in captions.values() for t in r["text"]], read_word2vec_bin(corpus.word_vectors))
    records, problems = read_videos(read_video_paths(corpus.video_csv), corpus.features_root, corpus.audio_root,
                                    captions, vocab.word_to_id)
    assert problems == []
    rng, n_words = np.random.default_rng(0), len(vocab.words) + 1
    clips = features.sample_batch(records, [rng] * len(records), 16, 10.0, 1000, 20, None)

    def bow(ids):
        return np.stack([np.bincount(row[row > 0], minlength=n_words) for row in ids]).astype(np.float64)

    x = bow(clips["text_ids"])
    w = np.linalg.solve(x.T @ x + 10 * np.eye(n_words), x.T @ clips["video"])
    ev = evalsets.load_eval_set(f"youcook:{corpus.youcook_eval}", vocab, 20)
    pred, gallery = bow(ev.text_ids) @ w, ev.video - clips["video"].mean(0)
    pred -= clips["video"].mean(0)
    scores = pred @ gallery.T
    ranks = (scores > np.diag(scores)[:, None]).sum(1)
    assert (ranks < 10).mean() > 3 * 10 / len(ev)


# --- layering ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", ["formats/words.py", "formats/features.py", "synthetic.py", "evalsets.py"])
def test_data_modules_import_neither_ray_nor_torch_distributed(module):
    tree = ast.parse((DATA_DIR / module).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n == "ray" or n.startswith("ray.") or n.startswith("torch.distributed")]
