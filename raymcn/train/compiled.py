"""``torch.compile`` for a run (``scale.compile``): what is compiled, how often it may compile again,
and what compiling cost. No Ray.

What is compiled is the module the step calls, ``run.model``: under DDP the DDP wrapper itself,
so that Dynamo splits the graph at DDP's gradient buckets and the all-reduce still overlaps the
backward (DDP's own support for ``torch.compile``). The objective stays eager: its all-gathers,
the ring's transfers and k-means's data-dependent loop would each end a graph, for about 4 % of
the step's FLOPs. Checkpoints stay keyed as the bare model: they are written from ``run.net``,
never from the compiled wrapper (whose names gain ``_orig_mod.``).

A compiled code path compiles again when what it was compiled for changes: the active modalities
at a stage switch, a rank's share of ⌊B/N⌋ or ⌈B/N⌉ videos (after the second shape Dynamo
compiles one graph for any size), a resized elastic group, gradient caching's pass without
autograd. :data:`RECOMPILE_LIMIT` bounds it per code path, after which that path runs eager, as
Dynamo does. :class:`CompileClock` counts the graphs and the seconds, for the epoch metrics.

Compiled kernels are kept in Inductor's cache on the node's disk (``TORCHINDUCTOR_CACHE_DIR``,
default ``/tmp/torchinductor_<user>``), which every process of the node shares: a sweep's later
trials find them there and compile in a fraction of the first trial's time
(``python -m bench.compile_cache`` measures it).
"""

from __future__ import annotations

from torch import nn

# Compilations of one code path before Dynamo runs it eagerly. The run's own reasons above add
# at most 2 (stage switch) x 2 (share sizes) x 2 (with and without autograd); a resized group's
# shares fall under the dynamic graph already compiled.
RECOMPILE_LIMIT = 8


def compile_model(model: nn.Module) -> nn.Module:
    """``model`` compiled (its forward and backward; a DDP wrapper with its buckets' graph breaks).
    Its parameters are ``model``'s own: an optimizer may be built on either."""
    import torch._dynamo  # here: importing Dynamo costs a second, which a run without compiling never pays

    config = torch._dynamo.config
    # named cache_size_limit before torch 2.6 (the pyproject allows 2.3)
    setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit", RECOMPILE_LIMIT)
    return torch.compile(model)


class CompileClock:
    """What ``torch.compile`` has done in this process since the clock was made (or last read with
    :meth:`lap`): graphs compiled and seconds spent compiling them (Dynamo's trace, AOT autograd's
    forward and backward graphs, Inductor's code generation), as Dynamo counts them. Zero where
    nothing is compiled."""

    def __init__(self):
        self.graphs, self.seconds = _totals()
        self.start = (self.graphs, self.seconds)

    def lap(self) -> dict[str, float]:
        """Since the last lap: ``compiled_graphs`` and ``time_compile_s``."""
        graphs, seconds = _totals()
        out = {"compiled_graphs": float(graphs - self.graphs), "time_compile_s": seconds - self.seconds}
        self.graphs, self.seconds = graphs, seconds
        return out

    def total(self) -> dict[str, float]:
        """Since the clock was made: ``compiled_graphs`` and ``time_compile_s``."""
        graphs, seconds = _totals()
        return {"compiled_graphs": float(graphs - self.start[0]), "time_compile_s": seconds - self.start[1]}


def _totals() -> tuple[int, float]:
    """(graphs compiled, seconds compiling) in this process so far, from Dynamo's own counters
    (``torch._dynamo.utils``; (0, 0.0) where this torch does not keep them)."""
    import sys

    if "torch._dynamo" not in sys.modules:  # nothing compiled yet: importing Dynamo costs seconds
        return 0, 0.0
    from torch._dynamo import utils

    graphs = int(utils.counters["stats"].get("unique_graphs", 0))
    spent = getattr(utils, "calculate_time_spent", None)
    seconds = float(spent().get("total_wall_time", 0.0)) if spent is not None else 0.0
    return graphs, seconds

