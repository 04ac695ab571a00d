"""``raymcn doctor`` on the head: the probes sent to every node, their facts judged, the table
printed, the sweep's duration estimated (the package doc says what each part checks)."""


from __future__ import annotations

import argparse
import secrets
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from raymcn import storage
from raymcn.config import Config, ConfigError, default_storage_path, reason
from raymcn.doctor.estimate import estimate
from raymcn.doctor.probe import SAMPLED_VIDEOS, Request, manifest_digest, probe, versions
from raymcn.doctor.verdicts import FAIL, NA, OK, Row, judge, step_rows, workers_on


# --- on the head: the whole check -------------------------------------------------------------------------------
def request_of(cfg: Config, token: str, token_text: str, venv: str = "") -> tuple[Request, Any]:
    """The probes' request for ``cfg`` and the head's resolved inputs (None when the head cannot
    resolve them: its own column then shows why)."""
    from raymcn.train.checkpoints.space import need_of
    from raymcn.train.inputs import eval_inputs, resolve_inputs, shard_folder
    from raymcn.train.preflight.footprint import estimate_worker_memory

    try:
        inputs = resolve_inputs(cfg)
    except ConfigError:
        inputs = None
    spec, _, words = eval_inputs(cfg)
    eval_file = spec.partition(":")[2]
    sample: tuple = ()
    digest = ""
    if inputs is not None:
        from raymcn.data.read.order import StepSlice
        from raymcn.data.read.stream import step_jobs

        picks = sorted({round(i * (inputs.videos - 1) / max(1, SAMPLED_VIDEOS - 1)) for i in range(SAMPLED_VIDEOS)})
        sample = step_jobs(inputs.index, [StepSlice(0, 0, 0, tuple(picks))])[0].videos
        digest = manifest_digest(inputs.index.shard_names, inputs.shard_bytes)
    need = need_of(cfg, trials=cfg.sweep.max_concurrent)  # the sweep's trials at once, each with its checkpoints
    return Request(shards_dir=inputs.shards_dir if inputs else str(shard_folder(cfg)), manifest=digest,
                   sample=tuple(sample), eval_file=eval_file,
                   eval_bytes=Path(eval_file).stat().st_size if Path(eval_file).is_file() else -1,
                   word_vectors=words, storage=storage.normalize(default_storage_path(cfg)), token=token,
                   token_text=token_text, versions=versions(), interpreter=sys.executable,
                   venv=venv, use_gpu=cfg.scale.use_gpu,
                   estimate_bytes=estimate_worker_memory(cfg)["total"],
                   cpus_per_worker=cfg.scale.cpus_per_worker, checkpoints_bytes=need.total,
                   checkpoints_text=need.text()), inputs


def step_probe(cfg_dict: dict, eval_spec: str, eval_frames: int, words: str, shards_dir: str) -> dict:
    """``--step`` on one node: a worker's share of the step (``step_probe.measure_step``) and one
    evaluation of the eval set on the same device."""
    import time

    import torch

    from raymcn.data.evalsets import load_eval_set
    from raymcn.data.formats.words import load_vocab
    from raymcn.model import MCN
    from raymcn.train.evaluate import evaluate
    from raymcn.train.preflight.step_probe import measure_step

    cfg = Config.from_dict(cfg_dict)
    device = torch.device("cuda", 0) if cfg.scale.use_gpu else torch.device("cpu")
    share = -(-cfg.data.batch_size // max(1, cfg.scale.min_workers))
    result = measure_step(cfg.replace({"data.batch_size": share}), device)
    eval_set = load_eval_set(eval_spec, word_vectors=words or load_vocab(shards_dir), max_words=cfg.data.max_words,
                             audio_frames_override=eval_frames)
    started = time.perf_counter()
    evaluate(MCN(cfg.model).to(device), eval_set, device)
    # the run shards the evaluation over its workers
    result["eval_s"] = (time.perf_counter() - started) / max(1, cfg.scale.min_workers)
    return result


def diagnose(cfg: Config, *, step: bool = False, step_time: float | None = None, step_timeout: float = 600.0,
             probe_timeout: float = 120.0, trial_overhead_s: float = 20.0, venv: str = "") -> dict[str, Any]:
    """Every node's rows, the fixes and the duration estimate (Ray connected by the caller);
    ``venv``: the environment every node's Ray must run from (``RAYMCN_VENV``, read by the caller)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token_text = secrets.token_hex(8)
    token = storage.join(storage.normalize(default_storage_path(cfg)), ".raymcn-doctor", f"head-{token_text}")
    storage.write_text(token, token_text)
    try:
        req, inputs = request_of(cfg, token, token_text, venv)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        pinned = {n["NodeID"]: NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False) for n in nodes}
        refs = {nid: ray.remote(probe).options(num_cpus=0, scheduling_strategy=s).remote(req) for nid, s in pinned.items()}
        facts = {nid: _get(ref, probe_timeout) for nid, ref in refs.items()}
        for n in nodes:  # what Ray may schedule there, as the head's view of the cluster says
            if isinstance(facts[n["NodeID"]], dict):
                facts[n["NodeID"]]["resources"] = dict(n.get("Resources", {}))
        columns = _column_names(nodes, {nid: f.get("host", "?") if isinstance(f, dict) else "?"
                                        for nid, f in facts.items()})
        rows = {nid: (judge(f, req) if isinstance(f, dict) else
                      [Row("probe answered", False, f, f"{columns[nid]}: {f}")]) for nid, f in facts.items()}
        hosting = {nid: s for nid, s in pinned.items() if isinstance(facts[nid], dict) and workers_on(facts[nid], req)}
        steps = _steps(cfg, req, inputs, hosting, step_timeout, columns) if step else {}
        for nid, extra in steps.items():
            rows[nid] = rows[nid] + extra[0]
    finally:
        try:
            fs, path = storage.filesystem(token)
            fs.delete_file(path)
        except Exception as e:  # noqa: BLE001 - a leftover token file is harmless: said, not raised
            print(f"note: the doctor's token file {token} stays ({reason(e)})", file=sys.stderr)
    measured = [extra[1] for extra in steps.values() if extra[1] is not None]
    step_s = max((m["s_per_step_wall"] for m in measured), default=step_time)
    eval_s = max((m["eval_s"] for m in measured), default=0.0)
    est = None
    if step_s is not None and inputs is not None:
        from raymcn.train.run_plan import plan_of

        est = estimate(cfg, plan_of(cfg, inputs).steps_per_epoch, step_s, eval_s, ray.cluster_resources(),
                       trial_overhead_s)
    return {"columns": columns, "rows": rows, "estimate": est, "cluster": dict(ray.cluster_resources())}


def _get(ref, timeout: float):
    """The task's answer, or what the table shows instead: "no answer within N s" only when the
    task did not end in time; a task that raised is named by its error (:func:`config.reason`)."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(ref, timeout=timeout)
    except GetTimeoutError:
        ray.cancel(ref, force=True)
        return f"no answer within {timeout:g} s"
    except Exception as e:  # noqa: BLE001 - a node whose task failed is a finding, not a crash
        return f"failed: {reason(e)}"


def _column_names(nodes: list[dict], hosts: dict[str, str]) -> dict[str, str]:
    """node id -> its column: the host name, with the node id's start where hosts repeat; the head marked."""
    import ray

    head = ray.get_runtime_context().get_node_id()
    counts: dict[str, int] = {}
    for h in hosts.values():
        counts[h] = counts.get(h, 0) + 1
    return {n["NodeID"]: (hosts[n["NodeID"]] + (f":{n['NodeID'][:6]}" if counts[hosts[n["NodeID"]]] > 1 else "")
                          + (" (head)" if n["NodeID"] == head else "")) for n in nodes}


def _steps(cfg: Config, req: Request, inputs, pinned: dict, timeout: float, columns: dict) -> dict:
    """node id -> (its step row, the measurement or None): every node's step at once, each given
    ``timeout`` seconds to find a free GPU (or CPU) and finish."""
    import ray

    if inputs is None:
        return {nid: ([Row("one training step", False, "the head cannot resolve the inputs")], None) for nid in pinned}
    need = {"num_gpus": 1, "num_cpus": 0} if cfg.scale.use_gpu else {"num_cpus": min(1.0, cfg.scale.cpus_per_worker)}
    # One step per process: the step leaves a CUDA context and the allocator's cached memory on
    # its GPU for as long as the process lives, and Ray would reuse the process for later tasks
    # (Ray ends a GPU task's process only when the GPUs are declared in ray.remote, not .options).
    fn = ray.remote(max_calls=1)(step_probe)
    refs = {nid: fn.options(scheduling_strategy=s, **need).remote(
        cfg.to_dict(), inputs.eval_set, inputs.eval_audio_frames, inputs.word_vectors, inputs.shards_dir)
        for nid, s in pinned.items()}
    out = {}
    for nid, ref in refs.items():
        got = _get(ref, timeout)
        if isinstance(got, dict):
            out[nid] = (step_rows(got, req, columns[nid]), got)
        elif got.startswith("no answer"):
            what = "a free GPU" if cfg.scale.use_gpu else "a free CPU"
            out[nid] = (step_rows(None, req, columns[nid], f"no step: waited for {what} and its step; {got}"), None)
        else:
            out[nid] = (step_rows(None, req, columns[nid], f"the step {got}"), None)
    return out


def render(report: dict[str, Any], use_gpu: bool) -> str:
    from raymcn.results.render import render_table

    columns, rows = report["columns"], report["rows"]
    checks = list(dict.fromkeys(r.check for node_rows in rows.values() for r in node_rows))
    table = []
    for check in checks:
        line = {"check": check}
        for nid, name in columns.items():
            found = next((r for r in rows[nid] if r.check == check), None)
            line[name] = NA if found is None or found.ok is None else OK if found.ok else FAIL
        table.append(line)
    out = [render_table(table)]
    fixes = [f"{FAIL} {r.check}: {r.fix}" for nid in columns for r in rows[nid] if r.ok is False and r.fix]
    out += fixes or ["every check passed on every node"]
    if report["estimate"] is not None:
        out += [""] + report["estimate"].lines(use_gpu)
    else:
        out += ["", "estimate: run with --step (or give --step-time SECONDS) to estimate the sweep's duration"]
    return "\n".join(out)


def as_json(report: dict[str, Any]) -> dict[str, Any]:
    est = report["estimate"]
    return {"columns": report["columns"], "cluster": report["cluster"],
            "rows": {report["columns"][nid]: [asdict(r) for r in rs] for nid, rs in report["rows"].items()},
            "estimate": None if est is None else {**asdict(est), "wall_s": est.wall_s,
                                                  "worker_hours": est.worker_hours}}


def failed(report: dict[str, Any]) -> bool:
    return any(r.ok is False for rs in report["rows"].values() for r in rs)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="run or sweep YAML (default: the embedded tiny synthetic preset)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. --set data.shards=/data/howto100m/shards (repeatable)")
    p.add_argument("--address", help="the Ray cluster: HOST:PORT, or auto (the one running on this machine); default: "
                   "RAY_ADDRESS (a cluster's servers get auto from ~/.raymcn_env), else a new local Ray of its own")
    p.add_argument("--step", action="store_true", help="also run one training step of the config on one GPU (or "
                   "CPU) of every node: needs a free GPU per node, waits --step-timeout at most")
    p.add_argument("--step-time", type=float, metavar="SECONDS", help="seconds per training step for the estimate "
                   "when --step is not run (e.g. from bench/gpu_smoke.py)")
    p.add_argument("--step-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="how long --step waits for a free GPU and its step on each node (default 600)")
    p.add_argument("--trial-overhead", type=float, default=20.0, metavar="SECONDS",
                   help="seconds to start and stop one trial, for the estimate (default 20)")
    p.add_argument("--rehearse", action="store_true", help="also run the sweep file in miniature on this cluster "
                   "(CPU, a few minutes): search, early stopping, BOHB's pause and resume, a killed trial driver "
                   "resumed, the confirmation and the answer line; its rows join the head's column")
    p.add_argument("--verbose", action="store_true", help="with --rehearse: show everything Ray prints")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line last")
