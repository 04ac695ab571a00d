"""``raymcn doctor``'s checks, each made to fail on purpose, and its duration estimate.

The probe runs here in-process (it is a plain function; on a cluster a Ray task pinned to each
node runs it). What one machine cannot differ in by itself is injected through the probe's
request or its facts, and said so: another node's manifest (the request's digest), another
version (the request's versions), a full GPU (the facts' GPUs). The whole command on Ray's
multi-node test cluster: tests/test_multinode.py."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
from conftest import TINY

from raymcn.cli import preset_path
from raymcn.config import load_config
from raymcn.doctor.checkup import as_json, failed, render, request_of
from raymcn.doctor.estimate import estimate, rung_epochs
from raymcn.doctor.probe import SPILL_MIN_BYTES, probe
from raymcn.doctor.verdicts import FREE_DISK_CHECKS, ROOM_CHECK, SPILL_CHECK, judge
from raymcn.storage import size_text
from raymcn.train.inputs import shard_folder

GIB = 1 << 30


@pytest.fixture
def cfg(tmp_path):
    return load_config(preset_path(), [*TINY, f"run.storage_path={tmp_path / 'results'}"])


def request(cfg, tmp_path):
    token = tmp_path / "results" / ".raymcn-doctor" / "token"
    token.parent.mkdir(parents=True, exist_ok=True)
    token.write_text("t0k3n")
    return request_of(cfg, str(token), "t0k3n")


def rows_of(facts, req) -> dict:
    return {r.check: r for r in judge(facts, req)}


def test_a_healthy_cpu_node_passes_every_check_that_applies(cfg, tmp_path):
    """Every row but the GPUs' passes; the free-disk rows are this machine's disk at this moment
    (CI's third venv left it under the 10 GB Ray's spill row asks for), so they are held to their
    own figures instead."""
    req, inputs = request(cfg, tmp_path)
    facts = probe(req)
    rows = rows_of(facts, req)
    assert inputs is not None and len(req.sample) == 4
    assert set(FREE_DISK_CHECKS) <= set(rows)
    assert all(r.ok for name, r in rows.items()
               if not name.startswith(("GPU", "torch uses")) and name not in FREE_DISK_CHECKS), rows
    assert rows[ROOM_CHECK].ok is (facts["storage"]["free"] >= req.checkpoints_bytes)
    assert rows[SPILL_CHECK].ok is (facts["spill_free"] >= SPILL_MIN_BYTES)
    # no GPU and none asked for: the GPU rows do not apply
    assert rows["GPUs"].ok is None and rows["GPU memory free >= estimate"].ok is None
    assert rows["torch uses the GPUs"].ok is None


def test_a_missing_shard_folder_is_named_with_its_fix(cfg, tmp_path):
    req, _ = request(cfg.replace({"data.shards": str(tmp_path / "nowhere")}), tmp_path)
    rows = rows_of(probe(req), req)
    assert rows["shards readable"].ok is False and "nowhere" in rows["shards readable"].fix
    assert "mount the shards" in rows["shards readable"].fix


def test_a_corrupted_shard_member_fails_the_crc_check_naming_the_video(cfg, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(shard_folder(cfg), copy)
    req, _ = request(cfg.replace({"data.shards": str(copy)}), tmp_path)
    vid, shard, start, end = req.sample[1]
    data = bytearray((copy / shard).read_bytes())
    data[(start + end) // 2] ^= 0xFF  # a byte inside the sample's members
    (copy / shard).write_bytes(bytes(data))
    row = rows_of(probe(req), req)["shard members pass CRC-32"]
    assert row.ok is False and vid in row.fix and "rerun `raymcn shards`" in row.fix


def test_a_shard_copy_cut_short_is_named_before_training(cfg, tmp_path):
    """A shard 1000 bytes short (an interrupted copy) with the manifest intact: the manifest's
    digest still matches the head's, and the sampled videos may all lie elsewhere; the size row
    names the shard. (What the reader does with it in a run: tests/test_shards.py, a truncated
    shard costs only the videos past the cut, counted as bad samples.)"""
    copy = tmp_path / "shards"
    shutil.copytree(shard_folder(cfg), copy)
    req, _ = request(cfg.replace({"data.shards": str(copy)}), tmp_path)
    victim = sorted(copy.glob("shard-*.tar"))[-1]
    size = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[:-1000])
    rows = rows_of(probe(req), req)
    assert rows["manifest as on the head"].ok is True  # the digest cannot see it
    row = rows["shard sizes as the manifest says"]
    assert row.ok is False and f"{victim.name}: {size - 1000} bytes, the manifest says {size}" in row.fix
    assert "copy them again" in row.fix
    victim.unlink()
    assert f"{victim.name}: missing" in rows_of(probe(req), req)["shard sizes as the manifest says"].detail


def test_another_nodes_manifest_is_refused(cfg, tmp_path):
    """Injected through the request: the head's digest stands for another node's manifest."""
    req, _ = request(cfg, tmp_path)
    facts = probe(req)
    other = dataclasses.replace(req, manifest="0123456789abcdef")
    row = rows_of(facts, other)["manifest as on the head"]
    assert row.ok is False and "holds other shards than the head's" in row.fix


def test_unwritable_storage_and_storage_that_is_not_the_heads(cfg, tmp_path):
    req, _ = request(cfg, tmp_path)
    rows = rows_of(probe(dataclasses.replace(req, storage="/proc/raymcn-results")), req)
    assert rows["storage writable"].ok is False and "/proc/raymcn-results" in rows["storage writable"].fix
    elsewhere = dataclasses.replace(req, token=str(tmp_path / "another-mount" / "token"))
    row = rows_of(probe(elsewhere), elsewhere)["storage is the head's"]
    assert row.ok is False and "mount the same NFS share" in row.fix


def test_a_version_mismatch_names_the_package_and_both_versions(cfg, tmp_path):
    """Injected through the request: the head's versions as another node would differ."""
    req, _ = request(cfg, tmp_path)
    facts = probe(req)
    head = dataclasses.replace(req, versions={**req.versions, "torch": "9.9.9"})
    row = rows_of(facts, head)["versions as on the head"]
    assert row.ok is False and f"torch {facts['versions']['torch']} (head: 9.9.9)" in row.fix


def test_too_little_free_gpu_memory_and_gpu_rows_that_apply_only_to_gpu_runs(cfg, tmp_path):
    """Injected through the facts: this machine has no GPU."""
    req, _ = request(cfg, tmp_path)
    facts = probe(req)
    gpu_req = dataclasses.replace(req, use_gpu=True, estimate_bytes=20 * GIB, cpus_per_worker=1.0)
    rows = rows_of(facts, gpu_req)  # a GPU run on a node without one
    assert rows["GPUs"].ok is False and "has no GPU" in rows["GPUs"].fix
    busy = {**facts, "gpus": [{"name": "NVIDIA A100", "total": 40 * GIB, "free": 12 * GIB, "driver": "550"}] * 4}
    row = rows_of(busy, gpu_req)["GPU memory free >= estimate"]
    assert row.ok is False and "12.0 GiB free, a worker needs ~20.0 GiB" in row.fix
    roomy = {**busy, "gpus": [{**busy["gpus"][0], "free": 39 * GIB}] * 4, "resources": {"CPU": 2, "GPU": 4}}
    rows = rows_of(roomy, gpu_req)
    assert rows["GPU memory free >= estimate"].ok is True
    assert rows["CPUs for its workers"].ok is False and "need 4 CPUs, Ray has 2" in rows["CPUs for its workers"].fix


def test_torch_that_cannot_use_the_gpus_nvidia_smi_shows_fails_its_row(cfg, tmp_path, monkeypatch):
    """A stand-in nvidia-smi shows four A100s on a driver that runs CUDA 12.2; this machine's torch,
    asked in a child process as on every node, sees none of them. Then, injected through the facts,
    a CUDA 13 build that warns the driver is too old: both versions and the remedy are named."""
    import torch
    from test_install import stand_in_nvidia_smi

    if torch.cuda.is_available():
        pytest.skip("a GPU here: the stand-in's four would not be what torch sees")
    monkeypatch.setenv("PATH", f"{stand_in_nvidia_smi(tmp_path / 'bin', '12.2')}:{os.environ['PATH']}")
    req, _ = request(cfg, tmp_path)
    facts = probe(req)
    assert facts["driver"] == {"present": True, "version": "535.104.05", "cuda": (12, 2), "gpus": 4, "error": ""}
    assert facts["torch_gpus"]["available"] is False and facts["torch_gpus"]["count"] == 0
    gpu_req = dataclasses.replace(req, use_gpu=True)
    row = rows_of(facts, gpu_req)["torch uses the GPUs"]
    assert row.ok is False and "sees 0 of the 4 GPUs nvidia-smi shows" in row.detail
    assert rows_of(facts, req)["torch uses the GPUs"].ok is None  # a CPU run: does not apply
    cuda13 = {**facts, "cuda": {"cuda": "13.0", "nccl": "2.27.7", "nccl_error": ""},
              "torch_gpus": {"available": False, "count": 0,
                             "warning": "The NVIDIA driver on your system is too old (found version 12020)."}}
    row = rows_of(cuda13, gpu_req)["torch uses the GPUs"]
    assert row.ok is False and "the driver 535.104.05 runs CUDA 12.2 at most, older than this CUDA 13.0 build" in row.fix
    assert "run make install in the checkout" in row.fix
    healthy = {**cuda13, "cuda": {"cuda": "12.6", "nccl": "2.27.7", "nccl_error": ""},
               "torch_gpus": {"available": True, "count": 4, "warning": ""}}
    row = rows_of(healthy, gpu_req)["torch uses the GPUs"]
    assert row.ok is True and row.detail == "a CUDA 12.6 build, which sees 4 of the 4 GPUs nvidia-smi shows; NCCL 2.27.7"


def test_a_cuda_build_that_differs_between_nodes_fails_the_versions_row(cfg, tmp_path):
    req, _ = request(cfg, tmp_path)
    facts = probe(req)
    head = dataclasses.replace(req, versions={**req.versions, "torch's CUDA": "12.6"})
    row = rows_of(facts, head)["versions as on the head"]
    assert row.ok is False and f"torch's CUDA {facts['versions']['torch' + chr(39) + 's CUDA']} (head: 12.6)" in row.fix


def test_the_report_renders_a_column_per_node_and_each_fix(cfg, tmp_path):
    req, _ = request(cfg, tmp_path)
    good, bad = probe(req), probe(dataclasses.replace(req, storage="/proc/raymcn-results"))
    report = {"columns": {"a": "server1 (head)", "b": "server2"}, "rows": {"a": judge(good, req), "b": judge(bad, req)},
              "estimate": None, "cluster": {}}
    text = render(report, use_gpu=False)
    assert "| check | server1 (head) | server2 |" in text and "| storage writable | ✔ | ✘ |" in text
    assert "✘ storage writable: " in text and "--step" in text
    assert failed(report) and as_json(report)["rows"]["server2"]


def test_the_estimate_counts_trials_rungs_confirmation_and_concurrency():
    cfg = load_config(preset_path())  # the embedded default: a grid of 4 orders x 2 lrs, then 2 seeds per order
    est = estimate(cfg, steps_per_epoch=16, step_s=0.5, eval_s=2.0, cluster={"CPU": 2.0}, trial_overhead_s=20.0)
    assert (est.search_trials, est.confirm_runs) == (8, 8)
    per_trial = 20.0 + cfg.schedule.epochs * (16 * 0.5 + 2.0)
    assert est.search_s == (8 * per_trial, 8 * per_trial) and est.confirm_s == 8 * per_trial
    concurrent = min(cfg.sweep.max_concurrent, int(2.0 // (cfg.scale.min_workers * cfg.scale.cpus_per_worker)))
    assert est.concurrent == max(1, concurrent) and est.wall_s[0] == 16 * per_trial / est.concurrent
    # ASHA over 9 budget epochs from a first rung at 1, 1 in 3 going on: rungs at 1, 3 (9 is the end)
    asha = cfg.replace({"sweep.algorithm": "asha", "schedule.epochs": 10, "schedule.stage1_fraction": 0.1,
                        "sweep.grace_epochs": 1, "sweep.reduction_factor": 3})
    assert rung_epochs(asha) == pytest.approx(1 + 1 + 2 / 3 + 6 / 9)
    gpu = cfg.replace({"scale.use_gpu": True, "scale.num_workers": 4, "sweep.max_concurrent": 4})
    assert estimate(gpu, 16, 0.5, 0.0, {"CPU": 128.0, "GPU": 8.0}, 0.0).concurrent == 2  # 8 GPUs hold 2 trials of 4


def test_a_failed_trial_for_a_cause_the_doctor_checks_points_back_to_it():
    from raymcn.config import doctor_hint
    from raymcn.data.evalsets import EvalSetError

    assert "raymcn doctor" in doctor_hint(FileNotFoundError("/data/howto100m/shards/shard-000001.tar"))
    assert "raymcn doctor" in doctor_hint(EvalSetError("youcook_val_audio.pkl: entry 3 lacks 'audio'"))
    assert doctor_hint(ZeroDivisionError()) == ""


def test_the_versions_row_names_the_commit_and_tells_a_stale_copy_by_its_sources(cfg, tmp_path):
    """The lab's servers get the checkout without .git: a node is judged by its sources' digest, which a
    stale copy fails; the commit is shown, and compared where both sides know theirs."""
    from raymcn.provenance import collect
    from raymcn.provenance.describe import NO_GIT

    req, _ = request(cfg, tmp_path)
    facts = probe(req)
    code = collect.code_identity()
    assert facts["versions"]["raymcn sources"] == code["source_digest"][:12]
    assert facts["versions"]["commit"] == (code["commit"][:7] + (" with uncommitted changes" if code["dirty"] else "")
                                           if code["commit"] else NO_GIT)
    synced = dataclasses.replace(req, versions={**req.versions, "commit": NO_GIT})  # the head has no .git
    assert rows_of(facts, synced)["versions as on the head"].ok is True
    stale = dataclasses.replace(req, versions={**req.versions, "commit": NO_GIT, "raymcn sources": "0123456789ab"})
    row = rows_of(facts, stale)["versions as on the head"]
    assert row.ok is False and f"raymcn sources {code['source_digest'][:12]} (head: 0123456789ab)" in row.fix
    other = dataclasses.replace(req, versions={**req.versions, "commit": "1234567"})
    assert rows_of({**facts, "versions": {**facts["versions"], "commit": "7654321"}}, other)[
        "versions as on the head"].ok is False


def test_a_storage_without_room_for_the_sweeps_checkpoints_is_named_and_a_bucket_is_not_checked(cfg, tmp_path,
                                                                                               monkeypatch):
    """Injected through the request: the sweep's trials at once need one byte more than the node's
    storage has free."""
    req, _ = request(cfg, tmp_path)
    facts = probe(req)
    assert rows_of(facts, req)[ROOM_CHECK].ok is True
    assert req.checkpoints_text.endswith(f"= {size_text(req.checkpoints_bytes)}")
    short = dataclasses.replace(req, checkpoints_bytes=facts["storage"]["free"] + 1)
    row = rows_of(facts, short)[ROOM_CHECK]
    assert row.ok is False and f"{facts['storage']['free'] / 1e9:.1f} GB free at {tmp_path / 'results'}" in row.fix
    assert "lower run.checkpoints_to_keep or sweep.max_concurrent" in row.fix
    bucket = {**facts, "storage": {k: v for k, v in facts["storage"].items() if k not in ("free", "filesystem")}}
    assert rows_of(bucket, req)[ROOM_CHECK].ok is None


def test_a_disk_with_less_room_than_rays_object_store_is_named_with_where_ray_spills(cfg, tmp_path, monkeypatch):
    """Injected through the facts: Ray's temp folder has one byte less free than the node's object
    store, then exactly as much."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray"))
    req, _ = request(cfg, tmp_path)
    store = 3 * 10**9
    facts = {**probe(req), "resources": {"CPU": 4, "object_store_memory": store}}
    row = rows_of({**facts, "spill_free": store - 1}, req)[SPILL_CHECK]
    assert row.ok is False and f"under {tmp_path / 'ray'}, less than its object store (3.0 GB)" in row.fix
    assert "point RAY_TMPDIR at a larger disk" in row.fix
    assert rows_of({**facts, "spill_free": store}, req)[SPILL_CHECK].ok is True
    # without Ray's view of the node, the floor stands in for the object store
    assert rows_of({**probe(req), "spill_free": SPILL_MIN_BYTES - 1}, req)[SPILL_CHECK].ok is False
