"""A storage that cannot take what a run writes, without Ray: the size of a checkpoint as the
preflight estimates it, the copy into the storage that leaves nothing partial under a checkpoint's
name, the message that names the figures, and the error's way through Ray's wrappers to the driver.

(A run whose storage fills, and a sweep's: tests/test_train_ray.py, tests/test_sweep.py; the
preflight's refusal and the one message: tests/test_preflight.py.)"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
from collections import namedtuple
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from raymcn import storage
from raymcn.config import (
    StorageError,
    load_config,
    permanent_cause,
    preset_path,
    storage_cause,
)
from raymcn.train.build import assemble
from raymcn.train.checkpoints import payload, persist, space
from raymcn.train.run_plan import make_plan

Usage = namedtuple("Usage", "total used free")


def full_state_checkpoint(cfg, folder: Path) -> int:
    """The bytes of ``state.pt`` of a run of ``cfg`` whose optimizer has stepped, queue is full and
    centroids are fitted: every later checkpoint's size."""
    run = assemble(cfg, make_plan(cfg, 256))
    for p in run.net.parameters():
        p.grad = torch.zeros_like(p)
    run.optimizer.step()
    queue = run.objective.cluster.queue
    queue.push(torch.zeros(queue.capacity, queue.dim))
    run.objective.cluster.centroids = torch.zeros(cfg.loss.num_clusters, cfg.model.embed_dim)
    payload.save(folder, **run.parts(), config=cfg.to_dict(), metrics={"text_to_video_R@10": 1.0})
    return (folder / payload.STATE_FILE).stat().st_size


@pytest.mark.parametrize("path, settings", [
    ("sweeps/smoke.yaml", []),
    (None, []),
    ("sweeps/smoke.yaml", ["loss.queue_dtype=bfloat16", "model.sync_batchnorm=true", "loss.queue_steps=8"]),
])
def test_the_checkpoint_estimate_is_what_torch_save_writes_or_a_little_more(tmp_path, path, settings):
    cfg = load_config(path or preset_path(), settings)
    written = full_state_checkpoint(cfg, tmp_path)
    estimate = space.checkpoint_bytes(cfg)
    assert written <= estimate <= written * 1.01 + space.FIXED_BYTES, (written, estimate)


def test_a_run_holds_the_kept_the_latest_and_one_being_written():
    cfg = load_config(preset_path(), ["run.checkpoints_to_keep=3"])
    assert space.held_at_once(cfg) == 5
    need = space.need_of(cfg, trials=2, held=1000)
    assert need.total == 5 * 2 * space.checkpoint_bytes(cfg) - 1000


def test_the_space_check_refuses_what_does_not_fit_naming_the_figures(tmp_path, monkeypatch):
    """A stand-in for the free-space call (shutil.disk_usage, which storage.space_at reads)."""
    results = tmp_path / "results"
    cfg = load_config(preset_path(), [f"run.storage_path={results}"])
    need = space.need_of(cfg)
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda where: Usage(10 * need.total, 0, need.total - 1))
    problems, notes = space.space_problems(cfg)
    assert notes == [] and len(problems) == 1, problems
    said = problems[0]
    assert f"run.storage_path='{results}'" in said
    one, total = storage.size_text(need.checkpoint), storage.size_text(need.total)
    assert f"at most {space.held_at_once(cfg)} x {one} = {total}" in said
    assert f"{storage.size_text(need.total - 1)} are free at {results}" in said and "short by 1 byte." in said
    assert "lower run.checkpoints_to_keep" in said and "RAYMCN_RESULTS" in said
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda where: Usage(10 * need.total, 0, need.total))
    problems, notes = space.space_problems(cfg)
    assert problems == [] and notes and storage.size_text(need.total) in notes[0]
    # a sweep's trials at once each keep their own; a resumed run's checkpoints are there already
    assert space.space_problems(cfg, trials=2)[0]
    assert space.space_problems(cfg, trials=2, held=need.total)[0] == []


def test_a_bucket_is_not_checked_and_says_so():
    cfg = load_config(preset_path(), ["run.storage_path=s3://bucket/results"])
    assert space.space_problems(cfg) == ([], ["storage: s3://bucket/results is an object store: its free space is "
                                              "not checked"])


def test_the_filesystem_is_named_by_its_mount_point_and_type(tmp_path):
    found = storage.space_at(tmp_path / "not" / "yet")
    assert found.path == str(tmp_path / "not" / "yet") and Path(found.path).is_relative_to(found.mount)
    assert os.path.ismount(found.mount) and found.free == shutil.disk_usage(tmp_path).free
    mounts = {line.split()[1]: line.split()[2] for line in Path("/proc/self/mounts").read_text().splitlines()}
    assert found.kind == mounts[found.mount]


def local_checkpoint(folder: Path) -> Path:
    folder.mkdir()
    (folder / payload.STATE_FILE).write_bytes(os.urandom(100_000))
    (folder / payload.META_FILE).write_text('{"epoch": 2, "step": 32}')
    return folder


def test_a_checkpoint_appears_in_the_storage_whole_under_its_name(tmp_path):
    source = local_checkpoint(tmp_path / "local")
    run = tmp_path / "run"
    run.mkdir()
    seen = []

    def watched(src, fs, target):  # what a reader of the run's folder sees while the copy runs
        persist.copy_files(src, fs, target)
        seen.append(sorted(p.name for p in run.iterdir()))

    path = persist.persist(str(source), pafs.LocalFileSystem(), str(run), "checkpoint_x", load_config(preset_path()),
                           shown=str(run), copy=watched)
    assert path == str(run / "checkpoint_x") and seen == [[".partial-checkpoint_x"]]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint_x"]
    assert (run / "checkpoint_x" / payload.STATE_FILE).read_bytes() == (source / payload.STATE_FILE).read_bytes()


def half_then(code: int):
    """A copy that writes half of state.pt and then fails as its filesystem does with ``code``."""
    def copy(src, fs, target):
        fs.create_dir(target)
        data = (Path(src) / payload.STATE_FILE).read_bytes()
        with fs.open_output_stream(f"{target}/{payload.STATE_FILE}") as out:
            out.write(data[: len(data) // 2])
        raise OSError(code, os.strerror(code))
    return copy


def test_a_full_storage_leaves_nothing_and_names_the_path_the_free_and_the_needed_bytes(tmp_path):
    source = local_checkpoint(tmp_path / "local")
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(preset_path(), ["run.checkpoints_to_keep=1"])
    with pytest.raises(StorageError) as info:
        persist.persist(str(source), pafs.LocalFileSystem(), str(run), "checkpoint_x", cfg, shown=str(run),
                        copy=half_then(errno.ENOSPC))
    assert list(run.iterdir()) == []  # nothing under the checkpoint's name, nor the partial one
    said, where = str(info.value), storage.space_at(run)
    assert info.value.errno == errno.ENOSPC and "No space left on device" in said
    assert f"at {where.named()}: " in said and re.search(r": [\d.]+ [kMGT]?B free of [\d.]+ [kMGT]?B\.", said)
    one = storage.size_text(space.folder_bytes(source))
    assert f"copying checkpoint checkpoint_x ({one})" in said and f"One checkpoint is {one}" in said
    assert f"a run keeps 2 (run.checkpoints_to_keep=1 by sweep.metric, and the latest)" in said
    assert f"{storage.size_text(3 * space.folder_bytes(source))} at most" in said


def test_a_read_only_storage_says_to_make_it_writable_and_other_errors_pass_unchanged(tmp_path):
    source = local_checkpoint(tmp_path / "local")
    cfg = load_config(preset_path())
    with pytest.raises(StorageError, match="Read-only file system.*Make it writable"):
        persist.persist(str(source), pafs.LocalFileSystem(), str(tmp_path), "c", cfg, shown=str(tmp_path),
                        copy=half_then(errno.EROFS))
    with pytest.raises(OSError) as info:  # not a storage that cannot take it: Ray Train's policy decides
        persist.persist(str(source), pafs.LocalFileSystem(), str(tmp_path), "c", cfg, shown=str(tmp_path),
                        copy=half_then(errno.EIO))
    assert type(info.value) is OSError and info.value.errno == errno.EIO
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local"]


def test_a_resume_finds_the_unfinished_copies_and_the_unregistered_checkpoints(tmp_path):
    for name in ("checkpoint_1", "checkpoint_2", "checkpoint_3", ".partial-checkpoint_4"):
        (tmp_path / name).mkdir()
    fs = pafs.LocalFileSystem()
    assert persist.unregistered_after(fs, str(tmp_path / "checkpoint_2")) == ["checkpoint_3"]
    assert persist.remove_partials(fs, str(tmp_path)) == [".partial-checkpoint_4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]


def test_the_fault_fills_the_disk_at_its_epochs_checkpoint_once(tmp_path):
    from raymcn.train.faults import Faults

    fill = Faults({"disk_full_at_epoch": 2}, marker_dir=str(tmp_path / "marks")).filling(persist.copy_files)
    fs = pafs.LocalFileSystem()
    source = local_checkpoint(tmp_path / "local")  # loop.json: epoch 2 done
    with pytest.raises(OSError) as info:
        fill(str(source), fs, str(tmp_path / "a"))
    half = (source / payload.STATE_FILE).stat().st_size // 2
    assert info.value.errno == errno.ENOSPC and (tmp_path / "a" / payload.STATE_FILE).stat().st_size == half
    fill(str(source), fs, str(tmp_path / "b"))  # once per run: the resumed run's copy goes through
    assert (tmp_path / "b" / payload.STATE_FILE).stat().st_size == 2 * half


def test_a_storage_error_reaches_the_driver_through_rays_wrappers():
    """The worker's error inside what Ray Train's controller hands the driver, pickled (which keeps
    attributes, not ``__cause__``): found, and not retried; the message kept."""
    from ray.train.v2.api.exceptions import ControllerError

    from raymcn.train.on_ray.launch import PermanentRunError

    worker = StorageError("copying checkpoint c failed: No space left on device, at /r", errno.ENOSPC)
    handed = pickle.loads(pickle.dumps(ControllerError(PermanentRunError(f"rank 0 failed with {worker}", worker))))
    assert str(storage_cause(handed)) == str(worker) and storage_cause(handed).errno == errno.ENOSPC
    raw = pickle.loads(pickle.dumps(ControllerError(PermanentRunError("rank 0", OSError(errno.EDQUOT, "quota")))))
    assert storage_cause(raw).errno == errno.EDQUOT
    assert permanent_cause(OSError(errno.EIO, "io")) is None  # a transient error stays Ray Train's to retry
    # Tune's error of a trial whose function raised one: Ray's task error, also an instance of its cause's class
    from ray.exceptions import RayTaskError

    from ray import cloudpickle  # (Tune pickles it so: its class is made at run time)

    trial = cloudpickle.loads(cloudpickle.dumps(RayTaskError("train", "Traceback ...", worker).as_instanceof_cause()))
    assert isinstance(trial, StorageError) and str(storage_cause(trial)) == str(worker)


def test_a_raw_storage_error_is_explained_with_the_runs_figures(tmp_path):
    cfg = load_config(preset_path(), ["run.checkpoints_to_keep=2"])
    said = space.explained(OSError(errno.ENOSPC, "No space left on device"), str(tmp_path), cfg)
    assert said.startswith("a write failed: No space left on device, at ") and str(tmp_path) in said
    assert f"One checkpoint is {storage.size_text(space.checkpoint_bytes(cfg))}" in said
    assert space.explained(ValueError("other"), str(tmp_path), cfg) == "other"


def test_a_worker_whose_temp_folder_is_full_names_it_and_leaves_nothing(tmp_path, monkeypatch):
    """The rank's own copy (``worker.Reports.serialised``) into its temp folder fails as a full disk
    does: the error names that folder and the way out (TMPDIR), and the folder is gone."""
    import tempfile

    from raymcn.train.on_ray.worker import Reports

    cfg = load_config("sweeps/smoke.yaml")
    run = assemble(cfg, make_plan(cfg, 256))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def full(directory, **parts):
        (Path(directory) / payload.STATE_FILE).write_bytes(b"part of it")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(payload, "save", full)
    with pytest.raises(StorageError) as info:
        Reports.serialised(None, run, {})
    said = str(info.value)
    assert said.startswith(f"serialising a checkpoint into this worker's temp folder failed: No space left on device, "
                           f"at {tmp_path}/raymcn-checkpoint-")
    assert "point TMPDIR" in said and list(tmp_path.iterdir()) == []
