"""A sweep whose storage cannot take what it writes stops at once, resumable.

A trial whose Train run ended on a storage error (``config.StorageError``: full, over quota,
read-only) raises it from ``tuner.trial_fn`` instead of ending as an errored trial: every other
trial would fail the same way. This callback, on the sweep's driver, reads the trial's error
(Tune's pickled copy, in the driver's own folder for the trial) and stops the sweep as Ctrl-C
does: Tune's loop ends before it starts another trial, the running trials stop, and Tune saves its
state with every unfinished trial (the failed one among them) unfinished. ``raymcn sweep --resume``
then continues them from their checkpoints once there is room. The console says why.
"""

from __future__ import annotations

import os
import pickle
import signal
from pathlib import Path

from ray import cloudpickle, tune

from raymcn.config import storage_cause
from raymcn.sweep.names import trial_dirname
from raymcn.sweep.search_space import plain


class StorageFull(RuntimeError):
    """Raised where Tune's own stop (its SIGUSR1 handler) is not installed: Tune's loop ends on it,
    its state as last saved."""


class StopWhenStorageFull(tune.Callback):
    """Stops the sweep at the first trial that failed on a storage error (module doc).

    Args:
        experiment_dir: the sweep's (or confirmation's) folder, for the resume line.
        say: (line, err) -> None: the console's ``say``; None: print to stderr.
    """

    def __init__(self, experiment_dir: str, say=None):
        self.experiment_dir, self.say = experiment_dir, say
        self.reason = ""  # the first storage error, once the sweep was stopped for it

    def on_trial_recover(self, iteration: int, trials: list, trial, **info) -> None:
        self._stop_if_storage(trial)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        self._stop_if_storage(trial)

    def _stop_if_storage(self, trial) -> None:
        if self.reason:
            return
        cause = storage_cause(trial_error(trial))
        if cause is None:
            return
        self.reason = str(cause)
        line = (f"sweep stopped: trial {trial_dirname(plain(trial.config), trial.trial_id)} could not write to the "
                f"storage: {cause}\nno new trial starts; the running ones stop and resume from their checkpoints with: "
                f"raymcn sweep --resume {self.experiment_dir}")
        if self.say is not None:
            self.say(line, err=True)
        else:
            print(line, flush=True)
        interrupt_tune(self.reason)

    def __getstate__(self) -> dict:
        # Tune pickles its RunConfig into the experiment; a restored sweep attaches a new one
        return {**self.__dict__, "say": None, "reason": ""}


def trial_error(trial) -> BaseException | None:
    """The exception that failed ``trial`` last, as Tune pickled it in the driver's folder for the
    trial (Ray's task error, whose ``cause`` is the trial function's); None when there is none."""
    path = getattr(trial, "pickled_error_file", None)
    if not path or not Path(path).is_file():
        return None
    try:
        with open(path, "rb") as f:
            return cloudpickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, TypeError, ValueError):
        return None  # an error that cannot be read back here is no storage error this driver knows of


def interrupt_tune(reason: str) -> None:
    """End Tune's loop as Ctrl-C does: Tune's own SIGUSR1 handler (installed while its loop runs in
    the main thread) ends it after this step and saves the experiment's state; elsewhere raise."""
    if callable(signal.getsignal(signal.SIGUSR1)):
        os.kill(os.getpid(), signal.SIGUSR1)
    else:
        raise StorageFull(reason)
