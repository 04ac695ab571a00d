"""What a probe gathers on one node (it runs there as a Ray task that reserves no CPU or GPU):
facts only, never a verdict, and it never raises; ``verdicts.py`` judges them on the head."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from raymcn import storage
from raymcn.config import reason
from raymcn.doctor.driver import read_driver
from raymcn.provenance import collect
from raymcn.provenance.describe import NO_GIT

SPILL_MIN_BYTES = 10 * 10**9  # Ray spills objects to its temp folder when the object store fills


SAMPLED_VIDEOS = 4  # videos whose every member's CRC-32 a probe checks, spread over the shards


@dataclass(frozen=True)
class Request:
    """What the head sends every node's probe: the paths to check and the head's own facts."""

    shards_dir: str
    manifest: str  # the head's digest of the manifest (shard names and sizes); "" when it has none
    sample: tuple[tuple[str, str, int, int], ...]  # (video id, shard, start, end) to read and CRC-check
    eval_file: str
    eval_bytes: int  # on the head; -1 when missing there
    word_vectors: str  # "" = the shards' vocab.npy
    storage: str
    token: str  # a file the head wrote in the storage, and its text: read back on every node
    token_text: str
    versions: dict[str, str] = field(default_factory=dict)
    interpreter: str = ""
    venv: str = ""  # RAYMCN_VENV on the head: the environment cluster.yaml sets up
    use_gpu: bool = False
    estimate_bytes: int = 0  # the preflight's per-worker memory estimate
    cpus_per_worker: float = 1.0
    checkpoints_bytes: int = 0  # what the sweep's trials at once keep in the storage (checkpoints/space.py)
    checkpoints_text: str = ""  # how that figure is made, for the row


def versions() -> dict[str, str]:
    """What this node runs: raymcn (its version, the commit of its checkout and the digest of its
    sources, ``provenance.collect``: a server whose copy of the checkout is stale differs there),
    Ray, torch and its CUDA build, Python."""
    import ray
    import torch

    code = collect.code_identity()
    commit = code["commit"][:7] + (" with uncommitted changes" if code["dirty"] else "") if code["commit"] else NO_GIT
    return {"raymcn": _own_version(), "commit": commit, "raymcn sources": code["source_digest"][:12],
            "ray": ray.__version__, "torch": torch.__version__, "torch's CUDA": torch.version.cuda or "none",
            "python": platform.python_version()}


def _own_version() -> str:
    """raymcn's installed version, or for a source checkout run without ``pip install`` (on
    ``PYTHONPATH``) the version its pyproject.toml names, said as such."""
    try:
        return importlib.metadata.version("raymcn")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return f"{found.group(1) if found else 'unknown'} (source checkout, not installed)"


def manifest_digest(shard_names, shard_bytes) -> str:
    return hashlib.sha256(json.dumps([list(shard_names), list(shard_bytes)]).encode()).hexdigest()[:16]


# --- on every node ---------------------------------------------------------------------------------------------
def probe(req: Request) -> dict[str, Any]:
    """The facts of the node this runs on (never raises: a fact it cannot get says why)."""
    facts: dict[str, Any] = {"host": socket.gethostname(), "versions": versions(), "interpreter": sys.executable,
                             "cpus": os.cpu_count() or 0, "cuda": _cuda_build(), "gpus": _gpus(),
                             "driver": asdict(read_driver()),
                             "spill_free": _free_bytes(os.environ.get("RAY_TMPDIR", "/tmp"))}
    facts["shards"] = _shards(req)
    facts["crc"] = _crc(req)
    facts["eval_bytes"] = Path(req.eval_file).stat().st_size if Path(req.eval_file).is_file() else -1
    words = Path(req.word_vectors) if req.word_vectors else Path(req.shards_dir) / "vocab.npy"
    facts["word_vectors"] = str(words) if words.is_file() else ""
    facts["storage"] = _storage(req)
    facts["torch_gpus"] = torch_gpus() if facts["driver"]["gpus"] else {}
    return facts


def _shards(req: Request) -> dict[str, Any]:
    from raymcn.data.formats.manifest import load_manifest

    try:
        m = load_manifest(req.shards_dir)
    except (OSError, ValueError) as e:
        return {"error": str(e)}
    return {"digest": manifest_digest([s["name"] for s in m["shards"]], [s["bytes"] for s in m["shards"]]),
            "videos": int(m["counts"]["videos"]), "shards": len(m["shards"]),
            "wrong_sizes": _wrong_sizes(Path(req.shards_dir), m["shards"])}


def _wrong_sizes(root: Path, shards: list[dict]) -> list[str]:
    """Every shard whose size on this node differs from the manifest's (a stat each): a copy cut
    short, a shard rewritten since. The manifest's digest alone matches on such a node."""
    wrong = []
    for s in shards:
        try:
            size = (root / s["name"]).stat().st_size
        except OSError:
            size = -1
        if size != s["bytes"]:
            have = "missing" if size < 0 else f"{size} bytes"
            wrong.append(f"{s['name']}: {have}, the manifest says {s['bytes']}")
    return wrong


def _crc(req: Request) -> list[str]:
    """The sampled videos that fail to read or to pass their CRC-32 checks, with why."""
    from raymcn.data.read.stream import StepJob, read_step_records

    job = StepJob(0, 0, 0, tuple(req.sample))
    try:
        return [f"{r.video_id} in {r.shard}: {r.error}" for r in read_step_records(req.shards_dir, job)
                if r.record is None]
    except Exception as e:  # noqa: BLE001 - reported as the check's failure
        return [reason(e)]


def _storage(req: Request) -> dict[str, str]:
    out = {}
    mine = storage.join(req.storage, ".raymcn-doctor", f"{socket.gethostname()}-{os.getpid()}")
    try:
        storage.write_text(mine, "ok")
        fs, path = storage.filesystem(mine)
        fs.delete_file(path)
        out["writable"] = ""
    except Exception as e:  # noqa: BLE001 - OSError locally, pyarrow errors for buckets
        out["writable"] = reason(e)
    try:
        out["token"] = storage.read_text(req.token)
    except Exception as e:  # noqa: BLE001 - reported as the check's failure
        out["token_error"] = reason(e)
    space = storage.space_at(req.storage)  # None: a bucket
    if space is not None:
        out["free"], out["filesystem"] = space.free, space.named()
    return out


def _cuda_build() -> dict[str, str]:
    """torch's CUDA and NCCL versions ("" when the build has none); ``nccl_error``: why NCCL's
    version could not be read in a CUDA build."""
    import torch

    nccl, error = "", ""
    if torch.version.cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001 - reported in the CUDA row
            error = reason(e)
    return {"cuda": torch.version.cuda or "", "nccl": nccl, "nccl_error": error}


# Run in a child process: torch's answer there opens no CUDA context in the probe's Ray worker.
_TORCH_GPUS = """
import json, warnings
import torch
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
print(json.dumps({"available": available, "count": count, "warning": " ".join(str(w.message) for w in said)}))
"""


def torch_gpus(timeout_s: float = 120.0) -> dict[str, Any]:
    """What torch can use on this node: ``torch.cuda.is_available()``, the GPUs it counts and what it
    warned (a driver too old for the build says so there), from a child process that sees every GPU
    of the node (the probe reserves none, so Ray hides them from its own process); ``{"error": ...}``
    where the child failed."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    try:
        done = subprocess.run([sys.executable, "-c", _TORCH_GPUS], capture_output=True, text=True, env=env,
                              timeout=timeout_s, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.CalledProcessError as e:
        last = (e.stderr or "").strip().splitlines()
        return {"error": f"torch's GPU query exited with {e.returncode}" + (f": {last[-1]}" if last else "")}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return {"error": f"torch's GPU query: {reason(e)}"}


def _gpus() -> list[dict[str, Any]]:
    """Every GPU of the node as nvidia-smi sees it (a probe reserves none, so torch would see none);
    a node whose nvidia-smi fails (a driver/library mismatch, a hung driver) gives one entry
    ``{"error": ...}`` with nvidia-smi's own words."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
    except subprocess.CalledProcessError as e:
        said = (e.stdout or "").strip() or (e.stderr or "").strip()
        return [{"error": f"nvidia-smi exited with {e.returncode}" + (f": {said.splitlines()[0]}" if said else "")}]
    except (OSError, subprocess.SubprocessError) as e:
        return [{"error": f"nvidia-smi: {reason(e)}"}]
    return [_gpu_of(line) for line in out.strip().splitlines()]


def _mib(field: str) -> int | None:
    """Bytes of an nvidia-smi memory field in MiB; None where it reports none ("[N/A]" under MIG and
    on some drivers, "[Not Supported]")."""
    try:
        return int(float(field)) << 20
    except ValueError:
        return None


def _gpu_of(line: str) -> dict[str, Any]:
    """One GPU from one line of nvidia-smi's ``name,memory.total,memory.free,driver_version`` CSV; a
    line that is not four fields is an ``{"error": ...}`` entry quoting it."""
    fields = [x.strip() for x in line.split(",")]
    if len(fields) != 4:
        return {"error": f"nvidia-smi printed a line that is not name, memory.total, memory.free, driver: {line!r}"}
    name, total, free, driver = fields
    return {"name": name, "total": _mib(total), "free": _mib(free), "driver": driver}


def _free_bytes(where: str) -> int:
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return 0
