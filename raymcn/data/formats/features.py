"""The original per-video HowTo100M feature layout and the clip sampler (steps 1–5).

Layout read here (``path`` = one row of the video-path CSV, leading ``None/`` stripped)::

    {features_root}/{path}_2d.npz     key "features": (T2, 2048), 1 row/s     (2D ResNet-152)
    {features_root}/{path}_3d.npz     key "features": (T3, 2048), 1.5 rows/s  (3D ResNeXt-101)
    {audio_root}/{path}_spec.npz      key "arr_0":    (40, Ta) fp16 log-mel, 100 frames/s, <= 0 dB
    caption pickle: dict video_id -> {"start": (n,), "end": (n,), "text": n strings}

where ``{path}_2d.npz`` means ``{path}/<video_id>_2d.npz`` (video_id = last path component).

Clip sampling follows the original ``Youtube_DataLoader`` with its bugs fixed (each fix is noted
where it happens): negative audio start frames are clamped at 0, video row ranges are
clamped to the rows that exist and an empty range falls back to the nearest row.
"""

from __future__ import annotations

import csv
import math
import os
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raymcn.config import PermanentError
from raymcn.data.formats.files import load_pickle
from raymcn.data.formats.words import PAD_ID, token_ids, word_counts

FEATURE_DIM = 2048  # per half; the model's video input is 2 × 2048
MEL_BINS = 40
FPS_2D = 1.0
FPS_3D = 1.5
AUDIO_SR = 16000  # the spectrogram recipe: 16 kHz, n_fft 400, hop 160 -> 100 frames/s
AUDIO_HOP = 160
AUDIO_NFFT = 400


class FeatureFileError(ValueError, PermanentError):
    """A missing or unreadable feature/caption file; the message names the file and the video."""


# --- the video list and the caption pickle ----------------------------------------------------------
def read_video_paths(csv_path: str | os.PathLike) -> list[str]:
    """Rows of the video-path CSV (header ``path``), with a leading ``None/`` stripped."""
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "path" not in reader.fieldnames:
            raise FeatureFileError(f"{csv_path}: expected a CSV with header 'path', got {reader.fieldnames}")
        rows = [r["path"].strip() for r in reader if r["path"] and r["path"].strip()]
    return [p.removeprefix("None/") for p in rows]


def video_id_of(path: str) -> str:
    """The video id is the last component of a CSV path."""
    return path.rstrip("/").split("/")[-1]


def load_captions(pickle_path: str | os.PathLike) -> dict:
    """The caption pickle: dict video_id -> record with parallel ``start``, ``end``, ``text``."""
    captions = load_pickle(pickle_path, "caption pickle", FeatureFileError)
    if not isinstance(captions, Mapping):
        raise FeatureFileError(f"caption pickle {pickle_path}: expected a dict video_id -> captions, "
                               f"got {type(captions).__name__}")
    return captions


# --- one video --------------------------------------------------------------------------------------
@dataclass
class VideoRecord:
    """Everything the clip sampler needs from one video.

    Attributes:
        video_id: the id (last component of the CSV path).
        feat_2d: (T2, 2048) float32 (float16 from shards written with ``--dtype float16``), 1 row per second.
        feat_3d: (T3, 2048), the dtype of feat_2d, 1.5 rows per second.
        spec: (40, Ta) float16 log-mel spectrogram, 100 frames per second.
        starts, ends: (n,) float64 caption times in seconds.
        token_ids: flat int32 token ids of all captions (OOV dropped; each caption cut to its first
            ``max_words`` ids if read with max_words), caption i is
            ``token_ids[token_offsets[i]:token_offsets[i+1]]``. Ragged because merged captions
            concatenate whole captions.
        token_offsets: (n+1,) int64.
    """

    video_id: str
    feat_2d: np.ndarray
    feat_3d: np.ndarray
    spec: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    token_ids: np.ndarray
    token_offsets: np.ndarray

    @property
    def num_captions(self) -> int:
        return len(self.starts)

    def caption_tokens(self, i: int) -> np.ndarray:
        """Token ids of caption i, (k,) int32."""
        return self.token_ids[self.token_offsets[i]:self.token_offsets[i + 1]]


def pack_tokens(per_caption: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged token lists -> (flat int32 ids, (n+1,) int64 offsets)."""
    lengths = np.array([len(t) for t in per_caption], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.concatenate(per_caption).astype(np.int32) if per_caption else np.zeros(0, np.int32)
    return flat, offsets


def _load_npz_array(path: Path, key: str) -> np.ndarray:
    if not path.is_file():
        raise FeatureFileError(f"missing file {path}")
    try:
        with np.load(path) as z:
            if key not in z.files:
                raise FeatureFileError(f"{path}: no key '{key}' (keys: {z.files})")
            return z[key]
    except FeatureFileError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise FeatureFileError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def visual_array(arr: np.ndarray, where: str) -> np.ndarray:
    """A 2d/3d feature array checked ((T, 2048)) and as float32; ``where`` names it in the error."""
    if arr.ndim != 2 or arr.shape[1] != FEATURE_DIM:
        raise FeatureFileError(f"{where}: key 'features' has shape {arr.shape}, expected (T, {FEATURE_DIM})")
    return np.ascontiguousarray(arr, dtype=np.float32)


def spec_array(arr: np.ndarray, where: str) -> np.ndarray:
    """A spectrogram checked ((40, T)) and as float16; ``where`` names it in the error."""
    if arr.ndim != 2 or arr.shape[0] != MEL_BINS:
        raise FeatureFileError(f"{where}: key 'arr_0' has shape {arr.shape}, expected ({MEL_BINS}, T)")
    return np.ascontiguousarray(arr, dtype=np.float16)


def video_record(vid: str, feat_2d: np.ndarray, feat_3d: np.ndarray, spec: np.ndarray, captions: Mapping,
                 word_to_id: Mapping[str, int], max_words: int | None = None,
                 caption_source: str = "<captions>") -> VideoRecord:
    """One video's record from its checked arrays and its captions (the folder and the tar readers')."""
    starts, ends, tokens = _caption_arrays(vid, captions, word_to_id, max_words, caption_source)
    flat, offsets = pack_tokens(tokens)
    return VideoRecord(vid, feat_2d, feat_3d, spec, starts, ends, flat, offsets)


def caption_fields(video_id: str, captions: Mapping, source: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(starts, ends, texts) of ``video_id``'s captions: two (n,) float64 arrays and n strings, checked.

    ``captions`` is the caption pickle's dict, or a store with a ``fields(video_id)`` method that
    returns what this function returned for the pickle when the store was built (the shard
    writer's ``data/write/captions.py``), so both give the same values and the same errors.

    Raises:
        FeatureFileError: no entry for the video, or one without equal, non-empty start/end/text.
    """
    if hasattr(captions, "fields"):
        return captions.fields(video_id)
    if video_id not in captions:
        raise FeatureFileError(f"caption pickle {source}: no entry for video {video_id}")
    rec = captions[video_id]
    try:
        starts = np.asarray(rec["start"], dtype=np.float64).reshape(-1)
        ends = np.asarray(rec["end"], dtype=np.float64).reshape(-1)
        texts = [t if isinstance(t, str) else str(t) for t in rec["text"]]  # as tokenize() reads them
    except (KeyError, TypeError, ValueError) as e:
        raise FeatureFileError(f"caption pickle {source}: entry {video_id} lacks start/end/text ({e})") from None
    if not (len(starts) == len(ends) == len(texts)) or len(starts) == 0:
        raise FeatureFileError(f"caption pickle {source}: entry {video_id} has {len(starts)} starts, "
                               f"{len(ends)} ends, {len(texts)} texts (need equal, >= 1)")
    return starts, ends, texts


def _caption_arrays(video_id: str, captions: Mapping, word_to_id: Mapping[str, int],
                    max_words: int | None, source: str) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    starts, ends, texts = caption_fields(video_id, captions, source)
    # Each caption contributes at most its first max_words ids to any merged caption, so truncating
    # here loses nothing and bounds the stored size.
    tokens = [token_ids(t, word_to_id)[:max_words] for t in texts]
    return starts, ends, tokens


def read_video(path: str, features_root: str | os.PathLike, audio_root: str | os.PathLike,
               captions: Mapping, word_to_id: Mapping[str, int], max_words: int | None = None,
               caption_source: str = "<captions>") -> VideoRecord:
    """Read one video of the original layout.

    Args:
        path: a CSV row (``category/subfolder/<video_id>``; ``None/`` already stripped).
        features_root, audio_root: the roots of the 2d/3d and spectrogram files.
        captions: the loaded caption pickle.
        word_to_id: vocabulary (id 0 = padding is never produced).
        max_words: keep at most this many ids per caption (None keeps all).
        caption_source: name of the caption pickle, used in error messages.

    Raises:
        FeatureFileError: naming the missing/unreadable file or caption entry.
    """
    vid = video_id_of(path)
    fdir, adir = Path(features_root) / path, Path(audio_root) / path
    feats = [visual_array(_load_npz_array(f, "features"), str(f)) for f in (fdir / f"{vid}_2d.npz",
                                                                          fdir / f"{vid}_3d.npz")]
    spec_file = adir / f"{vid}_spec.npz"
    spec = spec_array(_load_npz_array(spec_file, "arr_0"), str(spec_file))
    return video_record(vid, feats[0], feats[1], spec, captions, word_to_id, max_words, caption_source)


def iter_videos(paths: Iterable[str], features_root, audio_root, captions: Mapping,
                word_to_id: Mapping[str, int], max_words: int | None = None,
                caption_source: str = "<captions>") -> Iterator[tuple[str, VideoRecord | None, str | None]]:
    """Read many videos; yields ``(video_id, record, None)`` or ``(video_id, None, reason)``.

    A missing or unreadable file never stops the iteration: the caller counts and reports it.
    """
    for path in paths:
        vid = video_id_of(path)
        try:
            yield vid, read_video(path, features_root, audio_root, captions, word_to_id, max_words,
                                  caption_source), None
        except FeatureFileError as e:
            yield vid, None, str(e)


def read_videos(paths: Iterable[str], features_root, audio_root, captions: Mapping,
                word_to_id: Mapping[str, int], max_words: int | None = None,
                caption_source: str = "<captions>") -> tuple[list[VideoRecord], list[tuple[str, str]]]:
    """Read many videos; returns (records, problems) with problems = [(video_id, reason)]."""
    records, problems = [], []
    for vid, rec, reason in iter_videos(paths, features_root, audio_root, captions, word_to_id, max_words,
                                        caption_source):
        if rec is None:
            problems.append((vid, reason))
        else:
            records.append(rec)
    return records, problems


# --- clip sampling, one function per step of the original sampler ---------------------------------
def draw_caption_indices(num_captions: int, n_pair: int, rng: np.random.Generator) -> np.ndarray:
    """Step 1: ``n_pair`` caption indices drawn uniformly with replacement; (n_pair,) int64."""
    return rng.integers(0, num_captions, size=n_pair)


def grow_span(starts: np.ndarray, ends: np.ndarray, index: int, min_time: float) -> tuple[int, int, list[int]]:
    """Step 2: grow caption ``index`` by whole neighbours until end - start >= min_time.

    With both neighbours available, absorb the one giving the shorter new span (tie -> the previous
    one); at a boundary absorb the only side; stop when no neighbour is left.

    Returns:
        (first, last, order): the caption range [first, last] and the captions in the order their
        words are concatenated: ``index`` first, then each absorbed caption appended at the END,
        even when it precedes the span in time. That scrambling is the original's and is kept
        on purpose so that the text a clip gets matches the original's.
    """
    first = last = int(index)
    order = [first]
    n = len(starts)
    while ends[last] - starts[first] < min_time:
        has_prev, has_next = first > 0, last < n - 1
        if has_prev and has_next:
            take_prev = ends[last] - starts[first - 1] <= ends[last + 1] - starts[first]
        elif has_prev or has_next:
            take_prev = has_prev
        else:
            break
        if take_prev:
            first -= 1
            order.append(first)
        else:
            last += 1
            order.append(last)
    return first, last, order


def audio_frame(t: float) -> int:
    """Spectrogram frame of time ``t`` (s): floor((floor(16000 t) - 200) / 160), clamped at 0.

    This is librosa's time_to_frames with n_fft=400 (about 100 t - 1.25). The clamp fixes a bug:
    the original let t < 12.5 ms give a negative start and hence an empty slice (silent clip).
    """
    return max(0, (math.floor(AUDIO_SR * t) - AUDIO_NFFT // 2) // AUDIO_HOP)


def audio_clip(spec: np.ndarray, start: float, end: float, audio_frames: int,
               out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Step 3: frames [f(start), f(end)) of ``spec``, first ``audio_frames`` kept, right zero-padded.

    Args:
        out: the (40, audio_frames) float16 array to fill, padding included (a new one if None).

    Returns:
        audio: (40, audio_frames) float16 (``out`` if given).
        nframes: number of real (unpadded) frames, min(len, audio_frames). It is 0 when the slice
            is empty (span beyond the end of the audio); the model clamps its pooled steps to >= 1,
            so the clip then pools the zero padding. Zero padding equals 0 dB, the *loudest* value
            of a ref=max spectrogram (the original's padding, kept): the model pools with the
            nframes mask, so padding does not enter the pooled audio.
    """
    seg = spec[:, audio_frame(start):audio_frame(end)][:, :audio_frames]
    if out is None:
        out = np.empty((spec.shape[0], audio_frames), dtype=np.float16)
    out[:, :seg.shape[1]] = seg
    out[:, seg.shape[1]:] = 0
    return out, int(seg.shape[1])


def video_rows(num_rows: int, start: float, end: float, fps: float) -> tuple[int, int]:
    """Step 4 row range: floor(start·fps) .. floor(end·fps) INCLUSIVE, clamped to existing rows.

    The original sliced ``[floor(start·fps) : floor(end·fps) + 1]`` and silently got fewer (or no)
    rows near the end of the video. Here a range past the last row falls back to the last row
    (the nearest one), so a clip always pools at least one row. Returns (lo, hi), or (0, -1) when
    the video has no rows at all.
    """
    if num_rows == 0:
        return 0, -1
    lo = min(max(0, math.floor(start * fps)), num_rows - 1)
    hi = min(max(lo, math.floor(end * fps)), num_rows - 1)
    return lo, hi


def l2_normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Row-wise (last axis) L2 normalisation; an all-zero vector stays zero. float32."""
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def fp16_max_bits(rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The column max of (n, F) float16 ``rows``, n >= 1, written into (F,) int16 ``out`` as the
    max's bit pattern; returns ``out``.

    Compared as int16, fp16 bit patterns order like the values among non-negative values, in
    reverse among negative ones, and every negative one is below every non-negative one. So the
    integer max is the value max wherever a column holds a value >= +0.0, and a column of negative
    values only takes the integer min instead (-0.0 is the smallest integer: the max of any
    negatives, as numpy's max has it). numpy's own fp16 max converts element by element (10x slower
    on a clip's 16 x 2048 rows, measured). One difference: a NaN with its sign bit set is lost in a
    column that also holds a non-negative value, where numpy's max returns NaN."""
    raw = rows.view(np.int16)
    np.maximum.reduce(raw, axis=0, out=out)
    negative = out < 0
    if negative.any():  # rare in post-ReLU features
        out[negative] = raw[:, negative].min(axis=0)
    return out


# every fp16 bit pattern's float32 value: a gather from it converts 2x faster than numpy's astype
_FP16_AS_FP32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def pool_clips(feat: np.ndarray, starts: np.ndarray, ends: np.ndarray, fps: float) -> np.ndarray:
    """Step 4 for one half and every clip: max-pool the rows of each clip's span (:func:`video_rows`),
    then L2-normalise; (n_clips, F) float32, zeros if the video has no rows.

    Each clip's max is written into its row of one array, then every row is converted and
    normalised at once: per-clip temporaries and norms had been the largest part of clip drawing."""
    n, dim = len(starts), feat.shape[1]
    if feat.shape[0] == 0:
        return np.zeros((n, dim), np.float32)
    spans = [video_rows(feat.shape[0], s, e, fps) for s, e in zip(starts, ends)]
    if feat.dtype == np.float16:
        bits = np.empty((n, dim), np.int16)
        for j, (lo, hi) in enumerate(spans):
            fp16_max_bits(feat[lo:hi + 1], bits[j])
        pooled = np.take(_FP16_AS_FP32, bits.view(np.uint16))
    else:
        pooled = np.empty((n, dim), np.float32)
        for j, (lo, hi) in enumerate(spans):
            np.maximum.reduce(feat[lo:hi + 1], axis=0, out=pooled[j])
    return l2_normalize(pooled)


def video_clips(record: VideoRecord, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Step 4: per clip [pooled 2d (1 fps) ‖ pooled 3d (1.5 fps)], each half L2-normalised; (n, 4096) float32."""
    return np.concatenate([pool_clips(record.feat_2d, starts, ends, FPS_2D),
                           pool_clips(record.feat_3d, starts, ends, FPS_3D)], axis=1)


def text_clip_ids(record: VideoRecord, order: list[int], max_words: int) -> np.ndarray:
    """Token ids of the merged caption (captions concatenated in ``order``), first max_words; (max_words,) int32."""
    out = np.full(max_words, PAD_ID, dtype=np.int32)
    filled = 0
    for i in order:
        if filled >= max_words:
            break
        ids = record.caption_tokens(i)[:max_words - filled]
        out[filled:filled + len(ids)] = ids
        filled += len(ids)
    return out


def empty_clips(n: int, audio_frames: int, max_words: int, vocab_matrix: np.ndarray | None) -> dict[str, np.ndarray]:
    """Uninitialised arrays for ``n`` clips: the keys and shapes :func:`sample_clips` returns."""
    out = {"video": np.empty((n, 2 * FEATURE_DIM), np.float32),
           "audio": np.empty((n, MEL_BINS, audio_frames), np.float16),
           "nframes": np.empty(n, np.int32), "text_ids": np.empty((n, max_words), np.int32),
           "nwords": np.empty(n, np.int32),
           "start": np.empty(n, np.float64), "end": np.empty(n, np.float64)}
    if vocab_matrix is not None:  # float32, or uint16 when the vectors are bfloat16 bit patterns
        dtype = np.uint16 if vocab_matrix.dtype == np.uint16 else np.float32
        out["text"] = np.empty((n, max_words, vocab_matrix.shape[1]), dtype)
    return out


def sample_clips(record: VideoRecord, n_pair: int, min_time: float, audio_frames: int, max_words: int,
                 rng: np.random.Generator, vocab_matrix: np.ndarray | None,
                 out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Steps 1–5 for one video.

    Args:
        vocab_matrix: (V+1, D) word vectors, row 0 zeros; None skips the ``text`` key (the consumer
            then looks the ``text_ids`` up itself).
        out: arrays to write into (:func:`empty_clips` of ``n_pair``, or rows of a larger batch's);
            new ones if None.

    Returns:
        dict (``out`` if given) with
          video (n_pair, 4096) float32, audio (n_pair, 40, audio_frames) float16,
          nframes (n_pair,) int32, text_ids (n_pair, max_words) int32, nwords (n_pair,) int32 (each
          caption's words: the ids before the padding),
          text (n_pair, max_words, D) float32 (if vocab_matrix is given; uint16 if the matrix
          holds bfloat16 bit patterns),
          start, end (n_pair,) float64: the grown spans in seconds.
    """
    out = empty_clips(n_pair, audio_frames, max_words, vocab_matrix) if out is None else out
    for j, i in enumerate(draw_caption_indices(record.num_captions, n_pair, rng)):
        first, last, order = grow_span(record.starts, record.ends, int(i), min_time)
        start, end = record.starts[first], record.ends[last]
        out["start"][j], out["end"][j] = start, end
        out["nframes"][j] = audio_clip(record.spec, start, end, audio_frames, out=out["audio"][j])[1]
        out["text_ids"][j] = text_clip_ids(record, order, max_words)
    out["nwords"][:] = word_counts(out["text_ids"])
    out["video"][:] = video_clips(record, out["start"], out["end"])
    if vocab_matrix is not None:
        out["text"][:] = vocab_matrix[out["text_ids"]]
    return out


def sample_batch(records: Sequence[VideoRecord], rngs: Sequence[np.random.Generator], n_pair: int, min_time: float,
                 audio_frames: int, max_words: int, vocab_matrix: np.ndarray | None) -> dict:
    """:func:`sample_clips` of every video (video i with ``rngs[i]``), flattened video-major (each
    video's clips are consecutive rows). Each video's clips are written straight into the batch's
    arrays: concatenating per-video arrays copied ~3.8 MB per video at paper size (0.9 ms, measured).

    Returns:
        dict with video (B, 4096), audio (B, 40, audio_frames), nframes (B,), text_ids (B, max_words),
        nwords (B,), text (B, max_words, D) if vocab_matrix is given, start, end (B,), B = len(records) · n_pair,
        and ``key``: B strings ``"<video_id>#<clip index>"``.
    """
    if len(records) != len(rngs):
        raise ValueError(f"sample_batch: {len(records)} videos but {len(rngs)} generators")
    if not records:
        raise ValueError("sample_batch: empty batch")
    batch: dict = empty_clips(len(records) * n_pair, audio_frames, max_words, vocab_matrix)
    for i, (record, rng) in enumerate(zip(records, rngs)):
        rows = slice(i * n_pair, (i + 1) * n_pair)
        sample_clips(record, n_pair, min_time, audio_frames, max_words, rng, vocab_matrix,
                     out={k: a[rows] for k, a in batch.items()})
    batch["key"] = [f"{r.video_id}#{j}" for r in records for j in range(n_pair)]
    return batch
