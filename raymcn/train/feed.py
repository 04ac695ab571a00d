"""Feed the device: the next batches are fetched (and on CUDA pinned and copied) while the step runs. No Ray.

Without it the training thread itself waits for each batch (the reader's iterator, the host
tensors, the copy to the GPU) between two steps, and the GPU idles meanwhile. :class:`Prefetcher`
moves that work to a thread that stays ``depth`` batches ahead of the step:

* it pulls the next batch from the source (on a Ray worker: the rank's Ray Data stream, whose
  rows are built by the read tasks; the wait for a row is the host work left on this process);
* on CUDA it first makes the rank's GPU its own current device (the current device is per
  thread, and a new thread starts on GPU 0: its first CUDA call, the pinning, would otherwise
  create a CUDA context on GPU 0, about 0.5 GiB there for every other rank, as PyTorch's own
  DataLoader pin thread avoids the same way), then pins the batch's tensors (page-locked host
  memory, so the copy can run asynchronously) and copies them to the device on a side stream,
  recording an event;
* the training thread takes a batch that is already where the model needs it: on CUDA its
  compute stream waits for the copy's event (a device-side wait, not a host one) and the
  tensors are marked as used on that stream, so the caching allocator does not reuse their
  memory while the step still reads it.

At most ``depth`` batches exist beyond the one the step uses (a slot is taken before a batch is
fetched and given back when the step takes it), so the device holds ``depth`` extra batches
(``footprint.py`` counts them). ``depth=0`` fetches in the training thread (nothing overlaps).

The data counters (``EpochStats`` of the reader) grow as batches are fetched, i.e. ahead of the
step; :attr:`Prefetcher.stats` reports them as they stood when the batch last handed to the step
was fetched, so a mid-epoch checkpoint counts exactly the steps it holds.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from raymcn.data.formats.batch import Batch

_END = object()


class _Finished:
    """The source is exhausted; its counters as they ended."""

    def __init__(self, counters: dict[str, float] | None):
        self.counters = counters


def to_device(batch: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
    """Every tensor of ``batch`` on ``device`` (other entries, e.g. ``key``, unchanged)."""
    return {k: (v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v)
            for k, v in batch.items()}


def pinned(batch: Batch) -> Batch:
    """The tensors of ``batch`` in page-locked host memory (a copy; the reader's buffers are read-only)."""
    return {k: (v.pin_memory() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


class _Snapshot:
    """The data counters as they stood when a given batch was fetched (``as_metrics()`` like the reader's)."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    def as_metrics(self) -> dict[str, float]:
        return dict(self.metrics)


class Prefetcher:
    """The batches of ``source`` on ``device``, fetched ``depth`` ahead in a background thread.

    Args:
        source: batches of torch tensors (the batch contract: video (b, 4096), audio (b, 40, T),
            nframes (b,), text (b, W, 300), plus ``key``), on the host.
        device: where the step computes.
        depth: batches fetched ahead of the step (0: fetched in the caller's thread when asked for).
        stats: the source's data counters (an object with ``as_metrics()``), or None.

    Iterate it once; an error of the source is raised in the iterating thread, at the batch where
    it happened. :meth:`close` (also at the end of iteration) stops the thread.
    """

    def __init__(self, source: Iterable[Batch], device: torch.device | str, depth: int = 1, stats: Any = None):
        self.device, self.depth = torch.device(device), int(depth)
        self._source, self._stats = source, stats
        self.stats = _Snapshot() if stats is not None else None
        self._cuda = self.device.type == "cuda"
        if self._cuda and self.device.index is None:  # "cuda": the constructing thread's device, by index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda and self.depth > 0 else None
        self._ready: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(max(1, self.depth))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __iter__(self) -> Iterator[Batch]:
        if self.depth == 0:
            yield from self._inline()
            return
        self._thread = threading.Thread(target=self._fetch, name="raymcn-prefetch", daemon=True)
        self._thread.start()
        try:
            while True:
                item = self._ready.get()
                self._slots.release()  # the step holds this batch now: the thread may fetch one more
                if isinstance(item, _Finished):
                    self._publish(item.counters)
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, event, counters = item
                if event is not None:
                    compute = torch.cuda.current_stream(self.device)
                    compute.wait_event(event)  # the device waits for the copy, the host does not
                    for v in batch.values():
                        if isinstance(v, torch.Tensor):
                            v.record_stream(compute)
                self._publish(counters)
                yield batch
        finally:
            self.close()

    def _inline(self) -> Iterator[Batch]:
        for batch in self._source:
            self._publish(self._counters())
            yield to_device(batch, self.device)
        self._publish(self._counters())

    def _counters(self) -> dict[str, float] | None:
        return self._stats.as_metrics() if self._stats is not None else None

    def _publish(self, counters: dict[str, float] | None) -> None:
        if self.stats is not None and counters is not None:
            self.stats.metrics = counters

    def _fetch(self) -> None:
        """The thread: take a slot, fetch a batch, move it, queue it; the end or the error last.
        On CUDA its first CUDA call makes the rank's device its own (see the module doc)."""
        try:
            if self._cuda:
                torch.cuda.set_device(self.device)
            it = iter(self._source)
            while True:
                self._slots.acquire()
                if self._stop.is_set():
                    return
                batch = next(it, _END)
                if batch is _END:
                    self._ready.put(_Finished(self._counters()))
                    return
                event = None
                if self._copy_stream is not None:
                    with torch.cuda.stream(self._copy_stream):
                        batch = to_device(pinned(batch), self.device, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(self._copy_stream)
                else:
                    batch = to_device(batch, self.device)
                self._ready.put((batch, event, self._counters()))
        except BaseException as e:  # noqa: BLE001 - handed to the training thread, raised there
            self._ready.put(e)
        finally:
            close = getattr(self._source, "close", None)
            if close is not None and self._stop.is_set():
                close()  # the step stopped early: let the source release its resources (in its own thread)

    def close(self) -> None:
        """Stop fetching (the thread ends once its current fetch returns)."""
        self._stop.set()
        self._slots.release()  # a thread waiting for a slot sees the stop
