"""The doctor's verdicts: a node's facts (``probe.py``) against the head's request, as rows of
(check, ✔/✘/–, detail, the fix in one line naming the node, the path or the figure). Pure: a
test hands it facts one machine cannot produce (another version, a full GPU)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raymcn.doctor.driver import Driver, torch_can_use
from raymcn.doctor.probe import SPILL_MIN_BYTES, Request
from raymcn.provenance.describe import NO_GIT

OK, FAIL, NA = "✔", "✘", "–"


@dataclass(frozen=True)
class Row:
    check: str
    ok: bool | None  # None: does not apply on this node
    detail: str
    fix: str = ""


# --- on the head: the verdicts ------------------------------------------------------------------------------
def judge(facts: dict[str, Any], req: Request, head: dict[str, Any] | None = None) -> list[Row]:
    """The rows of one node from its facts (``head``: the head's facts, for what must be equal)."""
    head = head or {}
    host = facts.get("host", "?")
    return [*_input_rows(facts, req, host), *_storage_rows(facts, req, host), *_software_rows(facts, req, host),
            *_hardware_rows(facts, req, host, head)]


def _input_rows(facts: dict, req: Request, host: str) -> list[Row]:
    shards, rows = facts["shards"], []
    if "error" in shards:
        rows.append(Row("shards readable", False, shards["error"],
                        f"{host}: mount the shards at {req.shards_dir} (the same path as on the head), or fix "
                        "data.shards"))
        rows.append(Row("manifest as on the head", None, "no manifest"))
    else:
        rows.append(Row("shards readable", True, f"{shards['videos']} videos in {shards['shards']} shards"))
        same = bool(req.manifest) and shards["digest"] == req.manifest
        rows.append(Row("manifest as on the head", same, shards["digest"],
                        "" if same else f"{host}: {req.shards_dir} holds other shards than the head's (another "
                        "copy or an unfinished conversion): point every node at the same shard folder"))
    if "error" not in shards:
        wrong = shards.get("wrong_sizes", [])
        rows.append(Row("shard sizes as the manifest says", not wrong,
                        f"{shards['shards']} shards checked" if not wrong else
                        f"{len(wrong)} differ: " + "; ".join(wrong[:2]),
                        "" if not wrong else f"{host}: {len(wrong)} shard(s) in {req.shards_dir} differ from the "
                        f"manifest (a copy cut short?): copy them again from the head, or rerun `raymcn shards` "
                        f"there (it rewrites damaged shards): {wrong[0]}"))
    bad = facts["crc"]
    rows.append(Row("shard members pass CRC-32", not bad and "error" not in shards,
                    f"{len(req.sample)} videos checked" if not bad else "; ".join(bad[:2]),
                    "" if not bad else f"{host}: rerun `raymcn shards` with the same arguments (it rewrites damaged "
                    f"shards): {bad[0]}"))
    eval_ok = facts["eval_bytes"] >= 0 and facts["eval_bytes"] == req.eval_bytes
    rows.append(Row("eval set as on the head", eval_ok, f"{req.eval_file} ({facts['eval_bytes']} bytes)",
                    "" if eval_ok else f"{host}: copy {req.eval_file} there (the head's has {req.eval_bytes} bytes) "
                    "or put it on shared storage"))
    words = req.word_vectors or str(Path(req.shards_dir) / "vocab.npy")
    rows.append(Row("word vectors present", bool(facts["word_vectors"]), words,
                    "" if facts["word_vectors"] else f"{host}: {words} is missing there"))
    return rows


def _storage_rows(facts: dict, req: Request, host: str) -> list[Row]:
    st = facts["storage"]
    rows = [Row("storage writable", not st["writable"], req.storage if not st["writable"] else st["writable"],
                "" if not st["writable"] else f"{host}: run.storage_path={req.storage!r} is not writable there: "
                f"{st['writable']}")]
    same = st.get("token") == req.token_text
    rows.append(Row("storage is the head's", same, "reads the head's file" if same else
                    st.get("token_error", "reads another file"),
                    "" if same else f"{host}: {req.storage} is not the head's storage there: mount the same NFS "
                    "share at the same path on every node (or use a bucket)"))
    return rows + [_room_row(st, req, host)]


ROOM_CHECK = "storage has room for the checkpoints"
SPILL_CHECK = "disk where Ray spills"
# the rows whose verdict is the node's free disk at the moment it is probed
FREE_DISK_CHECKS = (ROOM_CHECK, SPILL_CHECK)


def _room_row(st: dict, req: Request, host: str) -> Row:
    """The storage's free space there against what the sweep's trials at once keep in it."""
    if "free" not in st:
        return Row(ROOM_CHECK, None, "an object store: its free space is not checked")
    fits = st["free"] >= req.checkpoints_bytes
    free = f"{st['free'] / 1e9:.1f} GB free at {st['filesystem']}"
    return Row(ROOM_CHECK, fits, f"{free}; needed {req.checkpoints_text}",
               "" if fits else f"{host}: {req.storage} has {free}, the sweep's checkpoints need "
               f"{req.checkpoints_bytes / 1e9:.1f} GB ({req.checkpoints_text}): free space there, lower "
               "run.checkpoints_to_keep or sweep.max_concurrent, or point RAYMCN_RESULTS at a larger disk")


def _software_rows(facts: dict, req: Request, host: str) -> list[Row]:
    # a node without .git (the cluster's rsync leaves it out) is judged by its sources' digest alone
    differ = {k: (v, facts["versions"].get(k)) for k, v in req.versions.items() if facts["versions"].get(k) != v
              and not (k == "commit" and NO_GIT in (v, facts["versions"].get(k)))}
    rows = [Row("versions as on the head", not differ, " ".join(f"{k} {v}" for k, v in facts["versions"].items()),
                "" if not differ else f"{host}: " + ", ".join(f"{k} {got} (head: {want})"
                                                              for k, (want, got) in differ.items())
                + ": install the head's versions there (cluster.yaml's setup_commands)")]
    interpreter = facts["interpreter"]
    ok = interpreter.startswith(req.venv.rstrip("/") + "/") if req.venv else interpreter == req.interpreter
    rows.append(Row("interpreter", ok, interpreter,
                    "" if ok else f"{host}: Ray runs {interpreter}, not "
                    f"{req.venv + '/bin/python' if req.venv else req.interpreter}: start Ray from the environment "
                    "cluster.yaml sets up (RAYMCN_VENV)"))
    return rows


def _hardware_rows(facts: dict, req: Request, host: str, head: dict) -> list[Row]:
    failed = next((g["error"] for g in facts["gpus"] if "error" in g), "")
    gpus = [g for g in facts["gpus"] if "error" not in g]
    if gpus:
        names = sorted({g["name"] for g in gpus})
        rows = [Row("GPUs", True, f"{len(gpus)} x {', '.join(names)} (driver {gpus[0]['driver']})")]
        unknown = sum(1 for g in gpus if g["free"] is None)
        if unknown:  # nvidia-smi says "[N/A]" (MIG, some drivers): nothing to judge by
            rows.append(Row("GPU memory free >= estimate", None,
                            f"not reported by nvidia-smi for {unknown} of {len(gpus)} GPUs (N/A); estimate "
                            f"{req.estimate_bytes / 2**30:.1f} GiB"))
        else:
            least = min(g["free"] for g in gpus)
            fits = not req.use_gpu or least >= req.estimate_bytes
            rows.append(Row("GPU memory free >= estimate", fits,
                            f"least free {least / 2**30:.1f} GiB, estimate {req.estimate_bytes / 2**30:.1f} GiB",
                            "" if fits else f"{host}: a GPU has {least / 2**30:.1f} GiB free, a worker needs "
                            f"~{req.estimate_bytes / 2**30:.1f} GiB: stop what holds it (nvidia-smi) or lower the "
                            "batch (raymcn config shows the preflight's suggestion)"))
    else:
        seen = f"nvidia-smi failed: {failed}" if failed else "none"
        rows = [Row("GPUs", False if req.use_gpu or failed else None, seen,
                    f"{host}: {seen}: check the NVIDIA driver there (nvidia-smi)" if failed else
                    f"{host}: scale.use_gpu=true and this node has no GPU nvidia-smi can see" if req.use_gpu else ""),
                Row("GPU memory free >= estimate", False if req.use_gpu else None, "no GPU")]
    rows.append(_torch_row(facts, req, host))
    rows.append(_cpu_row(facts, req, host))
    # Ray spills objects to its temp folder when the object store fills: room for one store's worth
    spill_need = int(facts.get("resources", {}).get("object_store_memory", SPILL_MIN_BYTES))
    spill_ok = facts["spill_free"] >= spill_need
    rows.append(Row(SPILL_CHECK, spill_ok, f"{facts['spill_free'] / 1e9:.1f} GB free",
                    "" if spill_ok else f"{host}: {facts['spill_free'] / 1e9:.1f} GB free under "
                    f"{os.environ.get('RAY_TMPDIR', '/tmp')}, less than its object store ({spill_need / 1e9:.1f} GB): "
                    "free some, or point RAY_TMPDIR at a larger disk"))
    return rows


def _torch_row(facts: dict, req: Request, host: str) -> Row:
    """Whether torch can use the GPUs nvidia-smi shows on the node (``driver.torch_can_use``: a driver
    too old for the build fails it, naming both), and NCCL's version; on a GPU run only."""
    cuda = facts["cuda"]
    nccl_error = cuda.get("nccl_error", "")
    nccl = cuda["nccl"] or (f"unreadable ({nccl_error})" if nccl_error else "-")
    seen = facts.get("torch_gpus") or {}
    ok, said = torch_can_use(Driver(**facts["driver"]) if facts.get("driver") else Driver(), cuda["cuda"],
                             bool(seen.get("available")), int(seen.get("count", 0)), None, seen.get("warning", ""))
    if seen.get("error"):
        ok, said = False, f"torch's CUDA {cuda['cuda'] or '-'} build could not be asked: {seen['error']}"
    detail = f"{said}; NCCL {nccl}"
    if not req.use_gpu:
        return Row("torch uses the GPUs", None, detail)
    if nccl_error:
        return Row("torch uses the GPUs", False, detail, f"{host}: torch's NCCL: {nccl_error}")
    if not cuda["cuda"]:
        return Row("torch uses the GPUs", False, detail,
                   f"{host}: torch has no CUDA there: run make install in the checkout (it picks the CUDA build "
                   "the driver runs)")
    return Row("torch uses the GPUs", ok, detail, "" if ok else f"{host}: {said}")


def workers_on(facts: dict, req: Request) -> int:
    """Train workers this node can hold: one per GPU on a GPU run, else as many as its Ray CPUs allow."""
    res = facts.get("resources")  # Ray's view of the node (what it may schedule there), when the head gave it
    if req.use_gpu:
        return int(res.get("GPU", 0) if res is not None else sum("error" not in g for g in facts["gpus"]))
    cpus = res.get("CPU", 0) if res is not None else facts["cpus"]
    return int(cpus // max(req.cpus_per_worker, 1e-9))


def _cpu_row(facts: dict, req: Request, host: str) -> Row:
    """A GPU node must give each of its GPUs' workers ``scale.cpus_per_worker`` CPUs (Ray Data's read
    tasks reserve none)."""
    res = facts.get("resources")
    cpus = float(res.get("CPU", 0) if res is not None else facts["cpus"])
    workers = workers_on(facts, req)
    if not workers:
        return Row("CPUs for its workers", None, f"{cpus:g} CPUs: holds no worker")
    need = workers * req.cpus_per_worker
    ok = cpus >= need
    return Row("CPUs for its workers", ok, f"{cpus:g} CPUs for {workers} worker(s) x {req.cpus_per_worker:g}",
               "" if ok else f"{host}: {workers} workers x scale.cpus_per_worker={req.cpus_per_worker:g} need "
               f"{need:g} CPUs, Ray has {cpus:g} there: lower scale.cpus_per_worker")


def step_rows(result: dict | None, req: Request, host: str, error: str = "") -> list[Row]:
    """The ``--step`` row of a node: the step's time, and its peak memory against the estimate."""
    if result is None:
        return [Row("one training step", False, error, f"{host}: {error}")]
    peak = result["peak_bytes"]
    under = peak is None or peak <= result["estimate_bytes"]
    detail = (f"{result['s_per_step_wall']:.3f} s/step, {result['clips']} clips"
              + (f", peak {peak / 2**30:.2f} GiB of estimate {result['estimate_bytes'] / 2**30:.2f} GiB" if peak else ""))
    finite = all(math.isfinite(v) for v in result["losses"].values())
    return [Row("one training step", under and finite, detail,
                "" if under and finite else f"{host}: the step " + ("peaked above the estimate: tell the developers "
                "(the preflight would let an OOM through)" if not under else "gave non-finite losses"))]
