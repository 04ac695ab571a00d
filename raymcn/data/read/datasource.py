"""Ray Data over raymcn's tar shards: every rank streams its own part of every step (the only data module importing Ray).

Worker (each rank)::

    stream = RankStream(shards_dir, index, cfg, rank, world, steps_per_epoch=..., epochs=...)
    for epoch in ...:
        batches, stats = stream.epoch(epoch, start)   # start: the first step to run (mid-epoch resume)
        for batch in batches: ...
        stats.bad_samples  # -> metric "bad_samples" (sum over ranks)

Why each rank has its own dataset instead of one dataset split by Ray Train: Ray Data's split
(``streaming_split``) hands blocks to whichever rank asks next, so which videos meet in a step
could depend on timing, and Ray Data has no iterator that can be resumed inside an epoch. Here the
videos of every step are fixed in advance (``order.py``: a function of seed, epoch and step), so
each rank knows the videos of its share of each step and reads exactly those, by byte range
(``order.VideoIndex``). A resumed run asks for the steps after its checkpoint and reads nothing of
the consumed part; any number of ranks reads the same steps.

A read task (its body is ``stream.read_steps``) covers consecutive steps of one rank: it reads
that rank's videos of each step from the shards (each shard opened once per step, ranges read
front to back), checks every sample (members, CRC-32 of each member), draws the clips and emits
the step's batch as one Arrow row. The training process only maps the row's buffers (no copy):
reading, checking and clip sampling run in the read tasks' processes, next to the step, not on
its critical path. Read tasks run on the rank's own node, at most ``READ_CONCURRENCY`` at once
per rank, in step order (``preserve_order``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask
from ray.util.placement_group import NODE_ID_LABEL_KEY

from raymcn.config import Config
from raymcn.data.read.order import VideoIndex, rank_steps
from raymcn.data.read.stream import (
    STEP_SCHEMA,
    EpochStats,
    StepInfo,
    StepJob,
    log_stderr,
    read_steps,
    step_jobs,
    step_row_nbytes,
    step_rows,
    to_tensors,
)

# A read task's size: it reads, or emits as step rows, about this many bytes (measured: >= 256 MB of
# videos amortise Ray's start gap). The rows count too: clips multiply a short video's bytes ~11x at
# the paper's 32 clips (0.33 MB in, 3.8 MB out), and a task of many such steps kept its second
# in-flight task's rows waiting in the object store behind its own (bench/loader.py --sizes short:
# 0.53 of the Ray-free path with tasks cut by the videos' bytes alone).
DEFAULT_TASK_MB = 256.0
READ_CONCURRENCY = 2  # read tasks in flight per rank: one being consumed, one reading ahead
# CPUs a read task reserves: none. Every rank runs its own Ray Data execution, and Ray Data lets an
# execution start a task only within its share of what the Train workers leave: with any CPU
# request, a group that reserves (nearly) every CPU (a 2-CPU machine, an elastic group grown to the
# cluster's size) left some rank's reader waiting forever (measured: `Cluster resources are not
# enough to run any task`). A zero request cannot be starved; READ_CONCURRENCY bounds the CPU the
# reads take (one core each at most: reading, CRC-32 and clip drawing are single-threaded).
READ_CPUS = 0.0


# Step rows a rank takes from its Ray Data execution ahead of its step: as many as fit in this many
# MB (at least 1; 2 at the paper's 120 MB rows, a whole epoch of the embedded default's 3 MB rows).
# An execution runs a scheduling loop in the rank's own process (every 0.1 s) until every row has
# been taken; taken early, it ends when its read tasks do instead of at the epoch's end. Measured
# (bench/overhead.py, 2 cores, the two ranks' threads other than the training threads during the
# steps): 46 % of a core with one row ahead, 14 % with the rows taken ahead. The rows stay in the
# object store, mapped, until their step.
READ_AHEAD_MB = 256.0


def rows_ahead(cfg: Config, jobs: list[StepJob], text_bf16: bool = False) -> int:
    """Rows a rank prefetches from its execution (:data:`READ_AHEAD_MB` of its largest row, >= 1)."""
    row = max((step_row_nbytes(cfg, len(j.videos), text_bf16) for j in jobs), default=1)
    return max(1, min(len(jobs), int(READ_AHEAD_MB * (1 << 20) // max(1, row))))


class DataOrderError(RuntimeError):
    """A step row arrived out of order (a bug guard: the rows of a rank's dataset are in step order)."""


class RankStepsDatasource(Datasource):
    """The read tasks of one rank's steps: consecutive steps grouped into tasks of >= task_bytes (the
    larger of the videos' bytes and the step rows' bytes); the text in bfloat16 when ``text_bf16``."""

    def __init__(self, shards_dir: str | Path, jobs: list[StepJob], cfg: Config, epoch: int,
                 task_mb: float = DEFAULT_TASK_MB, verify: bool = True, text_bf16: bool = False):
        super().__init__()
        self._dir = str(Path(shards_dir).resolve())
        self._jobs, self._cfg, self._epoch, self._verify = jobs, cfg, int(epoch), verify
        self._text_bf16 = text_bf16
        self.task_bytes = max(1, int(task_mb * (1 << 20)))

    def get_name(self) -> str:
        return "RaymcnSteps"

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(j.nbytes for j in self._jobs)

    def task_groups(self) -> list[list[StepJob]]:
        """The jobs cut into consecutive groups of >= task_bytes (one read task each); a step weighs
        the larger of the bytes it reads and the bytes of the row it emits."""
        groups: list[list[StepJob]] = [[]]
        size = 0
        for job in self._jobs:
            if groups[-1] and size >= self.task_bytes:
                groups.append([])
                size = 0
            groups[-1].append(job)
            size += max(job.nbytes, step_row_nbytes(self._cfg, len(job.videos), self._text_bf16))
        return [g for g in groups if g]

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list[ReadTask]:
        tasks = []
        for group in self.task_groups():
            shards = sorted({name for job in group for _, name, _, _ in job.videos})
            meta = BlockMetadata(num_rows=len(group), size_bytes=sum(j.nbytes for j in group),
                                 input_files=[f"{self._dir}/{name}" for name in shards], exec_stats=None)
            fn = _ReadSteps(self._dir, group, self._cfg, self._epoch, self._verify, self._text_bf16)
            tasks.append(ReadTask(fn, meta, schema=STEP_SCHEMA, per_task_row_limit=per_task_row_limit))
        return tasks


@dataclass
class _ReadSteps:
    """A read task's body (a picklable callable: ``stream.read_steps`` of its jobs)."""

    shards_dir: str
    jobs: list[StepJob]
    cfg: Config
    epoch: int
    verify: bool
    text_bf16: bool

    def __call__(self):
        return read_steps(self.shards_dir, self.jobs, self.cfg, self.epoch, self.verify, self.text_bf16)


def rank_dataset(shards_dir: str | Path, jobs: list[StepJob], cfg: Config, epoch: int, *,
                 read_cpus: float = READ_CPUS, task_mb: float = DEFAULT_TASK_MB,
                 concurrency: int = READ_CONCURRENCY, node_id: str | None = None,
                 verify: bool = True, text_bf16: bool = False) -> ray.data.Dataset:
    """One rank's dataset of ``jobs`` (lazy; nothing is read here): one row per step, in step order.

    Args:
        text_bf16: the word vectors in bfloat16 (the text encoder's choice: ``model/parts.text_in_bf16``).
        read_cpus: CPUs each read task reserves (default none: ``READ_CPUS``).
        concurrency: read tasks in flight at once.
        node_id: run the read tasks on this node when it has room (the rank's own: its rows then
            never cross the network); elsewhere otherwise.
    """
    source = RankStepsDatasource(shards_dir, jobs, cfg, epoch, task_mb, verify, text_bf16)
    tasks = max(1, len(source.task_groups()))
    kwargs: dict[str, Any] = {"concurrency": min(concurrency, tasks), "num_cpus": read_cpus}
    if node_id is not None:  # this node when it can take the task, any node otherwise
        kwargs.update(label_selector={NODE_ID_LABEL_KEY: node_id}, fallback_strategy=[{"label_selector": {}}])
    ds = ray.data.read_datasource(source, override_num_blocks=tasks, **kwargs)
    ctx = ds.context
    ctx.execution_options.preserve_order = True  # rows in step order
    # A read task yields one row per step; Ray Data would pack consecutive rows into blocks of up
    # to 128 MiB and hand a block on only when full, so a toy run's whole task would arrive at
    # once. A tiny target lets each step's row leave as soon as it is built (a row is never cut).
    ctx.target_max_block_size = 1 << 20
    ctx.enable_progress_bars = False
    return ds


@dataclass
class _OpenEpoch:
    """One epoch's step rows, possibly requested in the background (``first`` pulled by ``thread``)."""

    epoch: int
    start: int
    rows: Generator[tuple[dict, StepInfo], None, None]
    thread: threading.Thread | None = None
    first: list[tuple[dict, StepInfo]] = field(default_factory=list)  # 0 or 1 row pulled early
    error: BaseException | None = None

    def resume(self) -> Iterator[tuple[dict, StepInfo]]:
        """Every row, the one pulled early first; closing it closes ``rows``."""
        try:
            if self.thread is not None:
                self.thread.join()
            if self.error is not None:
                raise self.error
            yield from self.first
            yield from self.rows
        finally:
            self.rows.close()


class RankStream:
    """This rank's batches, epoch after epoch; each next epoch is requested before the current one ends.

    Ray Data needs a moment to start an execution (plan the read tasks, schedule one, wait for its
    first row), so as soon as an epoch's last row has arrived the next epoch is requested in a
    background thread, and that wait overlaps the last step, the evaluation and the checkpoint.

    Args:
        shards_dir, index: the shard folder and its :class:`order.VideoIndex`.
        rank, world: this rank and the group's size (the rotating shares of ``order.share``).
        steps_per_epoch, epochs: the run plan's.
        read_cpus, task_mb, node_id, text_bf16: as :func:`rank_dataset`.
        log: where bad samples are reported (rank 0 passes print; None = silent).
    """

    def __init__(self, shards_dir: str | Path, index: VideoIndex, cfg: Config, rank: int, world: int, *,
                 steps_per_epoch: int, epochs: int, read_cpus: float = READ_CPUS,
                 task_mb: float = DEFAULT_TASK_MB, node_id: str | None = None, text_bf16: bool = False,
                 log: Callable[[str], None] | None = log_stderr):
        self._dir, self._index, self._cfg = str(shards_dir), index, cfg
        self._rank, self._world, self._steps, self._epochs = rank, world, steps_per_epoch, epochs
        self._read = dict(read_cpus=read_cpus, task_mb=task_mb, node_id=node_id, text_bf16=text_bf16)
        self._log = log
        self._next: _OpenEpoch | None = None

    def jobs(self, epoch: int, start: int = 0) -> list[StepJob]:
        """This rank's step jobs of ``epoch`` from in-epoch step ``start`` on."""
        slices = rank_steps(self._cfg.run.seed, epoch, len(self._index), self._cfg.data.batch_size, self._steps,
                            self._rank, self._world, start)
        return step_jobs(self._index, slices)

    def epoch(self, epoch: int, start: int = 0) -> tuple[Iterator[dict], EpochStats]:
        """The batches of ``epoch`` from in-epoch step ``start`` to its end, and its counters
        (filled as the rows arrive; complete when the iterator is exhausted)."""
        ahead = self._next
        if ahead is not None and (ahead.epoch, ahead.start) != (epoch, start):
            raise RuntimeError(f"epoch {epoch} from step {start} asked for while epoch {ahead.epoch} from step "
                               f"{ahead.start} was already requested from Ray Data; epochs must be read in order")
        opened, self._next = ahead or self._open(epoch, start), None
        stats = EpochStats()
        return self._batches(opened, stats), stats

    def _batches(self, opened: _OpenEpoch, stats: EpochStats) -> Iterator[dict]:
        expected = opened.epoch * self._steps + opened.start
        last = (opened.epoch + 1) * self._steps - 1
        for batch, info in opened.resume():
            if info.step != expected:
                raise DataOrderError(f"rank {self._rank} expected global step {expected}, the reader delivered "
                                     f"step {info.step}")
            stats.add_step(info, self._log)
            if info.step == last:  # the epoch's last row is here: ask for the next epoch now
                stats.summarise(self._log)
                if opened.epoch + 1 < self._epochs:
                    self._start(opened.epoch + 1)
            expected += 1
            yield to_tensors(batch)

    @property
    def requested_ahead(self) -> int | None:
        """The epoch already requested in the background, if any."""
        return None if self._next is None else self._next.epoch

    def _open(self, epoch: int, start: int) -> _OpenEpoch:
        jobs = self.jobs(epoch, start)
        ds = rank_dataset(self._dir, jobs, self._cfg, epoch, **self._read)
        ahead = rows_ahead(self._cfg, jobs, self._read["text_bf16"])
        tables = ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=ahead)
        return _OpenEpoch(epoch, start, step_rows(tables))

    def _start(self, epoch: int) -> None:
        opened = self._open(epoch, 0)

        def pull() -> None:  # asks Ray Data for the epoch and waits for its first row
            try:
                opened.first.extend(itertools.islice(opened.rows, 1))
            except BaseException as e:  # noqa: BLE001 - re-raised by resume() in the loop's thread
                opened.error = e

        opened.thread = threading.Thread(target=pull, name=f"raymcn-epoch{epoch}-request", daemon=True)
        opened.thread.start()
        self._next = opened
