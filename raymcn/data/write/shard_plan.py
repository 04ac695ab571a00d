"""The conversion plan: which videos go into which shard, fixed by the inputs and the seed.

``plan.json`` in the output folder holds it; its key (:func:`plan_key`, a hash of the inputs and
settings) marks every done marker, so a rerun with other inputs is refused instead of mixing them.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from raymcn.data.formats.features import video_id_of
from raymcn.data.formats.manifest import FORMAT, FORMAT_VERSION
from raymcn.data.write.disk_space import estimate_sample_bytes
from raymcn.data.write.sources import LayoutSources

PLAN = "plan.json"


SHARD_PATTERN = "shard-{:06d}.tar"


def plan_key(src: LayoutSources, list_sha: str, seed: int, shard_size_mb: float,
              videos_per_shard: int | None, feature_dtype: str = "float32") -> str:
    ident = {"format": FORMAT, "version": FORMAT_VERSION, "seed": seed, "shard_size_mb": shard_size_mb,
             "videos_per_shard": videos_per_shard, "video_list_sha256": list_sha,
             **({"tars": [[str(t.resolve()), t.stat().st_size] for t in src.tars]} if src.tars else
                {"features": str(src.features.resolve()), "audio_features": str(src.audio_features.resolve())}),
             "captions": [str(src.captions.resolve()), src.captions.stat().st_size],
             "word_vectors": [str(src.word_vectors.resolve()), src.word_vectors.stat().st_size]}
    if feature_dtype != "float32":  # fp32 folders written before the setting existed keep their key
        ident["feature_dtype"] = feature_dtype
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def make_shard_plan(paths: list[str], src: LayoutSources, feats, seed: int, shard_size_mb: float,
               videos_per_shard: int | None, key: str, feature_dtype: str = "float32") -> dict:
    """Videos permuted with ``seed`` and cut into shards of ~shard_size_mb (or videos_per_shard)."""
    kept, seen, duplicates = [], set(), []
    for p in paths:
        vid = video_id_of(p)
        if vid in seen:
            duplicates.append([vid, f"listed more than once in {src.video_list or 'the tars'}; kept the first entry"])
            continue
        seen.add(vid)
        kept.append(p)
    rng = np.random.default_rng([seed, 0x5EED])
    order = rng.permutation(len(kept))
    if videos_per_shard is None:
        mean = estimate_sample_bytes(kept, feats, rng, feature_dtype)
        videos_per_shard = max(1, int(round(shard_size_mb * (1 << 20) / mean)))
    shuffled = [kept[int(i)] for i in order]
    shards = [shuffled[i:i + videos_per_shard] for i in range(0, len(shuffled), videos_per_shard)]
    return {"plan": key, "seed": seed, "shard_size_mb": shard_size_mb, "videos_per_shard": videos_per_shard,
            "listed": len(paths), "duplicates": duplicates,
            "shards": [{"name": SHARD_PATTERN.format(i), "paths": chunk} for i, chunk in enumerate(shards)]}
