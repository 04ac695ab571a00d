"""How ``tests/data/shards-v1`` and ``shards-v1.expected.json`` were made (kept for the record).

Run once at commit 6c63b46, with the hand-written ustar writer of FORMAT_VERSION 1 (before the
data path was split into tarfmt / sample / shards / stream / reader)::

    python tests/data/make_shards_v1.py tests/data/shards-v1 tests/data/shards-v1.expected.json

The expected values (dtype, shape, sha256 of every array of every video) come from the original
layout through ``read_video``, not from the shards, so ``tests/test_shards.py`` checks the committed
shards against the source data. Rerunning this with a newer writer would not reproduce these tar
bytes; that is the point of the fixture: shards written by the old writer must keep loading.
One video has no 3d file, so the manifest lists a skipped video with its reason.
"""
import hashlib
import json
import pickle
import sys
from pathlib import Path

import numpy as np

from raymcn.data.formats.features import FEATURE_DIM, MEL_BINS, load_captions, read_video, read_video_paths
from raymcn.data.formats.words import load_vocab, write_word2vec_bin
from raymcn.data.write import shards

out, expected_path, root = Path(sys.argv[1]), Path(sys.argv[2]), Path("/tmp/v1src/layout")
rng = np.random.default_rng(11)
words = ["cut", "the", "onion", "into", "small", "pieces", "fry", "oil"]
videos = {"dQw4w9WgXcQ": (1, 2, 120, ["cut the onion", "into small pieces"]),
          "a-b_c9": (2, 3, 210, ["fry the onion in oil"]),
          "x1y2z3": (1, 1, 90, ["the pieces", "oil", "cut"]),
          "gone0001": (1, 1, 100, ["nothing"])}  # its 3d file is missing: skipped with a reason
rows, captions = [], {}
for i, (vid, (t2, t3, ta, texts)) in enumerate(videos.items()):
    path = f"Food/Sub{i}/{vid}"
    rows.append(path)
    fdir, adir = root / "features" / path, root / "audio" / path
    fdir.mkdir(parents=True), adir.mkdir(parents=True)
    np.savez(fdir / f"{vid}_2d.npz", features=rng.random((t2, FEATURE_DIM), dtype=np.float32))
    if vid != "gone0001":
        np.savez(fdir / f"{vid}_3d.npz", features=rng.random((t3, FEATURE_DIM), dtype=np.float32))
    np.savez(adir / f"{vid}_spec.npz", (rng.random((MEL_BINS, ta)) * -80).astype(np.float16))
    starts = np.arange(len(texts)) * ta / 100 / len(texts)
    captions[vid] = {"start": starts, "end": starts + 0.4, "text": np.array(texts, dtype=object)}
(root / "videos.csv").write_text("path\n" + "".join(r + "\n" for r in rows))
(root / "captions.pickle").write_bytes(pickle.dumps(captions))
write_word2vec_bin(root / "word2vec.bin", words, rng.standard_normal((len(words), 4)).astype(np.float32))
manifest = shards.shards_from_layout(root / "features", root / "audio", root / "captions.pickle",
                                     root / "videos.csv", root / "word2vec.bin", out, videos_per_shard=2,
                                     seed=0, workers=1, progress=False, log=lambda m: None)
vocab, caps = load_vocab(out), load_captions(root / "captions.pickle")
expected = {}
for path in read_video_paths(root / "videos.csv"):
    if path.endswith("gone0001"):
        continue
    rec = read_video(path, root / "features", root / "audio", caps, vocab.word_to_id)
    expected[rec.video_id] = {name: {"dtype": str(a.dtype), "shape": list(a.shape),
                                     "sha256": hashlib.sha256(a.tobytes()).hexdigest()}
                              for name in ("feat_2d", "feat_3d", "spec", "starts", "ends", "token_ids",
                                           "token_offsets") for a in [getattr(rec, name)]}
expected_path.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
print(json.dumps(manifest["counts"]), manifest["skipped"])
