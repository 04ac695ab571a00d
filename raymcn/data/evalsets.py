"""Zero-shot retrieval sets in the AVLnet pickle format, in the training batch contract.

A set is a pickled list of per-clip dicts:

* ``youcook:FILE``  keys ``2d``, ``3d`` (2048 each), ``audio`` (torch tensor (40, n)), ``caption`` (str),
  ``id``; audio padded/truncated to 5120 frames.
* ``msrvtt:FILE``   keys ``2d_pooled``, ``3d_pooled``, ``audio``, ``eval_caption`` (str; ``caption``
  is used if absent), ``id``; audio padded/truncated to 3072 frames. The 1k-A test pickle holds only
  the 968 of 1000 clips that have audio: R@K keeps the denominator 1000 (missing = misses).
* ``synthetic``     the held-out split of the synthetic corpus (YouCook2 format, 1024 frames),
  named by its file once the entry point resolved it (``train/inputs.py``).

Each video half is L2-normalised. ``nframes`` is the true spectrogram length and may exceed the
padded length T (the model clamps its pooling mask to T).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raymcn.config import NodeInputError, PermanentError, metric_table
from raymcn.data.formats.features import FEATURE_DIM, MEL_BINS, l2_normalize
from raymcn.data.formats.files import load_pickle
from raymcn.data.formats.words import Vocab, WordVectors, build_vocab, read_word2vec_bin, tokenize, word_counts

YOUCOOK_FRAMES = 1024 * 5
MSRVTT_FRAMES = 1024 * 3
SYNTHETIC_FRAMES = 1024  # the synthetic clips last 6–12 s; a multiple of DAVEnet's 16x downsampling
MSRVTT_TEST_QUERIES = 1000  # the 1k-A (JSFusion) test set


class EvalSetError(ValueError, PermanentError, NodeInputError):
    """A malformed evaluation pickle; the message names the file, the entry and the key."""


@dataclass
class EvalSet:
    """One evaluation set, row i of every array is clip i.

    Attributes:
        video: (N, 4096) float32, [2d ‖ 3d], each half L2-normalised.
        audio: (N, 40, T) float32, zero-padded / truncated on the right.
        nframes: (N,) int32 true spectrogram lengths (may exceed T).
        text: (N, max_words, D) float32 word vectors (padding rows zero).
        text_ids: (N, max_words) int32 ids into ``vocab``.
        nwords: (N,) int32 each caption's word count (from ``text_ids``; a property).
        ids: N clip ids.
        captions: N caption strings.
        num_queries_total: R@K denominator (MSR-VTT 1k-A: 1000 although fewer clips are present).
        note: a human-readable remark to print with the results ("" if none).
        name: the spec string.
    """

    video: np.ndarray
    audio: np.ndarray
    nframes: np.ndarray
    text: np.ndarray
    text_ids: np.ndarray
    ids: list[str]
    captions: list[str]
    num_queries_total: int
    note: str
    name: str
    vocab: Vocab

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def nwords(self) -> np.ndarray:
        return word_counts(self.text_ids)


def parse_eval_spec(spec: str) -> tuple[str, str]:
    """``"youcook:FILE"`` -> ("youcook", "FILE"); ``"synthetic"`` -> ("synthetic", "")."""
    kind, _, path = spec.partition(":")
    if kind not in ("youcook", "msrvtt", "synthetic") or (kind == "synthetic") != (path == ""):
        raise ValueError(f"eval set {spec!r}: allowed forms are synthetic, youcook:FILE, msrvtt:FILE")
    return kind, path


def load_eval_list(path: Path) -> list:
    """The per-clip dicts of an eval pickle; EvalSetError naming the file otherwise."""
    data = load_pickle(path, "eval pickle", EvalSetError)
    if not isinstance(data, list) or not data:
        raise EvalSetError(f"eval pickle {path}: expected a non-empty list of per-clip dicts, "
                           f"got {type(data).__name__}{'' if not isinstance(data, list) else ' (empty)'}")
    return data


def _where(path: Path, i: int, entry) -> str:
    cid = entry.get("id", "?") if isinstance(entry, Mapping) else "?"
    return f"eval pickle {path}: entry {i} (id={cid})"


def _get(entry, key: str, path: Path, i: int):
    if not isinstance(entry, Mapping):
        raise EvalSetError(f"{_where(path, i, entry)} is a {type(entry).__name__}, expected a dict")
    if key not in entry:
        raise EvalSetError(f"{_where(path, i, entry)} lacks key '{key}' (keys: {sorted(entry)})")
    return entry[key]


def _as_numpy(value) -> np.ndarray:
    """numpy array from a numpy array, list or torch tensor (without importing torch here)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().float().numpy()
    return np.asarray(value)


def _pooled_half(entry, key: str, path: Path, i: int) -> np.ndarray:
    try:
        arr = _as_numpy(_get(entry, key, path, i)).astype(np.float32).reshape(-1)
    except (TypeError, ValueError) as e:
        raise EvalSetError(f"{_where(path, i, entry)} key '{key}' is not numeric: {e}") from None
    if arr.size != FEATURE_DIM:
        raise EvalSetError(f"{_where(path, i, entry)} key '{key}' has {arr.size} values, expected {FEATURE_DIM}")
    return arr


def _spectrogram(entry, path: Path, i: int) -> np.ndarray:
    arr = _as_numpy(_get(entry, "audio", path, i))
    if arr.ndim != 2 or arr.shape[0] != MEL_BINS:
        raise EvalSetError(f"{_where(path, i, entry)} key 'audio' has shape {arr.shape}, expected ({MEL_BINS}, n)")
    return arr


def _caption(entry, keys: tuple[str, ...], path: Path, i: int) -> str:
    for key in keys:
        if isinstance(entry, Mapping) and key in entry:
            value = entry[key]
            if not isinstance(value, str) and len(value) > 0:  # a list of captions: the first one
                value = value[0]
            return str(value)
    return str(_get(entry, keys[0], path, i))  # raises, naming the preferred key


def _resolve_vocab(word_vectors, captions: list[str]) -> Vocab:
    """A Vocab as given, or one built from the captions' words that have a vector."""
    if isinstance(word_vectors, Vocab):
        return word_vectors
    if isinstance(word_vectors, (str, os.PathLike)):
        needed = {tok for c in captions for tok in tokenize(c)}
        word_vectors = read_word2vec_bin(word_vectors, keep=needed)
    if isinstance(word_vectors, (WordVectors, Mapping)):
        return build_vocab(captions, word_vectors)
    raise TypeError(f"word_vectors: expected a Vocab, WordVectors, mapping or word2vec file, got "
                    f"{type(word_vectors).__name__}")


def _pad_audio(specs: list[np.ndarray], frames: int) -> tuple[np.ndarray, np.ndarray]:
    """(N, 40, frames) float32 right-padded/truncated, and the (N,) int32 true lengths."""
    audio = np.zeros((len(specs), MEL_BINS, frames), np.float32)
    for i, s in enumerate(specs):
        n = min(frames, s.shape[1])
        audio[i, :, :n] = s[:, :n]
    return audio, np.array([s.shape[1] for s in specs], dtype=np.int32)


def _load_clips(path: Path, keys_2d3d: tuple[str, str], caption_keys: tuple[str, ...]):
    entries = load_eval_list(path)
    video = np.stack([np.concatenate([l2_normalize(_pooled_half(e, k, path, i)) for k in keys_2d3d])
                      for i, e in enumerate(entries)])
    specs = [_spectrogram(e, path, i) for i, e in enumerate(entries)]
    captions = [_caption(e, caption_keys, path, i) for i, e in enumerate(entries)]
    ids = [str(_get(e, "id", path, i)) for i, e in enumerate(entries)]
    return video, specs, captions, ids


def _assemble(name: str, video, specs, captions, ids, word_vectors, max_words: int, frames: int,
              total: int, note: str) -> EvalSet:
    vocab = _resolve_vocab(word_vectors, captions)
    text_ids = np.stack([vocab.encode(c, max_words) for c in captions])
    audio, nframes = _pad_audio(specs, frames)
    return EvalSet(video=video, audio=audio, nframes=nframes, text=vocab.lookup(text_ids), text_ids=text_ids,
                   ids=ids, captions=captions, num_queries_total=total, note=note, name=name, vocab=vocab)


def load_eval_set(spec: str, word_vectors=None, max_words: int = 20, audio_frames_override: int = 0,
                  num_queries_total: int | None = None) -> EvalSet:
    """Load an evaluation set into the batch contract.

    Args:
        spec: ``youcook:FILE`` | ``msrvtt:FILE``. The ``synthetic`` set is a YouCook2-style pickle of
            the cached corpus: the entry point names it (``train/inputs.py``), so a rank only reads.
        word_vectors: a Vocab (words outside it are dropped), WordVectors / mapping, or the path of
            a word2vec .bin (only the caption words are read).
        max_words: tokens per caption.
        audio_frames_override: > 0 replaces the set's prescribed audio length T.
        num_queries_total: override of the R@K denominator (default: N, or 1000 for MSR-VTT test).

    Raises:
        EvalSetError: naming the file, the entry and the key of a malformed pickle.
        ValueError: ``synthetic`` (not resolved into its file) or no word vectors.
    """
    kind, file = parse_eval_spec(spec)
    if kind == "synthetic":
        raise ValueError("eval set 'synthetic': resolve it into the cached corpus's file first "
                         "(raymcn.train.inputs.resolve_inputs)")
    if word_vectors is None:
        raise ValueError(f"eval set {spec!r} needs word_vectors (a Vocab or a word2vec .bin file)")
    path, frames = Path(file), YOUCOOK_FRAMES if kind == "youcook" else MSRVTT_FRAMES
    frames = audio_frames_override or frames
    if kind == "msrvtt":
        video, specs, captions, ids = _load_clips(path, ("2d_pooled", "3d_pooled"), ("eval_caption", "caption"))
        total, note = _msrvtt_total(len(ids), num_queries_total)
    else:
        video, specs, captions, ids = _load_clips(path, ("2d", "3d"), ("caption",))
        total, note = num_queries_total or len(ids), ""
    return _assemble(spec, video, specs, captions, ids, word_vectors, max_words, frames, total, note)


def _msrvtt_total(present: int, override: int | None) -> tuple[int, str]:
    """R@K denominator and the note explaining it."""
    total = override or (MSRVTT_TEST_QUERIES if present <= MSRVTT_TEST_QUERIES else present)
    if total == present:
        return total, ""
    # each metric's rule is its row's in the table (config/metrics.py): all the protocol's queries, or the present
    over_all = "/".join(m.short for m in metric_table() if m.over_all_queries)
    over_present = "/".join(m.short for m in metric_table() if not m.over_all_queries)
    rules = []
    if over_all:
        rules.append(f"{over_all} divide by {total}, so the {total - present} missing clips count as misses")
    if over_present:
        rules.append(f"{over_present} are over the {present} present clips, as in the original protocol")
    return total, (f"MSR-VTT: {present} of {total} test clips are in the pickle (the others have no audio); "
                   + "; ".join(rules))
