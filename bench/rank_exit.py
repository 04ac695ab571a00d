"""A rank's end: its process group left, then its process ended without aborting (the benchmarks'
ranks that run a process group of their own). No Ray.

Why a rank's exit could abort ("terminate called without an active exception", SIGABRT): a gloo
group's worker threads outlive ``destroy_process_group`` once a model was wrapped in DDP (the
wrap keeps the group's C++ side alive until the process ends). The worker thread that ran a
collective also releases it after it completes; when the collective's tensors were made in
Python, releasing them takes Python's GIL. If the interpreter is finalizing by then (the rank's
main function returned), the thread is ended inside C++ code that cannot be unwound, and the
process aborts. A race, so rare in a training run's exit, and certain enough to measure with
collectives left in flight: 2 gloo ranks of a DDP model, 32 all-reduces of 4 MiB started and
not waited for, then the process ended (a 2-core Intel Xeon VM, torch 2.13):

* by returning from the main function: a rank aborted in 4 of 5 runs;
* after a barrier and ``destroy_process_group`` (:func:`leave_group`): 0 of 5, but with 4
  all-reduces in flight still 2 of 8 (the barrier completes before every worker thread has
  released what it ran);
* after :func:`leave_group` and ``os._exit`` (:func:`end_rank`): 0 of 12, and 0 of 10 with 32.

A barrier's return does not mean that the peers have had this rank's part of it: with torch 2.3.1,
on a loaded 2-core machine, a rank went on from the barrier to ``os._exit`` before its last message
reached its peer, which then waited in the barrier forever (the last rank of 2 and of 3 gloo ranks,
both in one run of the compat tier; py-spy showed it in :func:`leave_group`'s barrier, the other
ranks gone). So after the barrier every rank waits, through the group's store, until every rank is
past it; rank 0, which may host the store (a TCPStore), goes last.

Ray Train ends its workers' processes itself (it kills them), so a rank run by Ray never meets
this; a process that ran a group on its own (``torchrun``, ``torch.multiprocessing.spawn``, a
one-process group) ends with :func:`end_rank`. ``tests/test_rank_exit.py`` checks it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn

import torch.distributed as dist


PAST, GONE = "rank_exit/past_the_barrier", "rank_exit/going"  # the store's counters
LEAVE_WAIT_S = 300  # at most, for peers that never get past the barrier (then this rank goes anyway)


def leave_group() -> None:
    """Every rank's last collective done (a barrier: no rank goes while a peer still talks to
    it), every rank past that barrier (:func:`_all_past_the_barrier`), then the default process
    group destroyed. Nothing if this process has no group."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        _all_past_the_barrier()
        dist.destroy_process_group()


def _all_past_the_barrier(poll_s: float = 0.01) -> None:
    """Wait until every rank has counted itself past the barrier in the group's store (the module
    doc); rank 0 also waits until every other rank has seen that, as it may host the store."""
    store, world = dist.distributed_c10d._get_default_store(), dist.get_world_size()
    deadline = time.monotonic() + LEAVE_WAIT_S

    def wait_for(key: str) -> None:
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(poll_s)

    store.add(PAST, 1)
    wait_for(PAST)
    store.add(GONE, 1)
    if dist.get_rank() == 0:
        wait_for(GONE)


def end_rank(code: int = 0) -> NoReturn:
    """End this process with exit status ``code``: its group left (:func:`leave_group`),
    stdout and stderr flushed, then ``os._exit``, without the interpreter's finalization, which
    a gloo worker thread still releasing a collective would abort (the module doc).

    For the main function of a process that ran a process group itself, as its last call: files
    it wrote must be closed by then (atexit handlers do not run). Not for a Ray actor."""
    leave_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
