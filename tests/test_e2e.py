"""The whole real-data path on a tiny corpus: synth -> shards -> train -> eval."""

import json
from pathlib import Path

import pytest
import torch
from conftest import last_json

from raymcn.cli import main
from raymcn.train.checkpoints import payload as checkpoint

pytestmark = pytest.mark.ray



def test_synth_shards_train_eval(ray_local, tmp_path, capsys, checkout, monkeypatch):
    from raymcn.provenance import collect

    monkeypatch.setattr(collect, "PACKAGE_DIR", checkout.package)  # the driver runs from a git checkout
    corpus, shards = tmp_path / "corpus", tmp_path / "shards"
    assert main(["synth", "--out", str(corpus), "--videos", "48", "--eval-clips", "64"]) == 0
    args = ["shards", "--features", f"{corpus}/features", "--audio-features", f"{corpus}/audio",
            "--captions", f"{corpus}/caption.pickle", "--video-list", f"{corpus}/videopaths.csv",
            "--word-vectors", f"{corpus}/word2vec.bin", "--out", str(shards), "--videos-per-shard", "8",
            "--no-progress", "--workers", "1"]
    assert main(args) == 0
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["counts"]["videos"] == 48 and len(manifest["shards"]) == 6
    capsys.readouterr()

    youcook = f"youcook:{corpus}/youcook_val_audio.pkl"
    assert main(["train", "--num-workers", "1", "--json", "--set", f"data.shards={shards}",
                 "--set", f"data.eval_set={youcook}", "--set", "data.batch_size=16", "--set", "schedule.epochs=2",
                 "--set", "scale.cpus_per_worker=1", "--set", f"run.storage_path={tmp_path}/runs"]) == 0
    trained = last_json(capsys.readouterr().out)
    assert trained["epochs"] == 2 and trained["eval_size"] == 64

    latest = checkpoint.list_checkpoints(trained["run_dir"])[-1]
    # On the CPU with one thread, as the training worker evaluated (a GPU would score in bf16).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["eval", "--checkpoint", str(latest), "--eval-set", youcook, "--device", "cpu", "--json"]) == 0
    finally:
        torch.set_num_threads(threads)
    evaluated = last_json(capsys.readouterr().out)
    for key in ("text_to_video_R@1", "text_to_video_R@5", "text_to_video_R@10", "text_to_video_MedR"):
        assert evaluated[key] == pytest.approx(trained[key]), key  # the same weights, the same set
    assert set(trained) == set(evaluated)  # same JSON keys as train --json
    resumed_on_another_commit_and_manifest(trained["run_dir"], shards, checkout, capsys)


def resumed_on_another_commit_and_manifest(run_dir: str, shards: Path, checkout, capsys) -> None:
    """The lab's week: the change is committed (`git pull` has the same effect) and the shards' manifest
    rewritten (a re-conversion), then the run is resumed for one more epoch. The resume's first lines
    name both changes, old -> new; it is not refused; the record keeps both entries."""
    from raymcn.provenance import record
    from raymcn.provenance.describe import MANIFEST_FACET, facets

    (start,) = record.drivers(record.read(run_dir))
    committed = checkout.commit_all("the sweep file's change")
    manifest = json.loads((shards / "manifest.json").read_text())
    (shards / "manifest.json").write_text(json.dumps({**manifest, "converted_again": True}, indent=1))
    assert main(["train", "--resume", run_dir, "--set", "schedule.epochs=3", "--json"]) == 0
    out = capsys.readouterr().out
    resumed = record.drivers(record.read(run_dir))
    assert [e["entry"] for e in resumed] == ["start", "resume"] and last_json(out)["epochs"] == 3
    was, now = facets(start), facets(resumed[1])
    first = out.splitlines()
    assert first[0].startswith("note: this run continues with other code, environment or data") and first[1] == \
        f"since its start ({start['time']}):"
    said = first[2:first.index(next(line for line in first[2:] if not line.startswith("  ")))]
    assert f"  commit: {start['code']['commit'][:7]} -> {committed[:7]}" in said
    assert f"  {MANIFEST_FACET}: {was[MANIFEST_FACET]} -> {now[MANIFEST_FACET]}" in said
    assert "  uncommitted changes: patch" in " ".join(said) and was[MANIFEST_FACET] != now[MANIFEST_FACET]
    assert resumed[0]["code"]["commit"] == start["code"]["commit"] != resumed[1]["code"]["commit"] == committed
