"""The embedded default corpus: a latent-topic tri-modal generator written in the original layout.

Generative story (all draws from ``numpy.random.Generator`` seeded per video, so a corpus is a pure
function of its settings):

* K topic centres ``c_k`` in a LATENT_DIM-d latent space. A video has a topic and a video offset;
  each ASR-like caption segment (2–6 s, consecutive, sometimes separated by a gap) has a latent
  ``l = c_k + video offset + segment noise``.
* Text: each caption's words are drawn from ``softmax(beta · m_w · l)`` over "meaning" words, mixed
  with filler words (no meaning) and a few out-of-vocabulary tokens. Text sees ``l`` directly.
* Video: the 2d (1 row/s) and 3d (1.5 rows/s) rows are ``ReLU(W (l + visual noise + frame noise) + b
  + noise)`` with fixed random projections W: nonnegative, sparse, 2048-d.
* Audio: a 40 × Ta log-mel-like array (100 frames/s, <= 0 dB as with ``power_to_db(ref=max)``), whose
  spectral envelope and modulation rate are functions of ``l + audio noise`` plus frame noise.
  Video and audio carry extra per-segment latent noise, so text is the least noisy modality.
* Word vectors (word2vec binary file) are linear images of the meaning vectors plus noise.

Held-out evaluation clips come from NEW videos of the same topics (same projections and words):
each is a whole short video (6–12 s) with max-pooled 2d/3d features, its full spectrogram (a float16
torch tensor, to halve the pickle; the loaders cast to float32) and its captions joined in time
order. They are written as a YouCook2-style pickle and, optionally, an MSR-VTT-style one.

The embedded default: with no ``data.shards``, a run reads :func:`ensure_synthetic_shards`, the
corpus of its config cut into SYNTHETIC_SHARDS shards by the real writer, both cached once.

Feature values are rounded to float16 precision (still stored as float32, as the format says;
``SynthSettings.full_precision`` keeps them at full fp32 precision, as real features are) and
the npz files are deflate-compressed, which keeps the default corpus small; ``np.load`` reads them
like the original files.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import pickle
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from raymcn.data.formats.features import AUDIO_HOP, AUDIO_SR, FEATURE_DIM, FPS_2D, FPS_3D, MEL_BINS
from raymcn.data.formats.files import build_once
from raymcn.data.formats.manifest import FORMAT_VERSION
from raymcn.data.formats.manifest import MANIFEST as SHARD_MANIFEST
from raymcn.data.formats.words import write_word2vec_bin
from raymcn.data.write.shards import DEFAULT_FEATURE_DTYPE, shards_from_layout

GENERATOR_VERSION = 1  # bump whenever the generated data changes: it is part of the cache key
CORPUS_SEED = 0  # fixed on purpose: runs with different run.seed share one corpus
LATENT_DIM = 16
# Noise levels. Text sees the segment latent itself (its only noise is the finite bag of words);
# video and audio see it through extra per-segment latent noise, so text is the cleanest modality.
TEXT_BETA = 2.2  # sharpness of the word distribution
FILLER_P, OOV_P = 0.1, 0.05  # share of filler and out-of-vocabulary tokens
VISUAL_NOISE, AUDIO_NOISE = 0.8, 0.9  # per-segment latent noise; latent entries have std ~1.2
_STREAM_WORLD, _STREAM_TRAIN, _STREAM_EVAL, _STREAM_MSRVTT = 0, 1, 2, 3
FRAMES_PER_SECOND = AUDIO_SR // AUDIO_HOP  # 100

# file names inside a corpus directory
VIDEO_CSV = "videopaths.csv"
FEATURES_DIR = "features"
AUDIO_DIR = "audio"
CAPTIONS = "caption.pickle"
WORD_VECTORS = "word2vec.bin"
YOUCOOK_EVAL = "youcook_val_audio.pkl"
MSRVTT_EVAL = "msrvtt_jsfusion_test.pkl"
MANIFEST = "corpus.json"


@dataclass(frozen=True)
class SynthSettings:
    """Everything that determines the generated corpus (hashed into the cache directory name)."""

    videos: int = 256
    eval_clips: int = 256
    topics: int = 8
    word_dim: int = 300
    seed: int = CORPUS_SEED
    meaning_words: int = 600
    filler_words: int = 40
    video_seconds: tuple[float, float] = (20.0, 40.0)
    eval_seconds: tuple[float, float] = (6.0, 12.0)
    msrvtt_clips: int = 0  # 0 = no MSR-VTT-style pickle; else that many ids, ~3.2 % left out (no audio)
    version: int = GENERATOR_VERSION
    # Training features at full fp32 precision instead of fp16-representable values (real
    # HowTo100M features are full fp32; an fp16 shard of them really rounds, which the default
    # corpus cannot show). Bigger npz files.
    full_precision: bool = False

    def digest(self) -> str:
        fields = asdict(self)
        if not self.full_precision:  # the corpora generated before the field existed keep their digest
            del fields["full_precision"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class CorpusPaths:
    """Where the files of a corpus directory are (the original layout plus the eval pickles)."""

    root: Path

    @property
    def video_csv(self) -> Path:
        return self.root / VIDEO_CSV

    @property
    def features_root(self) -> Path:
        return self.root / FEATURES_DIR

    @property
    def audio_root(self) -> Path:
        return self.root / AUDIO_DIR

    @property
    def captions(self) -> Path:
        return self.root / CAPTIONS

    @property
    def word_vectors(self) -> Path:
        return self.root / WORD_VECTORS

    @property
    def youcook_eval(self) -> Path:
        return self.root / YOUCOOK_EVAL

    @property
    def msrvtt_eval(self) -> Path:
        return self.root / MSRVTT_EVAL

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST


# --- the shared "world": topics, words, projections ------------------------------------------------
@dataclass
class _World:
    centers: np.ndarray  # (K, L)
    meanings: np.ndarray  # (Vm, L)
    words: list[str]  # Vm meaning words, then the filler words
    vectors: np.ndarray  # (V, D) float32 word vectors
    proj_2d: np.ndarray  # (L, 2048)
    proj_3d: np.ndarray  # (L, 2048)
    mel: np.ndarray  # (L, 40) spectral envelope
    rate: np.ndarray  # (L,) modulation-rate direction


@functools.lru_cache(maxsize=4)
def _make_world(s: SynthSettings) -> _World:
    rng = np.random.default_rng([s.seed, _STREAM_WORLD])
    L, n_words = LATENT_DIM, s.meaning_words + s.filler_words
    meanings = rng.standard_normal((s.meaning_words, L)) / np.sqrt(L)
    # Word vectors: a fixed linear image of the meaning (entries of variance ~1) plus word-specific
    # noise; fillers are pure noise. Scaled to GoogleNews-like norms.
    signal = meanings @ rng.standard_normal((L, s.word_dim)) * np.sqrt(L)
    vecs = np.concatenate([signal, np.zeros((s.filler_words, s.word_dim))])
    vecs = vecs + 0.5 * rng.standard_normal((n_words, s.word_dim))
    vecs *= 2.5 / np.linalg.norm(vecs, axis=1, keepdims=True)
    names = [f"w{i:04d}" for i in range(s.meaning_words)] + [f"f{i:03d}" for i in range(s.filler_words)]
    return _World(centers=rng.standard_normal((s.topics, L)),
                  meanings=meanings, words=names, vectors=vecs.astype(np.float32),
                  proj_2d=rng.standard_normal((L, FEATURE_DIM)) / np.sqrt(L),
                  proj_3d=rng.standard_normal((L, FEATURE_DIM)) / np.sqrt(L),
                  mel=rng.standard_normal((L, MEL_BINS)) / np.sqrt(L),
                  rate=rng.standard_normal(L) / np.sqrt(L))


# --- one video ----------------------------------------------------------------------------------
def _segments(rng: np.random.Generator, seconds: float) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive ASR-like caption spans of 2–6 s with occasional gaps, inside [0, seconds)."""
    t = 0.0 if rng.random() < 0.3 else float(rng.uniform(0.0, 1.0))  # some start at 0 s (negative audio frame)
    starts, ends = [], []
    while True:
        dur = float(rng.uniform(2.0, 6.0))
        if t + dur > seconds and starts:
            break
        starts.append(t)
        ends.append(t + dur)
        t += dur + (float(rng.uniform(0.2, 1.5)) if rng.random() < 0.3 else 0.0)
    return np.round(np.array(starts), 2), np.round(np.array(ends), 2)


def _segment_of(times: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Index of the caption covering each time, or -1 in gaps / after the last caption."""
    idx = np.searchsorted(starts, times, side="right") - 1
    inside = (idx >= 0) & (times < ends[np.clip(idx, 0, None)])
    return np.where(inside, idx, -1)


def _frame_latents(base: np.ndarray, seg_lat: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Per-frame latent: that of the covering segment, the video's own latent in gaps."""
    return np.where((seg >= 0)[:, None], seg_lat[np.clip(seg, 0, None)], base)


def _visual(rng, world_proj, base, seg_lat, starts, ends, n_rows: int, fps: float, full: bool = False) -> np.ndarray:
    """(n_rows, 2048) float32 nonnegative frame features (fp16-representable values unless ``full``)."""
    seg = _segment_of((np.arange(n_rows) + 0.5) / fps, starts, ends)
    lat = _frame_latents(base, seg_lat, seg) + 0.25 * rng.standard_normal((n_rows, LATENT_DIM))
    pre = (lat @ world_proj - 0.6).astype(np.float32) + 0.5 * rng.standard_normal((n_rows, FEATURE_DIM), np.float32)
    return np.maximum(pre, 0.0) if full else np.maximum(pre, 0.0).astype(np.float16).astype(np.float32)


def _audio(rng, world: _World, base, seg_lat, starts, ends, n_frames: int) -> np.ndarray:
    """(40, n_frames) float16 log-mel-like spectrogram, <= 0 dB, 0.5 dB steps."""
    times = np.arange(n_frames) / FRAMES_PER_SECOND
    seg = _segment_of(times, starts, ends)
    lat = _frame_latents(base, seg_lat, seg)
    envelope = 12.0 * np.tanh(lat @ world.mel)  # (n, 40) dB
    rate = 2.5 + 1.5 * np.tanh(lat @ world.rate)  # Hz, syllable-like modulation
    phase = rng.uniform(0, 2 * np.pi, size=len(starts) + 1)[seg + 1]
    loud = 6.0 * np.sin(2 * np.pi * rate * times + phase)
    noise = 4.0 * rng.standard_normal(envelope.shape, np.float32)
    db = -35.0 - 0.3 * np.arange(MEL_BINS) + envelope + loud[:, None] + noise
    db[seg < 0] = -60.0 + 4.0 * rng.standard_normal(((seg < 0).sum(), MEL_BINS))  # quiet gaps
    db = np.maximum(db - db.max(), -80.0)  # power_to_db(ref=max, top_db=80)
    return (np.round(db * 2) / 2).T.astype(np.float16)


def _caption_text(rng, world: _World, latent: np.ndarray, n_tokens: int, beta: float = TEXT_BETA) -> str:
    """Bag of words carrying ``latent``: meaning words ~ softmax(beta · m_w · l), plus fillers and OOV."""
    logits = beta * world.meanings @ latent
    p = np.exp(logits - logits.max())
    p /= p.sum()
    n_meaning = len(world.meanings)
    tokens = []
    for w in rng.choice(n_meaning, size=n_tokens, p=p):
        u = rng.random()
        if u < FILLER_P:
            tokens.append(world.words[n_meaning + rng.integers(len(world.words) - n_meaning)])
        elif u < FILLER_P + OOV_P:
            tokens.append(f"zz{rng.integers(1000):03d}")  # out of vocabulary: dropped by the encoder
        else:
            tokens.append(world.words[w])
    return " ".join(tokens)


def _make_video(world: _World, rng: np.random.Generator, seconds: tuple[float, float], full: bool = False) -> dict:
    """One synthetic video: features, spectrogram and captions (see the module docstring)."""
    topic = int(rng.integers(len(world.centers)))
    duration = float(rng.uniform(*seconds))
    starts, ends = _segments(rng, duration)
    duration = max(duration, float(ends[-1]) + float(rng.uniform(0.5, 2.0)))
    base = world.centers[topic] + 0.5 * rng.standard_normal(LATENT_DIM)
    seg_lat = base + 0.5 * rng.standard_normal((len(starts), LATENT_DIM))
    vis_lat = seg_lat + VISUAL_NOISE * rng.standard_normal(seg_lat.shape)
    aud_lat = seg_lat + AUDIO_NOISE * rng.standard_normal(seg_lat.shape)
    texts = [_caption_text(rng, world, seg_lat[i], max(3, int(rng.poisson(2.0 * (ends[i] - starts[i])))))
             for i in range(len(starts))]
    return {
        "topic": topic, "duration": duration, "starts": starts, "ends": ends, "texts": texts,
        "feat_2d": _visual(rng, world.proj_2d, base, vis_lat, starts, ends, int(np.ceil(duration * FPS_2D)), FPS_2D,
                           full),
        "feat_3d": _visual(rng, world.proj_3d, base, vis_lat, starts, ends, int(duration * FPS_3D), FPS_3D, full),
        "spec": _audio(rng, world, base, aud_lat, starts, ends, int(duration * FRAMES_PER_SECOND)),
    }


# --- writing ------------------------------------------------------------------------------------
def _save_npz(path: Path, key: str, array: np.ndarray) -> None:
    """An npz holding one array; deflate level 1 (fast) — np.load reads it like np.savez output.

    The zip entry gets a fixed timestamp so that a corpus is byte-identical across runs.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
    info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(info, buf.getvalue(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)


def train_video_id(i: int) -> str:
    return f"syn{i:08d}"  # 11 characters, like a YouTube id


def train_video(settings: SynthSettings, i: int) -> dict:
    """Training video ``i`` of a corpus, in memory, exactly as write_corpus writes it.

    Returns:
        dict with ``video_id``, ``path`` (the CSV row), ``topic``, ``duration``, ``starts``, ``ends``
        (n,) float64, ``texts`` (n strings), ``feat_2d`` (T2, 2048) float32, ``feat_3d`` (T3, 2048)
        float32, ``spec`` (40, Ta) float16.
    """
    v = _make_video(_make_world(settings), np.random.default_rng([settings.seed, _STREAM_TRAIN, i]),
                    settings.video_seconds, settings.full_precision)
    vid = train_video_id(i)
    return {**v, "video_id": vid, "path": f"Cat{v['topic']:02d}/Sub{i % 4}/{vid}"}


def _write_train(root: Path, s: SynthSettings) -> None:
    rows, captions = [], {}
    # zlib releases the GIL: compressing on a helper thread overlaps with generating the next video.
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending: list = []
        for i in range(s.videos):
            v = train_video(s, i)
            vid, path = v["video_id"], v["path"]
            rows.append(path)
            captions[vid] = {"start": v["starts"], "end": v["ends"], "text": np.array(v["texts"], dtype=object)}
            pending.append(pool.submit(_save_video_files, root, path, vid, v))
            while len(pending) > 4:  # bounds the memory held by queued videos
                pending.pop(0).result()
        for job in pending:
            job.result()
    (root / VIDEO_CSV).write_text("path\n" + "".join(r + "\n" for r in rows))
    with open(root / CAPTIONS, "wb") as f:
        pickle.dump(captions, f, protocol=pickle.HIGHEST_PROTOCOL)


def _save_video_files(root: Path, path: str, vid: str, v: dict) -> None:
    _save_npz(root / FEATURES_DIR / path / f"{vid}_2d.npz", "features", v["feat_2d"])
    _save_npz(root / FEATURES_DIR / path / f"{vid}_3d.npz", "features", v["feat_3d"])
    _save_npz(root / AUDIO_DIR / path / f"{vid}_spec.npz", "arr_0", v["spec"])


def _eval_clip(world: _World, rng: np.random.Generator, s: SynthSettings) -> dict:
    """A held-out short video, taken whole as one clip: pooled (unnormalised) features, full audio."""
    import torch  # the eval-pickle format stores audio as a torch tensor

    v = _make_video(world, rng, s.eval_seconds)
    return {"2d": v["feat_2d"].max(axis=0), "3d": v["feat_3d"].max(axis=0),
            "audio": torch.from_numpy(v["spec"]),  # fp16 halves the pickle; loaders cast to fp32
            "caption": " ".join(v["texts"]), "frames_2d": v["feat_2d"], "frames_3d": v["feat_3d"]}


def _write_youcook(path: Path, world: _World, s: SynthSettings) -> None:
    clips = []
    for i in range(s.eval_clips):
        c = _eval_clip(world, np.random.default_rng([s.seed, _STREAM_EVAL, i]), s)
        clips.append({"2d": c["2d"], "3d": c["3d"], "audio": c["audio"], "caption": c["caption"],
                      "id": f"eva{i:08d}_{i % 7}"})  # first 11 characters: the "YouTube id"
    with open(path, "wb") as f:
        pickle.dump(clips, f, protocol=pickle.HIGHEST_PROTOCOL)


def _write_msrvtt(path: Path, world: _World, s: SynthSettings) -> None:
    """MSR-VTT-style test pickle: ~3.2 % of the ids are left out, as the 32 of 1000 clips without audio."""
    clips = []
    for i in range(s.msrvtt_clips):
        rng = np.random.default_rng([s.seed, _STREAM_MSRVTT, i])
        c = _eval_clip(world, rng, s)
        if rng.random() < 0.032:
            continue
        clips.append({"id": f"video{i}", "2d": c["frames_2d"], "3d": c["frames_3d"], "2d_pooled": c["2d"],
                      "3d_pooled": c["3d"], "audio": c["audio"], "caption": [c["caption"]],
                      "eval_caption": c["caption"]})
    with open(path, "wb") as f:
        pickle.dump(clips, f, protocol=pickle.HIGHEST_PROTOCOL)


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def write_corpus(out_dir: str | os.PathLike, settings: SynthSettings | None = None, **fields) -> CorpusPaths:
    """Generate a corpus into ``out_dir`` (created; existing files are overwritten).

    ``settings`` defaults to SynthSettings(); keyword ``fields`` override it, e.g.
    ``write_corpus(d, videos=16, seed=3)``.

    Writes the original layout — ``videopaths.csv``, ``features/<cat>/<sub>/<id>/<id>_{2d,3d}.npz``,
    ``audio/<cat>/<sub>/<id>/<id>_spec.npz``, ``caption.pickle``, ``word2vec.bin`` — plus the held-out
    ``youcook_val_audio.pkl`` (and ``msrvtt_jsfusion_test.pkl`` if ``settings.msrvtt_clips``) and a
    ``corpus.json`` manifest (written last: its presence marks a complete corpus).
    """
    t0 = time.perf_counter()
    settings = dataclasses.replace(settings or SynthSettings(), **fields)
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    world = _make_world(settings)
    write_word2vec_bin(root / WORD_VECTORS, world.words, world.vectors)
    _write_train(root, settings)
    _write_youcook(root / YOUCOOK_EVAL, world, settings)
    if settings.msrvtt_clips:
        _write_msrvtt(root / MSRVTT_EVAL, world, settings)
    manifest = {"settings": asdict(settings), "digest": settings.digest(),
                "seconds": round(time.perf_counter() - t0, 3), "bytes": _dir_bytes(root)}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return CorpusPaths(root)


# --- the cached default corpus --------------------------------------------------------------------
def settings_from_config(cfg) -> SynthSettings:
    """The generating settings a Config asks for (data.synthetic_*, model.word_dim)."""
    return SynthSettings(videos=cfg.data.synthetic_videos, eval_clips=cfg.data.synthetic_eval_clips,
                         topics=cfg.data.synthetic_topics, word_dim=cfg.model.word_dim)


def ensure_settings(cache_dir: str | os.PathLike, settings: SynthSettings) -> Path:
    """Generate ``settings`` once into ``cache_dir/synthetic-<digest>`` and reuse it afterwards.

    Atomic: the corpus is written into a private temporary directory and renamed into place, so a
    reader never sees a half-written corpus. If another process wins the race, its copy is kept and
    ours is discarded.
    """
    final = Path(cache_dir) / f"synthetic-{settings.digest()}"
    return build_once(final, MANIFEST, lambda tmp: write_corpus(tmp, settings), "synthetic corpus")


def ensure_corpus(cfg) -> Path:
    """The synthetic corpus for ``cfg`` under ``raymcn.config.default_cache_dir(cfg)``; see ensure_settings."""
    from raymcn.config import default_cache_dir

    return ensure_settings(default_cache_dir(cfg), settings_from_config(cfg))


# --- the default shards: the cached corpus through the real writer ---------------------------------
SYNTHETIC_SHARDS = 16  # the embedded corpus is cut into this many shards (shard order can vary per epoch)


def shard_digest(corpus_digest: str, videos_per_shard: int, seed: int, feature_dtype: str = "float32") -> str:
    ident = {"corpus": corpus_digest, "videos_per_shard": videos_per_shard, "seed": seed, "version": FORMAT_VERSION}
    if feature_dtype != "float32":  # the fp32 caches written before the setting existed keep their name
        ident["feature_dtype"] = feature_dtype
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]


def ensure_synthetic_shards(cfg) -> Path:
    """Shards of the synthetic corpus of ``cfg`` in the cache; generated once (atomic), then reused.

    The corpus comes from :func:`ensure_corpus`; the shards go to ``<cache>/shards-<digest>``
    (written into a private temporary directory, then renamed, so a reader never sees a
    half-written directory; a lost race keeps the winner's copy). Written in this process (no
    pool): the caller may be a process that already runs Ray.
    """
    from raymcn.config import default_cache_dir

    corpus = CorpusPaths(ensure_corpus(cfg))
    settings = settings_from_config(cfg)
    per_shard = max(1, math.ceil(settings.videos / SYNTHETIC_SHARDS))
    final = Path(default_cache_dir(cfg)) / f"shards-{shard_digest(settings.digest(), per_shard, 0, DEFAULT_FEATURE_DTYPE)}"

    def write(tmp: Path) -> None:  # the same feature dtype as `raymcn shards` writes by default
        shards_from_layout(corpus.features_root, corpus.audio_root, corpus.captions, corpus.video_csv,
                           corpus.word_vectors, tmp, seed=0, workers=1, videos_per_shard=per_shard,
                           feature_dtype=DEFAULT_FEATURE_DTYPE, progress=False, log=lambda msg: None)

    return build_once(final, SHARD_MANIFEST, write, "shard directory")
