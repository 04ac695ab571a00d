"""``raymcn shards --ray``: the shards written by Ray actors on every node of a cluster.

The lab has two servers of 32-64 threads: one process per CPU of the whole cluster, each an actor
that writes one shard after another with ``writer.write_shard``, the same function as the local
``--workers`` processes: same plan, same bytes, same done markers, same manifest, and a rerun
resumes the same way. An actor is given the writer state (the output folder and the caption
store, which it memory-maps: never the caption table) and, with each job, only that shard's
videos. Inputs and ``--out`` must be at the same path on every node (shared storage, as for
training); a shard that an actor wrote where the driver cannot see it is an error naming the node.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import ray
from ray.util import ActorPool

from raymcn.data.formats.manifest import ShardError
from raymcn.data.write.writer import ShardJob, WriterState, init_writer, write_shard


@ray.remote(num_cpus=1)
class ShardWriter:
    """One writer process on some node: the writer state once, then shard after shard."""

    def __init__(self, state: WriterState):
        init_writer(state)

    def write(self, job: ShardJob) -> tuple[dict, str]:
        return write_shard(job), socket.gethostname()


class RayWriters:
    """``convert``'s ``writers``: ``actors`` writers (default: one per CPU of the cluster Ray is
    connected to), spread over its nodes."""

    def __init__(self, actors: int = 0):
        self.actors = actors
        self.description = f"{actors} Ray actor(s)" if actors else "one Ray actor per CPU of the cluster"

    def __call__(self, state: WriterState, jobs: list[ShardJob], on_done: Callable[[dict], None]) -> None:
        count = min(len(jobs), self.actors or max(1, int(ray.cluster_resources().get("CPU", 1))))
        writers = [ShardWriter.options(scheduling_strategy="SPREAD").remote(state) for _ in range(count)]
        try:
            for marker, host in ActorPool(writers).map_unordered(lambda a, job: a.write.remote(job), jobs):
                if not (Path(state.out) / marker["name"]).is_file():
                    raise ShardError(
                        f"{marker['name']} was written on {host}, where {state.out} is not this machine's "
                        "folder: --out (and the inputs) must be shared storage at the same path on every node")
                on_done(marker)
        finally:
            for w in writers:
                ray.kill(w)
