"""The batch pipeline (train/feed.py): the next batches are fetched while the step runs, in order,
never more than ``depth`` ahead, errors raised where they happened, and the data counters as of the
batch the step holds (a mid-epoch checkpoint counts exactly its steps)."""

import threading

import pytest
import torch

from raymcn.train.feed import Prefetcher


class Source:
    """Batches 0..n-1 (``video`` holds the index); counts fetches, can fail at one index, and
    signals each fetch (``asked[i]`` is set when batch i is requested)."""

    def __init__(self, n: int, fail_at: int | None = None):
        self.n, self.fail_at = n, fail_at
        self.fetched, self.consumed, self.most_ahead = 0, 0, 0
        self.asked = [threading.Event() for _ in range(n + 1)]
        self.closed = threading.Event()

    def batches(self):
        try:
            for i in range(self.n):
                self.asked[i].set()
                if i == self.fail_at:
                    raise OSError(f"shard unreadable at batch {i}")
                self.fetched += 1
                self.most_ahead = max(self.most_ahead, self.fetched - self.consumed)
                yield {"video": torch.full((2, 3), float(i)), "key": [f"v{i}#0", f"v{i}#1"]}
            self.asked[self.n].set()
        finally:
            self.closed.set()

    def as_metrics(self):
        return {"videos_read": float(self.fetched)}


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_every_batch_arrives_once_in_order_and_never_more_than_depth_ahead(depth):
    src = Source(12)
    feed = Prefetcher(src.batches(), "cpu", depth=depth, stats=src)
    seen = []
    for batch in feed:
        src.consumed += 1
        seen.append(int(batch["video"][0, 0]))
        assert batch["key"][0] == f"v{seen[-1]}#0"
        # the counters are those of the batches handed to the step, not of those fetched ahead
        assert feed.stats.as_metrics()["videos_read"] == len(seen)
    assert seen == list(range(12))
    # fetched - consumed counts the batch being handed over too (the step counts it a moment later)
    assert src.most_ahead <= max(1, depth) + 1


def test_the_next_batch_is_fetched_while_the_step_runs():
    src = Source(4)
    for i, _ in enumerate(Prefetcher(src.batches(), "cpu", depth=1)):
        # the step holds batch i: batch i + 1 is requested without the step asking for it
        assert src.asked[i + 1].wait(timeout=30), f"batch {i + 1} was not fetched during step {i}"


def test_without_prefetch_nothing_is_fetched_ahead():
    src = Source(4)
    for i, _ in enumerate(Prefetcher(src.batches(), "cpu", depth=0)):
        assert not src.asked[i + 1].is_set()


def test_a_source_error_is_raised_in_the_step_after_the_batches_before_it():
    src = Source(6, fail_at=3)
    seen = []
    with pytest.raises(OSError, match="shard unreadable at batch 3"):
        for batch in Prefetcher(src.batches(), "cpu", depth=2):
            seen.append(int(batch["video"][0, 0]))
    assert seen == [0, 1, 2]


def test_a_step_that_stops_early_stops_the_thread_and_closes_the_source():
    src = Source(50)
    feed = Prefetcher(src.batches(), "cpu", depth=1)
    for i, _ in enumerate(feed):
        if i == 2:
            break
    assert src.closed.wait(timeout=30)
    assert feed._thread is not None
    feed._thread.join(timeout=30)
    assert not feed._thread.is_alive()
    assert src.fetched <= 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_batches_arrive_pinned_and_copied_on_the_device():
    src = Source(5)
    device = torch.device("cuda", torch.cuda.current_device())
    out = [b["video"] for b in Prefetcher(src.batches(), device, depth=2)]
    assert all(v.device == device for v in out)
    assert [int(v[0, 0].item()) for v in out] == list(range(5))
