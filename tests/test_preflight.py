"""Malformed configs and inputs fail before Ray starts, each with a message naming the problem."""

import contextlib
import json

import pytest

import raymcn.cli as cli
from raymcn.train.preflight import checks as preflight

CASES = [  # (arguments after `raymcn train`, fragment of the message)
    (["--set", "optim.lrr=1"], "unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    (["--set", "data.batch_size=1"], "data.batch_size=1 is smaller than scale.num_workers=2"),
    (["--set", "schedule.stage_order=VA_T"], "allowed values are AV_T, VT_A, AT_V, joint"),
    (["--set", "model.text_encoder=transformr"], ("model.text_encoder='transformr': allowed values are gated (the "
                                                  "parts named in raymcn/model/parts.py)")),
    (["--set", "loss.num_clusters=999"], "loss.num_clusters=999 is larger than the 128 clips"),
    (["--set", "scale.use_gpu=perhaps"], "scale.use_gpu: expected bool, got 'perhaps'"),
    (["--set", "optim.lr=-1"], "optim.lr=-1.0: must be a positive number"),
    (["--set", "optim.lr=fast"], "optim.lr: expected float, got 'fast'"),
    (["--set", "schedule.stage1_fraction=1"], "schedule.stage1_fraction=1.0: must lie in [0, 1)"),
    (["--set", "schedule.epochs=0"], "schedule.epochs=0: must be >= 1"),
    (["--set", "data.eval_set=imagenet"], "data.eval_set='imagenet': allowed values are synthetic"),
    (["--set", "loss.queue_dtype=int8"], "loss.queue_dtype='int8': allowed values are float32, bfloat16"),
    (["--set", "model.audio_channels=[8,8]"], "model.audio_channels=[8, 8]: needs 5 positive widths"),
    (["--set", "optim.lr"], "expected KEY=VALUE"),
    (["--set", "sweep.algorithm=hyperopt"], "sweep.algorithm='hyperopt': allowed values are"),
    (["--set", "scale.cpus_per_worker=0"], "scale.cpus_per_worker=0.0: must be a positive number"),
    (["--set", "data.eval_set=youcook:{tmp}/missing.pkl"], "missing.pkl does not exist"),
    (["--set", "data.eval_set=msrvtt:{tmp}/garbage.pkl"], "garbage.pkl"),
    (["--set", "data.shards={tmp}/no-such-dir"], "no-such-dir': directory does not exist"),
    (["--set", "data.shards={tmp}/empty"], "no shard manifest"),
    (["--set", "data.shards={tmp}/truncated"], "shard-000000.tar has 10 bytes, the manifest says 20"),
    (["--set", "run.storage_path=/proc/raymcn-results"], "is not writable"),
    (["--config", "{tmp}/missing.yaml"], "missing.yaml does not exist"),
    (["--config", "{tmp}/broken.yaml"], "is not valid YAML"),
    (["--config", "{tmp}/unknown_section.yaml"], "unknown section 'optimizer' (did you mean 'optim'?)"),
    (["--set", "data.clips_per_video=32", "--set", "data.batch_size=512", "--set", "model.embed_dim=6144",
      "--set", "data.audio_frames=1000", "--set", "model.audio_channels=[128,128,256,512,1024]"],
     "(gradient caching: the same loss, BatchNorm's statistics per chunk"),  # the chunk depends on the conv kernel path (the CPU)
    (["--set", "scale.num_workers=1", "--set", "data.clips_per_video=32", "--set", "data.batch_size=512",
      "--set", "model.embed_dim=6144", "--set", "data.audio_frames=1000",
      "--set", "model.audio_channels=[128,128,256,512,1024]"], "Try data.clips_per_video="),
    (["--set", "scale.grad_cache_clips=12"], "scale.grad_cache_clips=12 is not a multiple of data.clips_per_video=8"),
]


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    (tmp_path / "garbage.pkl").write_bytes(b"not a pickle")
    (tmp_path / "broken.yaml").write_text("optim: [1, 2\n")
    (tmp_path / "unknown_section.yaml").write_text("optimizer:\n  lr: 1.0\n")
    (tmp_path / "empty").mkdir()
    trunc = tmp_path / "truncated"
    trunc.mkdir()
    (trunc / "shard-000000.tar").write_bytes(b"x" * 10)
    (trunc / "vocab.npy").write_bytes(b"")
    from raymcn.data.formats import manifest as shard_manifest

    manifest = {"format": shard_manifest.FORMAT, "version": shard_manifest.FORMAT_VERSION, "counts": {"videos": 3},
                "shards": [{"name": "shard-000000.tar", "videos": ["a", "b", "c"], "bytes": 20, "sha256": "0"}]}
    (trunc / shard_manifest.MANIFEST).write_text(json.dumps(manifest))

    def no_ray(*_):
        raise AssertionError("Ray was started before the configuration was checked")

    monkeypatch.setattr(cli, "ray_session", no_ray)
    # Each worker gets 16 GiB, whatever this machine's RAM: the memory case must not depend on it.
    monkeypatch.setattr(preflight, "_device_bytes", lambda cfg: (16 << 30, ""))
    return tmp_path


@pytest.mark.parametrize("argv, fragment", CASES, ids=[c[1][:40] for c in CASES])
def test_bad_input_fails_before_ray_naming_the_problem(inputs, capsys, argv, fragment):
    argv = [a.replace("{tmp}", str(inputs)) for a in argv]
    fragment = fragment.replace("{tmp}", str(inputs))
    if "storage_path" not in " ".join(argv):
        argv += ["--set", f"run.storage_path={inputs}/results"]
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err, err


def test_at_least_twenty_cases():
    assert len(CASES) >= 20


@pytest.mark.parametrize("workers, have, fragment", [
    ("1-4", {"CPU": 2.0}, None),  # an elastic group needs room for its minimum only: it grows later
    ("3-4", {"CPU": 2.0}, "scale.num_workers=3-4 (an elastic group starts with at least 3) x scale.cpus_per_worker"),
    ("2", {"CPU": 2.0}, "reserves 2 CPUs and Ray Data needs some left; the cluster has 2"),
    ("2-4", {"CPU": 8.0, "GPU": 1.0}, "needs 2 GPUs; the cluster has 1"),
])
def test_the_cluster_check_takes_an_elastic_groups_minimum(monkeypatch, workers, have, fragment):
    import ray

    from raymcn.config import load_config
    from raymcn.train.on_ray.cluster import cluster_problems

    gpu = ["scale.use_gpu=true"] if "GPU" in have else []
    cfg = load_config(None, [f"scale.num_workers={workers}", "data.batch_size=8", "loss.num_clusters=8", *gpu])
    monkeypatch.setattr(ray, "cluster_resources", lambda: have)
    problems = cluster_problems(cfg)
    assert (problems == []) if fragment is None else any(fragment in p for p in problems), problems


GIB = 1 << 30


def _gpu_cfg():
    from raymcn.config import load_config

    return load_config(None, ["scale.use_gpu=true", "scale.num_workers=4"])  # the paper's step, 4 GPUs


def test_a_gpu_run_planned_without_a_gpu_says_its_memory_is_checked_on_the_workers(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    notes: list[str] = []
    assert preflight._memory_problems(_gpu_cfg(), None, notes) == []
    assert any("GPU memory not checked here" in n and "each worker checks its own GPU's free memory" in n
               for n in notes), notes


def test_the_gpu_check_uses_the_least_free_memory_not_gpu0s_total(monkeypatch):
    import sys

    from cuda_stand_in import fake_nvml

    # GPU 1: 78 GiB total, most of it held by another process (read through NVML: no CUDA context)
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([(70 * GIB, 78 * GIB), (2 * GIB, 78 * GIB)]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    notes: list[str] = []
    problems = preflight._memory_problems(_gpu_cfg(), None, notes)
    assert problems and "free memory of GPU 1" in problems[0], problems
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([(70 * GIB, 78 * GIB), (70 * GIB, 78 * GIB)]))
    notes.clear()
    assert preflight._memory_problems(_gpu_cfg(), None, notes) == []
    assert any("free memory of GPU" in n for n in notes), notes


def test_each_worker_checks_its_own_gpus_free_memory(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * GIB, 80 * GIB))
    problems = preflight.device_problems(_gpu_cfg(), torch.device("cuda", 2))
    assert problems and "free memory of cuda:2 on this worker: 3.00 of 80.00 GiB" in problems[0], problems
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (78 * GIB, 80 * GIB))
    assert preflight.device_problems(_gpu_cfg(), torch.device("cuda", 2)) == []
    assert preflight.device_problems(_gpu_cfg(), torch.device("cpu")) == []


def test_one_message_names_the_settings_problems_and_every_input_files(inputs, capsys):
    """An unknown key does not hide a missing shard folder, eval file or word vectors (nor they it)."""
    assert cli.main(["train", "--set", "optim.lrr=1", "--set", f"data.shards={inputs}/no-such-dir", "--set",
                     f"data.eval_set=youcook:{inputs}/missing.pkl", "--set", f"data.word_vectors={inputs}/no.bin",
                     "--set", f"run.storage_path={inputs}/results"]) == 2
    err = capsys.readouterr().err
    assert err.count("invalid configuration") == 1, err
    problems = [line.removeprefix("  - ") for line in err.splitlines() if line.startswith("  - ")]
    assert problems[0] == "unknown key 'optim.lrr' (did you mean 'optim.lr'?)", problems
    assert f"data.shards='{inputs}/no-such-dir': directory does not exist" in problems[1]
    assert problems[2:] == [f"data.eval_set='youcook:{inputs}/missing.pkl': file {inputs}/missing.pkl does not exist",
                            f"data.word_vectors='{inputs}/no.bin': file {inputs}/no.bin does not exist"]


def test_with_valid_settings_a_missing_folder_is_named_with_what_the_run_would_lack(inputs, capsys, monkeypatch):
    """Settings valid, the shard folder missing: the storage's room is in the same message (a
    stand-in for the free-space call: 1 MB free)."""
    import shutil

    from raymcn import storage

    monkeypatch.setattr(storage.shutil, "disk_usage", lambda where: shutil._ntuple_diskusage(10**9, 0, 10**6))
    assert cli.main(["train", "--set", f"data.shards={inputs}/no-such-dir", "--set",
                     f"run.storage_path={inputs}/results"]) == 2
    err = capsys.readouterr().err
    assert "no-such-dir': directory does not exist" in err and "the checkpoints do not fit" in err, err


@pytest.mark.parametrize("command, trials", [("train", 1), ("sweep", 2)])
def test_the_preflight_refuses_checkpoints_that_cannot_fit(inputs, capsys, monkeypatch, command, trials):
    """A stand-in for the free-space call (shutil.disk_usage, which storage.space_at reads): one byte
    less than the run's checkpoints take, for a sweep its trials at once."""
    import shutil

    from raymcn import storage
    from raymcn.config import load_config
    from raymcn.train.checkpoints import space

    results = inputs / "results"
    argv = ["--config", "sweeps/smoke.yaml", "--set", f"run.storage_path={results}", "--set",
            f"sweep.max_concurrent={trials}"]
    need = space.need_of(load_config("sweeps/smoke.yaml"), trials=trials).total
    real = shutil.disk_usage
    free = {"bytes": need - 1}

    def usage(where):
        mine = str(where).startswith(str(inputs))
        return shutil._ntuple_diskusage(10 * need, 0, free["bytes"]) if mine else real(where)

    monkeypatch.setattr(storage.shutil, "disk_usage", usage)
    assert cli.main([command, *argv]) == 2
    err = capsys.readouterr().err
    assert f"{storage.size_text(need)}, and {storage.size_text(need - 1)} are free at {results}" in err, err
    assert (" x 2 trials at once (sweep.max_concurrent)" in err) == (trials == 2)
    free["bytes"] = need  # it fits: the preflight says so, and the command goes on to start Ray
    started = []

    def ray_session(*_):
        started.append(True)
        raise RuntimeError("stopped where Ray would start")

    monkeypatch.setattr(cli, "ray_session", ray_session)
    with contextlib.suppress(RuntimeError):  # (train names the error and returns 1, sweep raises it)
        cli.main([command, *argv])
    assert started and "preflight: storage: the checkpoints take at most " in capsys.readouterr().out
