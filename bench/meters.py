"""Meters: what torch's allocator did during a piece of code, from its profiler's records.

The measurements the memory estimate (``raymcn/train/preflight/footprint.py``) is checked against,
in ``bench/step.py``, ``bench/memory.py`` and the tests: the peak of live bytes, the temporaries of each call of an op
(conv calls, Adam's step, the k-means refit), the bytes autograd saves, and a least-squares line.
Torch only (imported when a meter runs), no Ray.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from typing import Any


def peak_allocated_bytes(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """Run ``fn()`` under torch's memory profiler; returns (result, peak, end) in bytes.

    Every CPU allocation and free of torch's allocator during ``fn`` is recorded
    (``torch.profiler`` with ``profile_memory=True``); replaying them in time order gives the live
    bytes above what existed when ``fn`` started, so ``peak`` is the high-water mark of *new*
    allocations and ``end`` what is still held when it returns (the result included). A measured
    figure: temporaries inside kernels count, fragmentation and non-torch memory do not. The
    profiler does not see frees of blocks allocated before it started, so ``fn`` should not free
    large pre-existing tensors (``bench/step.py`` profiles from before the first tensor instead).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    timeline = memory_timeline(prof)
    live = peak = 0
    for _, nbytes in timeline:
        live += nbytes
        peak = max(peak, live)
    return result, peak, live


def start_ns(event) -> int:
    """A profiler (Kineto) event's start in ns; torch before 2.4 has only ``start_us``."""
    return event.start_ns() if hasattr(event, "start_ns") else event.start_us() * 1000


def end_ns(event) -> int:
    """A profiler (Kineto) event's end in ns (:func:`start_ns`)."""
    return event.end_ns() if hasattr(event, "end_ns") else start_ns(event) + event.duration_us() * 1000


def memory_timeline(prof) -> list[tuple[int, int]]:
    """(time ns, +/- bytes) of every CPU allocation and free a ``torch.profiler`` run recorded, in order."""
    events = (e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type().name == "CPU")
    # by time only: events of one instant keep the profiler's order (an allocation before its free)
    return sorted(((start_ns(e), e.nbytes()) for e in events), key=lambda row: row[0])


CONV_OPS = ("aten::convolution", "aten::convolution_backward")


def op_transient_bytes(prof, names: tuple[str, ...] = CONV_OPS) -> list[tuple[str, int]]:
    """For every call of an op in ``names`` a profiler run recorded: (name, bytes it allocated and
    freed again before returning), i.e. the peak of live bytes inside the call minus the larger of
    the live bytes before and after it (what it keeps, its outputs, is not a temporary)."""
    timeline = memory_timeline(prof)
    times = [t for t, _ in timeline]
    calls = sorted((start_ns(e), end_ns(e), e.name()) for e in prof.profiler.kineto_results.events()
                   if e.name() in names)
    out = []
    live_at = list(itertools.accumulate(n for _, n in timeline))
    for start, end, name in calls:
        i, j = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        before = live_at[i - 1] if i else 0
        inside = max(live_at[i:j], default=before)
        after = live_at[j - 1] if j else 0
        out.append((name, max(0, inside - max(before, after))))
    return out


def saved_tensor_bytes(fn: Callable[[], Any], exclude: tuple = ()) -> tuple[Any, int]:
    """Run ``fn()`` (a forward) and return (result, bytes of the distinct storages autograd saved).

    Storages of the tensors in ``exclude`` (parameters, batch inputs) are not counted. The saved
    tensors stay alive as long as ``result`` does.
    """
    import torch

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        # Detached (same storage): returning an op's own output as is would tie it to its grad_fn
        # in a reference cycle that outlives the graph.
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(seen.values())


def fitted_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares ``y ≈ intercept + slope·x``; returns (intercept, slope, R²)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return intercept, slope, 1.0 - ss_res / ss_tot if ss_tot else 1.0
