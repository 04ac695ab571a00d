"""A raymcn sweep whose trials stand in for Train runs: raymcn's own ``run_sweep`` and
``resume_sweep`` (``sweep/tuner.py``: its search, its Tune state, its restore), with each trial a
function that reports one result per epoch and checkpoints every epoch, as a raymcn trial does.

What a search algorithm keeps across a killed driver is the searcher's and Tune's state, not the
training: this keeps the state and drops the training's fixed cost (a Ray Train run per trial).
Run as a process of its own, so that a test can kill it with its Ray (a reboot of the head)::

    python tests/stand_in_sweep.py run EXP_DIR KEY=VALUE ...   # raymcn sweep --config ... --set ...
    python tests/stand_in_sweep.py resume EXP_DIR              # raymcn sweep --resume EXP_DIR

Each trial appends ``{"start": epoch}`` and ``{"epoch": e}`` rows to ``EXP_DIR/stand_in/<trial>.jsonl``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import types
from pathlib import Path

EPOCH_S = 1.5  # a stand-in epoch's time: room for the kill to land after Tune saved a finished trial


def stand_in_trial(config: dict, experiment_dir: str) -> None:
    """Epochs 1..``schedule.epochs`` of one configuration; a restart continues after its checkpoint.
    Scores: a larger learning rate scores higher at every epoch (the searchers' choices are set)."""
    from ray import tune

    from raymcn.config import DEFAULT_OBJECTIVE, objective

    metric = objective(DEFAULT_OBJECTIVE).reported
    trial = tune.get_context().get_trial_id()
    log = Path(experiment_dir) / "stand_in" / f"{trial}.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    ckpt, epoch = tune.get_checkpoint(), 0
    if ckpt is not None:
        with ckpt.as_directory() as d:
            epoch = json.loads(Path(d, "epoch.json").read_text())["epoch"]
    with log.open("a") as f:
        f.write(json.dumps({"start": epoch}) + "\n")
    while epoch < int(config["schedule.epochs"]):
        time.sleep(EPOCH_S)
        epoch += 1
        with log.open("a") as f:
            f.write(json.dumps({"epoch": epoch}) + "\n")
        with tempfile.TemporaryDirectory() as d:
            Path(d, "epoch.json").write_text(json.dumps({"epoch": epoch}))
            tune.report({"epoch": epoch, "budget_epoch": epoch, metric: float(config["optim.lr"]) * 1000 + epoch},
                        checkpoint=tune.Checkpoint.from_directory(d))


def trainable(cfg, experiment_dir: str, inputs, env=None):
    """``tuner._trainable``'s stand-in, taking what it takes (``inputs``, ``env``: read by no stand-in
    trial): a trial is :func:`stand_in_trial` with every trial's ``schedule.epochs``."""
    from ray import tune

    epochs = {"schedule.epochs": cfg.schedule.epochs}  # every trial's, beside what the search chose
    fn = tune.with_parameters(lambda config, experiment_dir: stand_in_trial({**epochs, **config}, experiment_dir),
                              experiment_dir=experiment_dir)
    return tune.with_resources(fn, {"cpu": 0.25})


def main(argv: list[str]) -> int:
    import ray

    from raymcn.cli import preset_path
    from raymcn.config import load_config
    from raymcn.sweep import tuner

    tuner._trainable = trainable  # the one seam: a trial is this function, not a Ray Train run
    command, experiment_dir, *overrides = argv
    no_corpus = types.SimpleNamespace()  # the stand-ins read nothing: no corpus is resolved
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        if command == "run":
            tuner.run_sweep(load_config(preset_path(), overrides), experiment_dir, inputs=no_corpus)
        else:
            tuner.resume_sweep(experiment_dir, inputs=no_corpus)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
