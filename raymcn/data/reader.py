"""Ray Data over raymcn's tar shards: driver-side dataset, worker-side batches (the only data module importing Ray).

Driver::

    ds = build_dataset(shards_dir, cfg)                 # lazy; read tasks of >= 512 MB of shards
    TorchTrainer(..., datasets={"train": ds})           # Ray Train splits it per rank (equal=True)

Worker (each rank)::

    stream = RankStream(ray.train.get_dataset_shard("train"), cfg, rank, world, steps, vocab,
                        epochs=cfg.schedule.epochs, announce=...)   # rank 0 announces each epoch
    for epoch in ...:
        batches, stats = stream.epoch(epoch)       # the next epoch is requested before this one ends
        for batch in batches: ...
        stats.bad_samples  # -> metric "bad_samples" (sum over ranks)

Why a custom datasource instead of ``read_webdataset``: with its default decoder ``read_webdataset``
parses every member through Python's ``tarfile``, ``np.load``-s (copies, ``ast.literal_eval`` of
each header) every array, builds a pandas frame of ndarray objects that Ray converts to Arrow
variable-shaped tensor columns (another copy; the object store held 2.7 GB for 1.4 GB of shards),
splits each read task's output into ~1 MB blocks to reach 200 blocks, and the consumer converts
back to numpy. It also aborts the whole read on a truncated tar. Measured on 4000 short videos:
~370-460 videos/s, slower than the original per-video ``np.load``.

Here a read task (its body is ``stream.read_shards_blocks``) reads its shards sequentially in
64 MB pieces into uninitialised numpy buffers, finds the members from the 512-byte tar headers in
place, checks every sample (members present, CRC-32 of each member) and emits one Arrow block per
piece whose ``sample`` column is a zero-copy slice of the piece (each row = the tar bytes of one
video, ``layout`` = where its ``.npy`` members are). The object store receives the only copy; the
worker maps the members with ``np.frombuffer`` (no copy, a regex parses the ``.npy`` headers) and
draws clips from them. Bad samples travel as rows with an ``error`` and no bytes, so the rank that
receives them counts and logs them (shard name included) and nothing else is lost.

This module holds only what needs Ray: the datasource that plans the read tasks, the run's
EpochClock actor, and the per-rank RankStream over a DataIterator. What is done to the data is
Ray-free, in ``stream.py`` (tables, records, batches, counters), ``sample.py`` and ``tarfmt.py``.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from raymcn.config import Config
from raymcn.data.features import VideoRecord
from raymcn.data.shards import load_manifest
from raymcn.data.stream import (SCHEMA, DataEpochError, EpochStats, batches_from_records, log_stderr,
                                read_shards_blocks, records_from_tables)
from raymcn.data.words import Vocab

DEFAULT_BLOCK_MB = 64.0  # target bytes of one Arrow block emitted by a read task (measured: 64 > 32)
DEFAULT_TASK_MB = 512.0  # shards read by one read task, at least this many bytes


# =====================================================================================================
# Driver side
# =====================================================================================================
CLOCK_NAMESPACE = "raymcn"
CLOCK_TIMEOUT_S = 120.0  # a clock that does not answer in this long is a failure, not a wait


@ray.remote(num_cpus=0, max_restarts=-1)
class EpochClock:
    """The epoch a run's rank 0 is about to read, for the datasource that plans its shard order.

    The datasource plans an epoch when Ray Data starts it, inside Ray Data's split coordinator,
    which knows nothing of the trainer; the trainer's own epoch (not Ray's count of executions)
    keeps the order the same after a resume or a worker-group restart, and it must be known before
    the previous epoch's checkpoint exists (the next epoch is requested early, :class:`RankStream`).
    One named actor per run carries it through Ray itself, so it reaches the coordinator on any
    node whatever the storage (a file in the run directory would need one filesystem view).
    """

    def __init__(self):
        self._epoch: int | None = None

    def announce(self, epoch: int) -> None:
        self._epoch = int(epoch)

    def current(self) -> int | None:
        return self._epoch


def clock_name(run_name: str) -> str:
    return f"raymcn-epoch-{run_name}"


_CLOCKS: dict[str, Any] = {}  # run name -> handle: a named actor lives as long as a handle to it does


def start_epoch_clock(run_name: str):
    """The run's clock (driver side): created on this node, or the one that already exists. It
    lives until :func:`stop_epoch_clock` or the exit of the process that started it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On its owner's node (num_cpus=0: it always fits): it dies with the driver anyway.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    _CLOCKS[run_name] = EpochClock.options(name=clock_name(run_name), namespace=CLOCK_NAMESPACE,
                                           get_if_exists=True, scheduling_strategy=here).remote()
    return _CLOCKS[run_name]


def stop_epoch_clock(run_name: str) -> None:
    """Remove the run's clock once the run has ended."""
    handle = _CLOCKS.pop(run_name, None)
    if handle is not None:
        ray.kill(handle)


def _clock(name: str):
    try:
        return ray.get_actor(name, namespace=CLOCK_NAMESPACE)
    except ValueError:
        raise DataEpochError(f"the run's epoch clock {name!r} does not exist (its driver is gone?)") from None


def announce_epoch(name: str, epoch: int) -> None:
    """Record that ``epoch`` is read next (rank 0 calls this before asking Ray Data for it)."""
    ray.get(_clock(name).announce.remote(int(epoch)), timeout=CLOCK_TIMEOUT_S)


def announced_epoch(name: str) -> int:
    """The epoch rank 0 last announced on clock ``name`` (the datasource calls this when planning).

    Raises:
        DataEpochError: nothing was announced yet (a missing signal is an error, never epoch 0).
    """
    epoch = ray.get(_clock(name).current.remote(), timeout=CLOCK_TIMEOUT_S)
    if epoch is None:
        raise DataEpochError(f"Ray Data started an epoch of the training shards before the trainer announced "
                             f"which one (clock {name!r}); rank 0 announces each epoch before reading it")
    return int(epoch)


def shard_order(seed: int, epoch: int, num_shards: int) -> np.ndarray:
    """The order in which shards are read in ``epoch`` (a permutation; a function of seed and epoch)."""
    return np.random.default_rng([int(seed), int(epoch), 0x0DDBA11]).permutation(num_shards)


class ShardDatasource(Datasource):
    """Ray Data datasource over the shards listed in a manifest; each read task reads a group of shards.

    The read tasks are created in a new order at every execution (= every epoch of a Ray Train
    run, every ``iter_batches`` pass over a plain dataset): ``shard_order(seed, start_epoch + k)``
    for the k-th execution of this dataset.
    """

    def __init__(self, shards_dir: str | Path, manifest: dict, seed: int, start_epoch: int = 0,
                 block_mb: float = DEFAULT_BLOCK_MB, verify: bool = True, task_mb: float = DEFAULT_TASK_MB,
                 epoch_fn: Callable[[], int] | None = None):
        super().__init__()
        self._dir = str(Path(shards_dir).resolve())
        self._shards = [(s["name"], int(s["bytes"]), list(s["videos"])) for s in manifest["shards"]]
        self._seed, self._start_epoch = int(seed), int(start_epoch)
        self.block_bytes = max(1 << 16, int(block_mb * (1 << 20)))
        self.task_bytes = max(1, int(task_mb * (1 << 20)))
        self._verify = verify
        self._epoch_fn = epoch_fn

    def get_name(self) -> str:
        return "RaymcnShards"

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(b for _, b, _ in self._shards)

    def epoch_for(self, data_context) -> int:
        if data_context is None:
            # Ray Data's metadata probes (dataset creation, the read-parallelism rule) plan without a
            # context; they use only the counts, which no epoch changes. Executions pass one.
            return self._start_epoch
        if self._epoch_fn is not None:
            # The trainer's own epoch (EpochClock): the same after a worker-group restart or a
            # resume, unlike Ray's count of executions.
            return int(self._epoch_fn())
        # Ray counts completed executions of a dataset in its DataContext (FileShuffleConfig's
        # reseed_after_execution relies on the same counter).
        return self._start_epoch + int(getattr(data_context, "_execution_idx", 0) or 0)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list[ReadTask]:
        epoch = self.epoch_for(data_context)
        tasks = []
        for group in self.task_groups(epoch):
            meta = BlockMetadata(num_rows=sum(len(v) for _, _, v in group), size_bytes=sum(b for _, b, _ in group),
                                 input_files=[f"{self._dir}/{name}" for name, _, _ in group], exec_stats=None)
            jobs = [(f"{self._dir}/{name}", name, videos) for name, _, videos in group]
            fn = functools.partial(read_shards_blocks, jobs, self.block_bytes, self._verify, epoch)
            tasks.append(ReadTask(fn, meta, schema=SCHEMA, per_task_row_limit=per_task_row_limit))
        return tasks

    def task_groups(self, epoch: int) -> list[list[tuple[str, int, list[str]]]]:
        """The shards in this epoch's order, cut into consecutive groups of >= task_bytes (one read task each).

        Serial read tasks on a small machine each pay a scheduling gap (measured ~45 ms under load),
        so a task reads a few shards one after the other; blocks still leave every block_mb.
        """
        groups: list[list[tuple[str, int, list[str]]]] = [[]]
        size = 0
        for i in shard_order(self._seed, epoch, len(self._shards)):
            if groups[-1] and size >= self.task_bytes:
                groups.append([])
                size = 0
            groups[-1].append(self._shards[int(i)])
            size += self._shards[int(i)][1]
        return [g for g in groups if g]


def build_dataset(shards_dir: str | Path, cfg: Config, *, manifest: dict | None = None, start_epoch: int = 0,
                  epoch_fn: Callable[[], int] | None = None, block_mb: float = DEFAULT_BLOCK_MB,
                  task_mb: float = DEFAULT_TASK_MB, num_cpus: float | None = None,
                  verify: bool = True) -> ray.data.Dataset:
    """The training dataset over the shards of ``shards_dir`` (lazy; nothing is read here).

    Args:
        shards_dir: a directory written by ``raymcn shards`` (or ``ensure_synthetic_shards``).
        cfg: uses ``run.seed`` for the per-epoch shard order.
        manifest: the directory's manifest if the caller already read it (it lists every video).
        start_epoch: the epoch the run starts at (a resumed run continues the shard-order sequence).
        epoch_fn: when given, returns the epoch about to be read (the trainer passes
            ``announced_epoch`` of its run's clock); replaces start_epoch + Ray's execution count.
        block_mb: Arrow block size emitted by the read tasks.
        task_mb: shards are grouped into read tasks of at least this many bytes.
        num_cpus: CPUs reserved per read task (default Ray Data's, 1). On 2 cores one read task at
            a time was fastest (two at 0.5 CPU each: ~40 % slower); pass < 1 only when Ray Train
            leaves Data less than a whole CPU (Data must get at least this much, see ray-notes P1).
        verify: check each sample's CRC-32 list in the read task (catches flipped bytes).

    Returns:
        ray.data.Dataset with columns ``key``, ``shard``, ``sample``, ``layout``, ``error``;
        consume it with :func:`iter_batches` / :func:`iter_records`.
    """
    manifest = manifest or load_manifest(shards_dir)
    source = ShardDatasource(shards_dir, manifest, cfg.run.seed, start_epoch, block_mb, verify, task_mb, epoch_fn)
    kwargs: dict[str, Any] = {}
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    # One block stream per read task: without this, Ray Data aims at >= 200 blocks and appends a
    # SplitBlocks step that cuts every read task's output into ~1 MB pieces (measured: 66 pieces
    # of 3 videos for one 66 MB shard), which multiplies per-block overheads downstream.
    ds = ray.data.read_datasource(source, override_num_blocks=len(source.task_groups(start_epoch)), **kwargs)
    # Ray Data coalesces what a read task yields into blocks of target_max_block_size (128 MiB by
    # default): a whole short shard then left as one block, only when fully read. The read task
    # yields one table per piece of block_mb it reads (a little less: only complete samples);
    # a target of 0.7 x block_mb lets each leave at once, and Ray slices only above 1.5 x target.
    ds.context.target_max_block_size = int(0.7 * source.block_bytes)
    return ds


# =====================================================================================================
# Worker side
# =====================================================================================================
def iter_records(data, stats: EpochStats | None = None, *, prefetch_batches: int = 2,
                 log: Callable[[str], None] | None = log_stderr, epoch: int | None = None) -> Iterator[VideoRecord]:
    """Readable videos from a Dataset or a per-rank DataIterator (``get_dataset_shard`` / ``streaming_split``).

    Ray Data's blocks as Arrow tables through :func:`stream.records_from_tables`: zero-copy records,
    bad samples counted in ``stats`` and logged with their shard name.

    Raises:
        DataEpochError: ``epoch`` is given and a block was planned for another epoch (its shard
            order announced late, or not at all for this epoch).
    """
    tables = data.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=prefetch_batches)
    yield from records_from_tables(tables, stats, log=log, epoch=epoch)


def iter_batches(data_iterator, cfg: Config, epoch: int, rank: int, videos: int, steps: int,
                 vocab: Vocab | np.ndarray, *, stats: EpochStats | None = None, shuffle_buffer: int | None = None,
                 drain: bool = True, log: Callable[[str], None] | None = log_stderr) -> Iterator[dict]:
    """Exactly ``steps`` batches of ``videos`` videos (this rank's share) for this rank and epoch.

    One epoch of ``data_iterator`` (``ray.train.get_dataset_shard("train")``, or a split / Dataset
    in tests) through :func:`batches_from_records`; ``stats`` is filled in place.
    """
    stats = stats if stats is not None else EpochStats()
    return batches_from_records(iter_records(data_iterator, stats, log=log), cfg, epoch, rank, videos, steps,
                                vocab, stats=stats, shuffle_buffer=shuffle_buffer, drain=drain)


@dataclass
class _OpenEpoch:
    """One epoch's record stream, possibly started in the background (``first`` pulled by ``thread``)."""

    epoch: int
    stats: EpochStats
    records: Generator[VideoRecord, None, None]  # iter_records
    thread: threading.Thread | None = None
    first: list[VideoRecord] = field(default_factory=list)  # 0 or 1 record pulled early
    error: BaseException | None = None

    def resume(self) -> Iterator[VideoRecord]:
        """The whole stream, the record pulled early first; closing it closes ``records``."""
        try:
            if self.thread is not None:
                self.thread.join()
            if self.error is not None:
                raise self.error
            yield from self.first
            yield from self.records
        finally:
            self.records.close()


class RankStream:
    """This rank's batches, epoch after epoch; each next epoch is requested before the current one ends.

    Ray Data starts an epoch only when every rank asks for its first block: the split coordinator
    polls its barrier (every 0.1 s), plans the read tasks, schedules one and waits for its first
    block. Measured on 2 cores with the default preset: 0.2-0.5 s before the first batch of every
    epoch (~10 steps' worth of time), while the rest of the epoch's batches waited ~6 ms each. So
    as soon as an epoch's stream is drained (just before its last batch is yielded) the next epoch
    is requested in a background thread, and that wait overlaps the last step, the evaluation, the
    checkpoint and ``ray.train.report``.

    Args:
        data_iterator: ``ray.train.get_dataset_shard("train")`` (or a split / Dataset in tests).
        epochs: the run's epoch count; nothing is requested beyond epoch ``epochs - 1``.
        announce: called with an epoch just before Ray Data is asked for it; rank 0 passes
            ``functools.partial(announce_epoch, clock)`` so the datasource plans that epoch's order.
            Every rank checks that what it reads was planned for its epoch.
        videos: this rank's videos per step, a number or a function of the global step (the plan's
            rotating share: ``functools.partial(plan.share, rank, world)``).
        cfg, rank, steps, vocab, log: as :func:`iter_batches`.
    """

    def __init__(self, data_iterator, cfg: Config, rank: int, videos: int | Callable[[int], int], steps: int,
                 vocab: Vocab | np.ndarray, *, epochs: int, announce: Callable[[int], None] | None = None,
                 log: Callable[[str], None] | None = log_stderr):
        self._data, self._cfg, self._vocab, self._log = data_iterator, cfg, vocab, log
        self._rank, self._videos, self._steps, self._epochs = rank, videos, steps, epochs
        self._announce = announce
        self._next: _OpenEpoch | None = None

    def epoch(self, epoch: int) -> tuple[Iterator[dict], EpochStats]:
        """The batches of ``epoch`` (see :func:`batches_from_records`) and its counters, filled as they are read."""
        if self._next is not None and self._next.epoch != epoch:
            raise RuntimeError(f"epoch {epoch} asked for while epoch {self._next.epoch} was already requested "
                               "from Ray Data; epochs must be read in order")
        opened, self._next = self._next or self._open(epoch), None
        ahead = epoch + 1 < self._epochs
        first = epoch * self._steps  # the global step of the epoch's first batch
        videos = (lambda k: self._videos(first + k)) if callable(self._videos) else self._videos
        batches = batches_from_records(opened.resume(), self._cfg, epoch, self._rank, videos, self._steps,
                                       self._vocab, stats=opened.stats,
                                       on_drained=(lambda: self._start(epoch + 1)) if ahead else None)
        return batches, opened.stats

    @property
    def requested_ahead(self) -> int | None:
        """The epoch already requested in the background, if any."""
        return None if self._next is None else self._next.epoch

    def _open(self, epoch: int) -> _OpenEpoch:
        if self._announce is not None:
            self._announce(epoch)
        stats = EpochStats()
        return _OpenEpoch(epoch, stats, iter_records(self._data, stats, log=self._log, epoch=epoch))

    def _start(self, epoch: int) -> None:
        opened = self._open(epoch)

        def pull() -> None:  # asks Ray Data for the epoch and waits for its first record
            try:
                opened.first.extend(itertools.islice(opened.records, 1))
            except BaseException as e:  # noqa: BLE001 - re-raised by resume() in the loop's thread
                opened.error = e

        opened.thread = threading.Thread(target=pull, name=f"raymcn-epoch{epoch}-request", daemon=True)
        opened.thread.start()
        self._next = opened
