"""Small file helpers shared by the data layer: atomic build-once directories, checked pickles."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_once(final: Path, marker: str, write: Callable[[Path], object], what: str) -> Path:
    """Return ``final``, writing it with ``write(tmp_dir)`` first if ``final/marker`` is missing.

    Atomic: the content is written into a private temporary directory next to ``final`` and
    renamed into place, so a reader never sees a half-written directory. If another process wins
    the race, its copy is kept and ours is discarded.
    """
    if (final / marker).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / marker).is_file():  # not a lost race: an incomplete directory in the way
                raise RuntimeError(f"{final} exists but holds no {marker}; it is not a complete "
                                   f"{what} (delete it to regenerate)") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers see the old or the new text."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_pickle(path: str | os.PathLike, what: str, error: type[Exception]):
    """Unpickle ``path``; a missing or unreadable file raises ``error`` naming ``what`` and the path."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure is reported the same way
        raise error(f"{what} {path} is unreadable: {type(e).__name__}: {e}") from None
