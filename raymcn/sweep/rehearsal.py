"""A shipped config in miniature: the one place that says what a rehearsal may change.

The suite rehearses every file under ``sweeps/`` through :func:`shrink` (tests/test_rehearsals.py)
and ``raymcn doctor --rehearse`` runs the lab's sweep file through it on their cluster, so a
file that would crash on the lab's servers crashes in minutes on CPU first. A rehearsal changes
sizes only; what the lab chose stays:

Changed (and nothing else):
  * inputs: the synthetic corpus (``data.shards``, ``data.eval_set``, ``data.word_vectors``),
    generated once into the cache (:data:`CORPUS`), except those the command line names itself
    (``--set data.shards=...``: ``inputs``), which are kept: a practice run on one's own small shards;
  * the sizes of a step: model widths, videos per step, clips per video, audio frames, clusters,
    queue length, k-means iterations and refresh period, steps per epoch. A swept size keeps its
    domain and its number of values, each value mapped to a rung of a small ladder by rank
    (:data:`LADDERS`);
  * the length: ``schedule.epochs`` to the fewest that keep ``schedule.stage1_fraction`` and let
    the sweep's clock reach its first rung and the next (:func:`rehearsal_epochs`); the LR warm-up
    to one step; a checkpoint interval to one step (so mid-epoch checkpoints are still taken);
  * counts: search trials (``sweep.num_samples``) to the fewest that exercise every phase
    (:func:`rehearsal_samples`; a grid keeps every value of the question's axis, the
    confirmation's ``per`` key or its first axis, and the first value of the others), seeds per
    configuration and confirmation seeds to 2;
  * devices: CPU workers (``scale.use_gpu: false``), one worker per trial, each reserving an equal
    share of half the given CPUs so that ``sweep.max_concurrent`` trials fit.
Kept: the search algorithm and its suggestions, the metric it optimizes (``sweep.metric``), the
scheduler's ``grace_epochs`` and ``reduction_factor``, ``stage1_fraction``, the stage order(s),
every swept key with its domain (a grid's axes but one cut to their first value: counts, above),
learning rates, the confirmation's ``per`` and ``top``, ``max_concurrent``, failures allowed, the
storage path and run name.
"""

from __future__ import annotations

import math
from typing import Any

from raymcn.config import Config, parse_interval

# Fixed miniature values of the sizes no sweep file sweeps.
FIXED: dict[str, Any] = {
    "model.audio_channels": [8, 8, 16, 16, 32], "model.audio_blocks": 1,
    "model.recon_hidden": 32, "loss.queue_steps": 2, "loss.refresh_every": 2, "loss.kmeans_iters": 5,
    "schedule.steps_per_epoch": 2, "data.eval_audio_frames": 0,
    "optim.warmup_steps": 0, "optim.warmup_videos": 4,  # one step at every batch size of the ladder
    "data.shards": "", "data.eval_set": "synthetic", "data.word_vectors": "",
}
# The synthetic corpus of every rehearsal (and of the suite's tiny runs): generated once per cache.
CORPUS: dict[str, Any] = {"data.synthetic_videos": 64, "data.synthetic_eval_clips": 64}
INPUTS = ("data.shards", "data.eval_set", "data.word_vectors")  # a rehearsal's inputs, unless given (shrink)
# Sizes a sweep file may sweep: a swept value takes the rung of its rank among the file's values;
# an unswept one the rung marked as the default. Every combination stays a valid config: the
# most clusters (16) fit the fewest clips per step (4 videos x 4 clips).
LADDERS: dict[str, tuple[list[int], int]] = {  # key -> (rungs, index of the unswept value)
    "data.batch_size": ([4, 8, 12, 16], 1),
    "data.clips_per_video": ([4, 6, 8, 10], 0),
    "data.audio_frames": ([64, 96, 128, 160], 0),
    "loss.num_clusters": ([4, 8, 12, 16], 1),
    "model.embed_dim": ([32, 48, 64, 96], 0),
}


def rehearsal_epochs(cfg: Config) -> int:
    """The fewest epochs (at most the file's) whose clock, the epochs after stage 1 at the file's
    ``stage1_fraction``, reaches ``grace_epochs x reduction_factor`` for an early-stopping sweep
    (a first rung that can stop or pause a trial, and one after it that a promoted trial reaches),
    or 1 for any other: stage 1 and stage 2 both run."""
    sw, fraction = cfg.sweep, cfg.schedule.stage1_fraction
    need = sw.grace_epochs * sw.reduction_factor if sw.algorithm in ("asha", "bohb") else 1
    epochs = next(e for e in range(1, 10_000) if e - math.ceil(fraction * e) >= need)
    return min(epochs, cfg.schedule.epochs)


def rehearsal_samples(cfg: Config, epochs: int) -> int:
    """Configurations the rehearsal's search draws (at most the file's): every phase exercised,
    ``max_concurrent`` trials side by side.

    * grid: 1 (a grid's samples repeat the whole grid);
    * bohb: one HyperBand band plus one trial. BOHB fills its most aggressive bracket first, so a
      trial is paused at the first rung and one of that bracket promoted past it; the extra
      trial opens the next band alone, is paused at its first rung, and with nothing left to
      run HyperBand promotes it: a paused trial always resumes from its checkpoint;
    * others: 4 (ASHA compares trials at its first rung), or ``max_concurrent`` when larger.
    """
    sw = cfg.sweep
    if sw.algorithm == "grid":
        return 1
    if sw.algorithm == "bohb":
        return min(sw.num_samples, hyperband_band(cfg.replace({"schedule.epochs": epochs})) + 1)
    return min(sw.num_samples, max(4, sw.max_concurrent))


def hyperband_band(cfg: Config) -> int:
    """Trials in one band of the sweep's HyperBand (``tuner.first_rung_hyperband`` over
    ``budget_epochs``): its brackets s = 0 .. s_max - 1 hold ⌈s_max / (s + 1) · η^s⌉ trials each
    (Ray's HyperBand)."""
    eta, max_t = cfg.sweep.reduction_factor, cfg.budget_epochs
    brackets = int(round(math.log(max_t) / math.log(eta))) + 1
    kept = max(1, sum(1 for s in range(brackets) if int(max_t * eta ** -s) >= min(cfg.sweep.grace_epochs, max_t)))
    return sum(math.ceil(kept / (s + 1) * eta ** s) for s in range(kept))


def shrink(cfg: Config, cpus: float = 2.0, inputs: dict[str, Any] | None = None) -> Config:
    """``cfg`` in miniature (module doc): runs on ``cpus`` CPUs in minutes; ``inputs`` (keys of
    :data:`INPUTS` the command line set) are kept instead of the synthetic corpus's. Raises
    ConfigError when the miniature is not a valid config (it then names the setting)."""
    sw, epochs = cfg.sweep, rehearsal_epochs(cfg)
    given = {k: v for k, v in (inputs or {}).items() if k in INPUTS}
    out: dict[str, Any] = {**FIXED, **CORPUS, **given}
    out.update({key: rungs[default] for key, (rungs, default) in LADDERS.items()})
    space = {key: _shrunk_domain(key, spec) for key, spec in sw.space.items()}
    if sw.algorithm == "grid":  # its trials are the product of its axes: the question's axis whole
        question = sw.confirm.get("per") or next(iter(space), None)
        space = {key: spec if key == question else {d: v[:1] for d, v in spec.items()} for key, spec in space.items()}
    workers = 1
    trials_at_once = max(1, sw.max_concurrent) if sw.space else 1
    out.update({
        "schedule.epochs": epochs, "sweep.num_samples": rehearsal_samples(cfg, epochs),
        "sweep.repeats": min(sw.repeats, 2), "sweep.space": space,
        "sweep.confirm": {**sw.confirm, "repeats": 2} if sw.confirm else {},
        "scale.use_gpu": False, "scale.num_workers": workers, "scale.threads_per_worker": 1,
        "scale.cpus_per_worker": min(cfg.scale.cpus_per_worker, 0.5 * cpus / (trials_at_once * workers)),
        "scale.grad_cache_clips": 0, "run.checkpoint_every": _checkpoint_every(cfg.run.checkpoint_every),
    })
    return cfg.replace(out)


def _checkpoint_every(interval: str) -> str:
    """Any interval (a duration or a step count) becomes one step of the two an epoch has: a
    mid-epoch checkpoint is taken in every epoch; none stays none."""
    return "1" if parse_interval(interval) else "0"


def _shrunk_domain(key: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A swept key's domain in miniature: a size's values mapped to its ladder by rank (the domain
    and the number of values kept); any other key unchanged."""
    if key not in LADDERS:
        return spec
    domain, values = next(iter(spec.items()))
    rungs = LADDERS[key][0]
    ranks = {v: i for i, v in enumerate(sorted(set(values)))}
    if len(ranks) > len(rungs):
        raise ValueError(f"sweep.space.{key}: {len(ranks)} values; a rehearsal maps at most {len(rungs)}")
    shrunk = [rungs[ranks[v]] for v in values]
    if domain in ("randint", "uniform", "loguniform"):  # a range keeps its ends' order
        shrunk = [rungs[0], rungs[-1]]
    return {domain: shrunk}
