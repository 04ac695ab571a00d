"""The process's ``RAYMCN_*`` variables, read once where a process starts.

A process reads them at its entry (the ``raymcn`` command line, a Ray Train worker's start, a
Tune trial's driver, a benchmark's or a test's call into raymcn) into an :class:`Environment` and
passes that object down; no module below reads a variable. What the processes Ray starts must
see is handed to them through Ray's runtime environment: the command's job (``ray_session``:
Tune's trial drivers, Train's controllers, the read tasks, which on a cluster are started by
raylets that never saw the command's environment) and each Ray Train worker
(``launch.build_trainer``: ``worker_runtime_env``); each reads it at its start like any other process.
Two exceptions: ``config.default_cache_dir`` and ``config.default_storage_path`` read RAYMCN_CACHE
and RAYMCN_RESULTS themselves, because every in-process caller (a test, a benchmark) builds its
own config and must not write under the home folder.

==================  ============  ===================================================================
variable            field         what uses it
==================  ============  ===================================================================
RAYMCN_CACHE        cache         ``data.cache_dir`` when the config leaves it empty
RAYMCN_RESULTS      results       ``run.storage_path`` when the config leaves it empty
RAYMCN_VENV         venv          ``raymcn doctor``: the environment every node's Ray must run from
RAYMCN_FAULT        fault         fault injection (``train/faults.py``), installed into a rank's run
RAYMCN_FAULT_DIR    fault_dir     the faults' once-per-run markers and hold file
RAYMCN_FAULT_RANK   fault_rank    the rank a rank-specific fault hits (default 1)
RAYMCN_TRACE        trace         every step's loss terms and inputs, per rank (``train/probes.py``)
RAYMCN_TIMELINE     timeline      the benchmarks' event timeline (``train/probes.py``)
==================  ============  ===================================================================

Stdlib only: the config layer and every process's first lines import it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

PREFIX = "RAYMCN_"


@dataclass(frozen=True)
class Environment:
    """A process's ``RAYMCN_*`` settings (see the module doc); empty strings where unset."""

    cache: str = ""
    results: str = ""
    venv: str = ""
    fault: str = ""
    fault_dir: str = ""
    fault_rank: str = ""
    trace: str = ""
    timeline: str = ""

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Environment:
        """The variables of ``environ`` (default: this process's ``os.environ``)."""
        environ = os.environ if environ is None else environ
        return cls(**{f.name: environ.get(variable(f.name), "") for f in fields(cls)})

    def variables(self) -> dict[str, str]:
        """The variables that are set, by name: what a process started for this one (a Ray Train
        worker) is given, to read at its own start."""
        return {variable(f.name): getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}


def variable(name: str) -> str:
    """The variable of field ``name`` (``fault_dir`` -> ``RAYMCN_FAULT_DIR``)."""
    return PREFIX + name.upper()
