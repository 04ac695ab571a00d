"""The shards' vocabulary: the caption words that have a word vector, built once per conversion.

One tokenising pass over the captions of the listed videos; the matrix (``vocab.npy``) and the
words (``vocab.txt``) are written once, marked done, and reused by a rerun.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from raymcn.data.formats.features import video_id_of
from raymcn.data.formats.files import write_text_atomic
from raymcn.data.formats.manifest import ShardError
from raymcn.data.formats.words import Vocab, build_vocab, load_vocab, read_word2vec_bin, save_vocab, tokenize
from raymcn.data.write.sources import LayoutSources
from raymcn.data.write.writer import DONE_DIR, file_sha256

VOCAB_MARKER = "vocab.json"  # inside DONE_DIR


def _caption_texts(paths: Iterable[str], captions) -> Iterator[str]:
    for p in paths:
        rec = captions.get(video_id_of(p))
        if rec is None:
            continue
        try:
            yield from (t if isinstance(t, str) else str(t) for t in rec["text"])
        except (KeyError, TypeError):
            continue


def existing_vocab(out: Path, key: str) -> Vocab | None:
    """The vocabulary an earlier run of this conversion (plan ``key``) wrote in ``out``, or None."""
    with contextlib.suppress(OSError, ValueError):
        m = json.loads((out / DONE_DIR / VOCAB_MARKER).read_text())
        if m.get("plan") == key and (out / "vocab.npy").is_file() and (out / "vocab.txt").is_file():
            vocab = load_vocab(out)
            if len(vocab.words) == m.get("words"):
                return vocab
    return None


def build_vocab_files(out: Path, plan: dict, src: LayoutSources, captions) -> Vocab:
    """The vocabulary of the caption words of the plan's videos that have a vector, written to
    ``out`` and marked done. ``captions``: the unpickled caption table."""
    marker = out / DONE_DIR / VOCAB_MARKER
    paths = [p for s in plan["shards"] for p in s["paths"]]
    # One tokenising pass (HowTo100M has ~10^8 captions): the words in order of first appearance;
    # the vocabulary is then what build_vocab gives: those words that have a vector, in that order.
    first_seen: dict[str, None] = {}
    for text in _caption_texts(paths, captions):
        for tok in tokenize(text):
            first_seen.setdefault(tok)
    try:
        wv = read_word2vec_bin(src.word_vectors, keep=first_seen)
    except ValueError as e:
        raise ShardError(str(e)) from None
    except OSError as e:
        raise ShardError(f"--word-vectors {src.word_vectors}: unreadable ({e})") from None
    if not wv.words:
        raise ShardError(f"--word-vectors {src.word_vectors}: none of the {len(first_seen)} caption words "
                         "has a vector")
    vocab = build_vocab([" ".join(first_seen)], wv)
    tmpdir = Path(tempfile.mkdtemp(prefix=".vocab-", dir=out))
    try:
        save_vocab(tmpdir, vocab)
        os.replace(tmpdir / "vocab.npy", out / "vocab.npy")
        os.replace(tmpdir / "vocab.txt", out / "vocab.txt")
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    write_text_atomic(marker, json.dumps({"plan": plan["plan"], "words": len(vocab.words),
                                           "dim": vocab.dim, "sha256": file_sha256(out / "vocab.npy")}))
    return load_vocab(out)
