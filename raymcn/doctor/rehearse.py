"""``raymcn doctor --rehearse``: the sweep file in miniature on the cluster itself, before the
first GPU-hour.

The file goes through the suite's one shrinking function (``sweep/rehearsal.py``: the synthetic
corpus, tiny sizes, CPU workers; its algorithm, scheduler, stage split, swept keys and
confirmation kept) and then through the same two phases ``raymcn sweep`` runs
(``phases.search_then_confirm``), on this cluster's nodes, Ray and storage. One trial driver is
killed after its first epoch, as a lost process would be; Tune retries the trial and its Train
run resumes from its checkpoint. The verdict is ``results/rehearsal.py``'s, read from the
rehearsal's folder (``REHEARSAL_PREFIX``-..., under the storage path), and joins the doctor's
table in the head's column: the search, the early stopping at the rungs, BOHB's pause and
resume, the killed trial, the confirmation and the answer line.
"""

from __future__ import annotations

import datetime
import os
import signal
from pathlib import Path
from typing import Any

from ray import tune

from raymcn import phases, storage
from raymcn.config import REHEARSAL_PREFIX, Config, default_storage_path
from raymcn.doctor.verdicts import Row
from raymcn.servers import sweeps as marks

class KillOneTrialDriver(tune.Callback):
    """Kills the driver process of the first trial that reports an epoch before its last (by the
    pid and node Tune puts in every result), once; records {trial id: epochs reported}."""

    def __init__(self, last_epoch: int):
        self.last_epoch, self.killed = last_epoch, {}

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        import ray

        epoch = int(result.get("epoch", 0))
        if self.killed or not 1 <= epoch < self.last_epoch:  # Tune calls its callbacks from one thread
            return
        self.killed[trial.trial_id] = epoch
        node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == result["node_ip"])
        strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        ray.get(ray.remote(_kill).options(num_cpus=0, scheduling_strategy=strategy).remote(int(result["pid"])))


def _kill(pid: int) -> None:
    """SIGKILL ``pid`` (run as a task on its node: a lost process, as a failing machine loses it)."""
    os.kill(pid, signal.SIGKILL)


def miniature(cfg: Config, cpus: float) -> tuple[Config, str]:
    """The rehearsal's config (``cfg`` shrunk for a cluster of ``cpus`` CPUs) and its folder, new,
    under the storage path."""
    from raymcn.sweep.rehearsal import shrink

    mini = shrink(cfg, cpus=cpus)
    if mini.sweep.max_trial_failures < 1:
        mini = mini.replace({"sweep.max_trial_failures": 1})  # the killed trial must be retried
    where = storage.join(storage.normalize(default_storage_path(mini)),
                         f"{REHEARSAL_PREFIX}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    return mini, where


def rehearse(mini: Config, where: str, console) -> list[Row]:
    """Rehearse the miniature ``mini`` in ``where`` on the connected cluster (module doc); its rows."""
    from raymcn.results.rehearsal import rehearsal_checks
    from raymcn.sweep.tuner import search_trials
    from raymcn.train import run_record
    from raymcn.train.inputs import resolve_inputs

    kill = KillOneTrialDriver(mini.schedule.epochs)
    marks.mark_rehearsal(where)  # neither a boot nor `--resume latest` continues it, even if this process dies
    inputs = resolve_inputs(mini)
    run_record.sweep_recorded(where, mini, inputs, "start")  # a new folder: nothing to say
    try:
        phases.search_then_confirm(mini, where, console, inputs, callbacks=(kill,))
    except Exception as e:  # noqa: BLE001 - a sweep that crashes is the finding
        why = _cause(e)
        return [Row("rehearsal ran to its end", False, why[:300], f"the sweep file fails in miniature: {why}"[:400])]
    finally:
        marks.mark_stopped(where)  # a rehearsal is never a sweep for the boot service to continue
    rows = [Row("rehearsal ran to its end", True, where)]
    for c in rehearsal_checks(_local(where, mini), mini, search_trials(mini), killed=kill.killed or None):
        rows.append(Row(f"rehearsal: {c.name}", c.ok, c.detail, "" if c.ok is not False else
                        f"the sweep file in miniature ({where}): {c.name} failed: {c.detail}"))
    if not kill.killed:
        rows.append(Row("rehearsal: a killed trial driver resumed", False, "no trial reported an epoch before its last",
                        "the rehearsal could not kill a trial driver mid-run"))
    return rows


def _cause(error: BaseException) -> str:
    """``error`` and what raised it first: the innermost exception of its chain with the file and
    line it was raised at, or, where Tune passed on only a traceback's text (its TuneError), that
    traceback's last exception and frame."""
    import traceback

    inner = error
    while inner.__cause__ is not None or inner.__context__ is not None:
        inner = inner.__cause__ or inner.__context__
    if inner is not error and inner.__traceback__ is not None:
        frame = traceback.extract_tb(inner.__traceback__)[-1]
        raised, at = f"{type(inner).__name__}: {inner}".rstrip(": "), (frame.filename, frame.lineno, frame.line)
    else:
        lines = [line for line in str(error).splitlines() if line.strip()]
        if "Traceback (most recent call last)" not in str(error) or not lines:
            return f"{type(error).__name__}: {' '.join(str(error).split())}"
        last = max(i for i, line in enumerate(lines) if not line.startswith(" "))
        frames = [i for i in range(last) if lines[i].lstrip().startswith('File "')]
        raised, at = lines[last].strip(), None
        if frames:
            head = lines[frames[-1]].strip().split('"')
            code = lines[frames[-1] + 1].strip() if frames[-1] + 1 < last else ""
            at = (head[1], head[2].split(",")[1].split()[-1], code)
    where = f" at {Path(at[0]).name}:{at[1]} ({at[2]})" if at else ""
    return f"{type(error).__name__} <- {raised}{where}"


def _local(where: str, cfg: Config) -> Path:
    """The rehearsal's folder on this machine (a bucket's read through a local copy)."""
    from raymcn.config import default_cache_dir

    if storage.is_uri(where):
        return storage.local_copy(where, default_cache_dir(cfg) / "experiments", skip=storage.CHECKPOINTS)
    return Path(where)


def rows_in_head_column(report: dict[str, Any], rows: list[Row]) -> None:
    """Adds the rehearsal's rows to the head's column of the doctor's report (they concern the
    cluster as a whole; the other nodes show – for them)."""
    import ray

    head = ray.get_runtime_context().get_node_id()
    report["rows"][head] = report["rows"].get(head, []) + rows
