"""The provenance entries of runs and sweeps (``raymcn.provenance``): what the driver knows where a run
or sweep starts or resumes, and what every node says from its ranks once the worker group stands.

The driver's entry: the command, raymcn's code (``collect.code_identity``), the environment with every
installed package, the host, the data's identity and the seeds. The data is identified by what the run
reads, never by hashing the shards: the manifest file (which lists every shard with its size and
SHA-256) by its own digest, the shard and video counts, the eval set file and the word vectors by
size and digest (``collect.file_identity``), and for the embedded default the synthetic corpus's
settings. A sweep's trial may run on a server without ``.git``: its driver takes the commit and patch
the sweep's driver recorded (:func:`carried_from`) and adds its own sources' digest beside them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from raymcn import storage
from raymcn.config import CONFIRM_DIR, Config
from raymcn.data.formats.manifest import MANIFEST
from raymcn.provenance import collect, record
from raymcn.provenance.compare import node_disagreements, resume_notes
from raymcn.train.inputs import RunInputs

# The settings that make the embedded default's synthetic corpus (its generator is seeded by them)
SYNTHETIC = {"videos": "data.synthetic_videos", "eval_clips": "data.synthetic_eval_clips",
             "topics": "data.synthetic_topics", "word_dim": "model.word_dim"}


def data_identity(cfg: Config, inputs: RunInputs) -> dict[str, Any]:
    """What the run reads, by identity (module doc)."""
    manifest = collect.file_identity(Path(inputs.shards_dir) / MANIFEST, whole=True)
    _, _, eval_file = inputs.eval_set.partition(":")
    data: dict[str, Any] = {
        "shards": {"dir": inputs.shards_dir, "manifest": manifest, "shards": len(inputs.shard_bytes),
                   "videos": inputs.videos, "feature_dtype": inputs.feature_dtype},
        "eval_set": {"spec": inputs.eval_set, "file": collect.file_identity(eval_file)},
        "word_vectors": (collect.file_identity(inputs.word_vectors) if inputs.word_vectors
                         else {"path": "", "from": "the shards' vocab.npy"})}
    if not cfg.data.shards:
        flat = cfg.to_flat()
        data["synthetic"] = {name: flat[key] for name, key in SYNTHETIC.items()}
    return data


def seeds(cfg: Config) -> dict[str, int]:
    """``run.seed`` (the model's initialisation, the data order, k-means), and a sweep's own ``sweep.seed``."""
    return {"run.seed": cfg.run.seed, **({"sweep.seed": cfg.sweep.seed} if cfg.sweep.space else {})}


def driver_entry(cfg: Config, inputs: RunInputs, carried: dict[str, Any] | None = None,
                 trial: str | None = None) -> dict[str, Any]:
    """This process's driver entry for a run or sweep of ``cfg`` reading ``inputs``. ``carried``: the
    sweep driver's code and command (:func:`carried_from`), for a trial ``trial`` whose own process
    finds no commit."""
    code = collect.code_identity()
    if carried and not code.get("commit") and carried["code"].get("commit"):
        code = {**carried["code"], "source_digest": code["source_digest"], "origin": "carried",
                "carried_from": carried["host"], "carried_source_digest": carried["code"].get("source_digest")}
    entry = {"command": (carried or {}).get("command") or list(sys.argv), "code": code,
             "environment": collect.environment(), "host": collect.host(), "data": data_identity(cfg, inputs),
             "seeds": seeds(cfg)}
    if trial:
        entry["trial"] = trial
    return entry


def carried_from(experiment_dir: str) -> dict[str, Any] | None:
    """The code, command and host of the newest driver entry of the sweep in ``experiment_dir`` (its
    confirmation's folder reads the sweep's); None when the sweep kept no record."""
    found = record.drivers(record.read(experiment_dir))
    if not found and storage.basename(experiment_dir) == CONFIRM_DIR:
        found = record.drivers(record.read(storage.parent(experiment_dir)))
    if not found:
        return None
    latest = found[-1]
    return {"code": latest.get("code") or {}, "command": latest.get("command"),
            "host": (latest.get("host") or {}).get("name", "")}


def notes(folder: str, entry: dict[str, Any], what: str) -> list[str]:
    """What a resumed run or sweep (``what``) in ``folder`` says first when ``entry`` differs from its
    record (``compare.resume_notes``); [] for a new one."""
    return resume_notes(record.read(folder), entry, what, record.path_of(folder))


def sweep_recorded(experiment_dir: str, cfg: Config, inputs: RunInputs, kind: str) -> list[str]:
    """The sweep driver's entry added to the record of the sweep in ``experiment_dir`` (``kind``:
    start, resume or confirm), before its trials start (each carries its code from it); returns
    what the sweep says first when it differs from what the sweep had (:func:`notes`)."""
    entry = driver_entry(cfg, inputs)
    said = notes(experiment_dir, entry, "sweep")
    record.append(experiment_dir, entry, kind)
    return said


def node_part(rank: int, device: torch.device) -> dict[str, Any]:
    """This rank's node: host, CPU, GPUs and driver, Python, torch with its CUDA build, Ray, numpy, and
    the digest of the raymcn sources this process imported; its rank and device."""
    host, env = collect.host(), collect.environment(all_packages=False)
    name = f"{device} {torch.cuda.get_device_name(device)}" if device.type == "cuda" else str(device)
    return {"rank": rank, "device": name, "host": host["name"], "cpu": host["cpu"], "cpus": host["cpus"],
            "gpus": host["gpus"], "gpu_driver": host["gpu_driver"], "python": env["python"], "torch": env["torch"],
            "cuda": env["cuda"], "ray": env["ray"], "numpy": env["numpy"],
            "source_digest": collect.source_digest(collect.source_files())}


def record_nodes(run_dir: str, parts: list[dict[str, Any]]) -> list[str]:
    """Rank 0, once its group stands: every rank's part (:func:`node_part`) folded into nodes and added
    to the run's record (unless the same nodes were recorded since its driver's entry); returns the
    lines naming the nodes (and the driver) that differ in raymcn's sources, Python, torch, its CUDA
    build or Ray ([] when they agree)."""
    nodes = record.fold_ranks(parts)
    entries = record.read(run_dir)
    if nodes != record.nodes_since_driver(entries):
        record.append(run_dir, {"nodes": nodes}, kind=record.NODES)
    found = record.drivers(entries)
    lines = node_disagreements(found[-1] if found else None, nodes)
    if not lines:
        return []
    return [f"note: the nodes of this run differ; each is in its record ({record.path_of(run_dir)}):", *lines]
