"""Tokenizer, word2vec binary I/O and the memory-mapped vocabulary matrix.

The original kept the whole 3 M-word GoogleNews model (3.6 GB) in every loader process. Here the
captions are tokenised once into ids of a *vocabulary* built from the caption words that have a
vector, and the (V+1, D) matrix is saved once and memory-mapped by every worker (design "Data").
Row 0 of the matrix is all zeros and is the padding id.

Conventions kept from the original: tokens are ``re.findall(r"[\\w']+", text)``, case-sensitive (no
lower-casing), out-of-vocabulary tokens are dropped, the first ``max_words`` remaining tokens are kept.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TOKEN_RE = re.compile(r"[\w']+")
PAD_ID = 0
_READ_CHUNK = 1 << 22  # bytes per read when streaming a word2vec file


def tokenize(text) -> list[str]:
    """Words of ``text`` by the original's regex ``[\\w']+``; case is kept. Non-strings are str()-ed."""
    return TOKEN_RE.findall(text if isinstance(text, str) else str(text))


# --- word2vec binary format -----------------------------------------------------------------------
@dataclass
class WordVectors:
    """Words and their vectors as read from a word2vec file.

    Attributes:
        words: N words, in file order.
        vectors: (N, D) float32, row i belongs to ``words[i]``.
    """

    words: list[str]
    vectors: np.ndarray
    _index: dict[str, int] | None = field(default=None, repr=False)

    @property
    def index(self) -> dict[str, int]:
        if self._index is None:
            self._index = {w: i for i, w in enumerate(self.words)}
        return self._index

    def __contains__(self, word: str) -> bool:
        return word in self.index

    def __getitem__(self, word: str) -> np.ndarray:
        return self.vectors[self.index[word]]

    def get(self, word: str, default=None):
        i = self.index.get(word)
        return default if i is None else self.vectors[i]

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])


def write_word2vec_bin(path: str | os.PathLike, words: list[str], vectors: np.ndarray) -> None:
    """Write the binary word2vec format: ``b"N D\\n"``, then per word ``word b" " D×float32-LE b"\\n"``.

    The newline after each vector is what gensim and the original C tool write; readers skip it.
    """
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    if vectors.ndim != 2 or vectors.shape[0] != len(words):
        raise ValueError(f"{path}: need (N, D) vectors for N={len(words)} words, got {vectors.shape}")
    with open(path, "wb") as f:
        f.write(f"{len(words)} {vectors.shape[1]}\n".encode())
        for word, vec in zip(words, vectors):
            if not word or any(c.isspace() for c in word):
                raise ValueError(f"{path}: word {word!r} is empty or contains whitespace")
            f.write(word.encode("utf-8") + b" " + vec.tobytes() + b"\n")


def _decode_word(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # a few GoogleNews entries are not valid UTF-8; keep them, never crash
        return raw.decode("utf-8", errors="replace")


class _ByteStream:
    """Buffered reader with ``take_until(b" ")`` and ``take(n)``; keeps memory to one chunk."""

    def __init__(self, f):
        self.f, self.buf, self.pos = f, b"", 0

    def _fill(self) -> bool:
        more = self.f.read(_READ_CHUNK)
        self.buf, self.pos = self.buf[self.pos:] + more, 0
        return bool(more)

    def take_until(self, sep: bytes) -> bytes | None:
        while (end := self.buf.find(sep, self.pos)) < 0:
            if not self._fill():
                return None
        out, self.pos = self.buf[self.pos:end], end + 1
        return out

    def take(self, n: int) -> bytes | None:
        while len(self.buf) - self.pos < n:
            if not self._fill():
                return None
        out, self.pos = self.buf[self.pos:self.pos + n], self.pos + n
        return out


def read_word2vec_bin(path: str | os.PathLike, keep: Iterable[str] | None = None) -> WordVectors:
    """Read a binary word2vec file (GoogleNews-vectors-negative300.bin or one from write_word2vec_bin).

    Args:
        path: the file.
        keep: if given, only these words are kept (the 3 M-word GoogleNews file then costs only the
            memory of the caption vocabulary).

    Returns:
        WordVectors with (N_kept, D) float32 vectors, in file order.

    Raises:
        ValueError: naming the file, on a bad header or a truncated entry.
    """
    keep_set = None if keep is None else set(keep)
    with open(path, "rb") as f:
        header = f.readline().split()
        if len(header) != 2 or not all(h.isdigit() for h in header):
            raise ValueError(f"{path}: not a binary word2vec file (header {header!r}, expected b'N D')")
        n, dim = int(header[0]), int(header[1])
        stream, words = _ByteStream(f), []
        # All words: fill one preallocated matrix. A subset: collect rows (never allocate N × D).
        vectors = np.empty((n, dim), np.float32) if keep_set is None else []
        for i in range(n):
            raw = stream.take_until(b" ")
            vec = None if raw is None else stream.take(4 * dim)
            if vec is None:
                raise ValueError(f"{path}: truncated at entry {i} of {n}")
            word = _decode_word(raw.lstrip(b"\n"))  # the optional newline ends the previous vector
            if keep_set is None:
                words.append(word)
                vectors[i] = np.frombuffer(vec, dtype="<f4")
            elif word in keep_set:
                words.append(word)
                vectors.append(np.frombuffer(vec, dtype="<f4"))
    if isinstance(vectors, list):
        vectors = np.stack(vectors).astype(np.float32) if vectors else np.zeros((0, dim), np.float32)
    return WordVectors(words, vectors)


# --- vocabulary -----------------------------------------------------------------------------------
@dataclass
class Vocab:
    """Caption vocabulary: id i >= 1 is ``words[i-1]``; id 0 is padding.

    Attributes:
        words: V words.
        matrix: (V+1, D) float32, row 0 zeros (possibly a read-only memory map).

    Unpacks as ``words, matrix = vocab``.
    """

    words: list[str]
    matrix: np.ndarray
    _word_to_id: dict[str, int] | None = field(default=None, repr=False)

    def __iter__(self):
        return iter((self.words, self.matrix))

    @property
    def word_to_id(self) -> dict[str, int]:
        if self._word_to_id is None:
            self._word_to_id = {w: i + 1 for i, w in enumerate(self.words)}
        return self._word_to_id

    @property
    def dim(self) -> int:
        return int(self.matrix.shape[1])

    def encode(self, text, max_words: int) -> np.ndarray:
        return encode(text, self.word_to_id, max_words)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Token ids (..., W) -> word vectors (..., W, D) float32; id 0 gives zeros."""
        return np.asarray(self.matrix[np.asarray(ids)], dtype=np.float32)


def build_vocab(captions_texts: Iterable, word_vectors: WordVectors | Mapping[str, np.ndarray]) -> Vocab:
    """Vocabulary of the caption tokens that have a vector, in order of first appearance.

    Args:
        captions_texts: caption strings (any iterable; each item is tokenised with :func:`tokenize`).
        word_vectors: WordVectors or a mapping word -> (D,) vector.

    Returns:
        Vocab: V words and the (V+1, D) float32 matrix, row 0 = zeros (padding).
    """
    seen: dict[str, None] = {}
    for text in captions_texts:
        for tok in tokenize(text):
            if tok not in seen and tok in word_vectors:
                seen[tok] = None
    words = list(seen)
    if isinstance(word_vectors, WordVectors):
        dim = word_vectors.dim
    elif word_vectors:
        dim = len(next(iter(word_vectors.values())))
    else:
        raise ValueError("build_vocab: no word vectors given")
    matrix = np.zeros((len(words) + 1, dim), np.float32)
    for i, w in enumerate(words):
        matrix[i + 1] = word_vectors[w]
    return Vocab(words, matrix)


def word_counts(ids: np.ndarray) -> np.ndarray:
    """Each caption's word count: (..., max_words) token ids, right-padded with PAD_ID (an id no
    word has) -> (...,) int32. Counted from the ids, not the vectors: a word's vector may be zero."""
    return np.count_nonzero(np.asarray(ids) != PAD_ID, axis=-1).astype(np.int32)


def token_ids(text, word_to_id: Mapping[str, int]) -> np.ndarray:
    """All in-vocabulary token ids of ``text`` in order, OOV dropped; (n,) int32, no padding."""
    return np.array([word_to_id[t] for t in tokenize(text) if t in word_to_id], dtype=np.int32)


def encode(text, word_to_id: Mapping[str, int], max_words: int) -> np.ndarray:
    """Token ids ``(max_words,)`` int32: OOV dropped, first ``max_words`` kept, zero-padded (id 0)."""
    return pad_ids(token_ids(text, word_to_id), max_words)


def pad_ids(ids: np.ndarray, max_words: int) -> np.ndarray:
    """First ``max_words`` of ``ids``, right-padded with PAD_ID; (max_words,) int32."""
    out = np.full(max_words, PAD_ID, dtype=np.int32)
    ids = np.asarray(ids, dtype=np.int32)[:max_words]
    out[:len(ids)] = ids
    return out


def save_vocab(directory: str | os.PathLike, vocab: Vocab) -> None:
    """Write ``vocab.npy`` (the (V+1, D) float32 matrix) and ``vocab.txt`` (V words, one per line)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    words, matrix = vocab
    if matrix.shape[0] != len(words) + 1:
        raise ValueError(f"vocab matrix has {matrix.shape[0]} rows for {len(words)} words (+1 padding row)")
    if any("\n" in w or "\r" in w for w in words):
        raise ValueError("vocab words must not contain line breaks")
    np.save(d / "vocab.npy", np.asarray(matrix, dtype=np.float32))
    (d / "vocab.txt").write_text("".join(w + "\n" for w in words), encoding="utf-8")


def load_vocab(directory: str | os.PathLike) -> Vocab:
    """Read a vocabulary saved by :func:`save_vocab`; the matrix is a read-only memory map."""
    d = Path(directory)
    try:
        matrix = np.load(d / "vocab.npy", mmap_mode="r")
        words = (d / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    except FileNotFoundError as e:
        raise FileNotFoundError(f"vocabulary file missing: {e.filename}") from None
    if matrix.ndim != 2 or matrix.shape[0] != len(words) + 1:
        raise ValueError(f"{d}: vocab.npy has shape {matrix.shape} but vocab.txt lists {len(words)} words "
                         "(expected V+1 rows)")
    return Vocab(words, matrix)
