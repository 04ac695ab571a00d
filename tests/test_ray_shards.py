"""``raymcn shards --ray``: Ray actors write the same shards as local processes (same plan, bytes,
markers and manifest), a rerun resumes the same way (the writer itself: tests/test_shards.py)."""

from __future__ import annotations

import json

import pytest
from conftest import last_json
from test_shards import SETTINGS, write  # noqa: F401 - conftest's corpus fixture reads this module's SETTINGS

pytestmark = pytest.mark.ray


def shard_bytes(manifest: dict) -> list[tuple[str, list[str], str]]:
    return [(s["name"], s["videos"], s["sha256"]) for s in manifest["shards"]]


def test_ray_actors_write_the_local_writers_shards_and_resume_alike(ray_local, corpus, tmp_path, capsys,
                                                                     monkeypatch):
    """The actors are given the caption store, never the caption table: once the driver built the
    store, the caption pickle is moved away until the actors are done, and they still write the
    same shards."""
    from raymcn.cli import main
    from raymcn.data.write import shards
    from raymcn.data.write.ray_writers import RayWriters

    local = write(corpus, tmp_path / "local", workers=1)
    real, hidden = shards._captions_and_vocab, tmp_path / "hidden.pickle"

    def then_hide_the_pickle(*args):
        out = real(*args)
        corpus.captions.rename(hidden)
        return out

    monkeypatch.setattr(shards, "_captions_and_vocab", then_hide_the_pickle)
    try:
        on_ray = write(corpus, tmp_path / "ray", writer=RayWriters())
    finally:
        hidden.rename(corpus.captions)
    monkeypatch.undo()
    assert shard_bytes(on_ray) == shard_bytes(local) and len(local["shards"]) == 3
    assert on_ray["counts"] == local["counts"]

    # a lost shard: the rerun through the command line (`--ray`, the running instance) rewrites it alone
    lost = on_ray["shards"][1]["name"]
    (tmp_path / "ray" / lost).unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ray").glob("*.tar")}
    assert main(["shards", "--features", str(corpus.features_root), "--audio-features", str(corpus.audio_root),
                 "--captions", str(corpus.captions), "--video-list", str(corpus.video_csv), "--word-vectors",
                 str(corpus.word_vectors), "--out", str(tmp_path / "ray"), "--dtype", "float32",
                 "--videos-per-shard", "5", "--ray", "--no-progress", "--json"]) == 0
    assert last_json(capsys.readouterr().out)["shards"] == 3
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ray").glob("*.tar") if p.name != lost} == kept
    again = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert shard_bytes(again) == shard_bytes(local)
