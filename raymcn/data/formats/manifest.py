"""The shard folder's manifest: what ``raymcn shards`` wrote, read by every run and check.

``manifest.json`` lists per shard its name, videos, their byte spans, bytes, sha256 and feature
dtype, the counts, the vocabulary's checksum and the skipped videos (docs/data.md shows one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from raymcn.config import NodeInputError, PermanentError
from raymcn.data.formats.sample import FEATURE_DTYPES

FORMAT = "raymcn-shards"


FORMAT_VERSION = 1


MANIFEST = "manifest.json"


class ShardError(ValueError, PermanentError, NodeInputError):
    """A problem with the inputs or the output directory of the shard writer (names the file)."""


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise ShardError(f"{path}: unreadable JSON ({e})") from None


def manifest_path(directory: str | os.PathLike) -> Path:
    """``directory/manifest.json``; FileNotFoundError naming it when it is missing."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no shard manifest (is {directory} a directory written by "
                                "`raymcn shards`?)")
    return path


def load_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a shard directory.

    Raises:
        FileNotFoundError / ShardError: naming ``<directory>/manifest.json`` (missing, unreadable,
            not a raymcn shard manifest, or listing no videos).
    """
    path = manifest_path(directory)
    manifest = read_json(path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ShardError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ShardError(f"{path}: manifest version {manifest.get('version')}, this raymcn reads {FORMAT_VERSION}")
    if not manifest.get("shards") or not manifest.get("counts", {}).get("videos"):
        raise ShardError(f"{path}: lists no videos")
    return manifest


def feature_dtype(manifest: dict, where: str | os.PathLike) -> str:
    """The one dtype of the 2d/3d features in every shard of ``manifest`` (of the folder ``where``).

    Shards written before the dtype was recorded are float32. Raises ShardError naming the shards
    of each dtype when they differ (e.g. shards copied in from a folder written with another
    ``--dtype``): one run reads one dtype, and a mixed folder would train on two precisions.
    """
    by_dtype: dict[str, list[str]] = {}
    for shard in manifest["shards"]:
        by_dtype.setdefault(shard.get("feature_dtype", "float32"), []).append(shard["name"])
    unknown = sorted(set(by_dtype) - set(FEATURE_DTYPES))
    if unknown:
        raise ShardError(f"{Path(where) / MANIFEST}: feature dtype {', '.join(unknown)} of shard(s) "
                         f"{', '.join(n for d in unknown for n in by_dtype[d])} is not one of {', '.join(FEATURE_DTYPES)}")
    if len(by_dtype) > 1:
        listing = "; ".join(f"{d}: {', '.join(names)}" for d, names in sorted(by_dtype.items()))
        raise ShardError(f"{Path(where) / MANIFEST}: mixed feature dtypes in one shard folder ({listing}); "
                         "rewrite the folder with one `raymcn shards --dtype`")
    return next(iter(by_dtype))
