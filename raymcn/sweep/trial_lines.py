"""The sweep's lines for a person: a Tune callback on the driver (see ``train/monitor/console.py``).

Per trial one start line with its swept keys; per trial-epoch one line (epoch, the value of
``sweep.metric``'s metric, loss, samples/s) made from the result Tune received, i.e. rank 0's
report, printed once per (trial, epoch) even when a restored trial reports an epoch again; an
error line when a trial fails, with where its error is written; and at most every
``sweep.status_every`` seconds a status table (a few columns, a row per running trial and per
trial finished since the last table, printed only when something changed). Tune's own reporter
and everything Ray prints go to the console log instead.
"""

from __future__ import annotations

import time
from typing import Any

from ray import tune

from raymcn import storage
from raymcn.config import TRIAL_ERRORS_DIR, Config, Metric, objective
from raymcn.sweep.names import trial_dirname
from raymcn.sweep.search_space import plain
from raymcn.train.monitor.console import Console, epoch_line

_SHORT_STATUS = {"TERMINATED": "done", "RUNNING": "running", "PAUSED": "paused", "PENDING": "pending",
                 "ERROR": "error"}


def _short(status: str) -> str:
    return _SHORT_STATUS.get(status, status.lower())


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


class SweepProgress(tune.Callback):
    """Prints the sweep's progress through ``console`` (module doc).

    Args:
        cfg: the sweep's base config (epochs and workers of trials that do not sweep them).
        experiment_dir: where ``trial_fn`` writes the permanent errors that end a trial.
        status_every: seconds between status tables; 0: none.
    """

    def __init__(self, console: Console, cfg: Config, experiment_dir: str, status_every: float):
        self.console, self.cfg, self.experiment_dir = console, cfg, experiment_dir
        self.status_every = status_every
        self._started: set[str] = set()
        self._epochs_shown: set[tuple[str, int]] = set()
        self._last: dict[str, dict[str, Any]] = {}
        self._start_time: dict[str, float] = {}
        self._finished_shown: set[str] = set()
        self._shown_state: tuple = ()
        self._columns_shown = False  # the column names head the first table only: no line twice
        self._t0 = self._last_status = time.monotonic()

    @property
    def metric(self) -> Metric:
        """What the lines show (``sweep.metric``'s metric), in its direction and format."""
        return objective(self.cfg.sweep.metric).metric

    # --- per trial ----------------------------------------------------------------------------------
    def _name(self, trial) -> str:
        return trial_dirname(plain(trial.config), trial.trial_id)

    def _setting(self, trial, key: str) -> Any:
        section, name = key.split(".")
        return trial.config.get(key, getattr(getattr(self.cfg, section), name))

    def on_trial_start(self, iteration: int, trials: list, trial, **info) -> None:
        again = trial.trial_id in self._started
        self._started.add(trial.trial_id)
        self._start_time.setdefault(trial.trial_id, time.monotonic())
        keys = ", ".join(f"{k}={v}" for k, v in sorted(plain(trial.config).items()))
        self._say(f"trial {self._name(trial)} {'resumed' if again else 'started'}: {keys or 'base config'}")

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info) -> None:
        if "epoch" not in result:
            return
        epoch = int(result["epoch"])
        value, before = result.get(self.metric.name), self._last.get(trial.trial_id, {}).get("best")
        self._last[trial.trial_id] = {"epoch": epoch, "value": value, "best": self._better(value, before)}
        if (trial.trial_id, epoch) in self._epochs_shown:  # a restored trial reports its last epoch again
            return
        self._epochs_shown.add((trial.trial_id, epoch))
        self._say(epoch_line(epoch, int(self._setting(trial, "schedule.epochs")), result, self.metric,
                             name=self._name(trial), workers=_fixed_workers(self._setting(trial, "scale.num_workers"))))

    def _better(self, a: float | None, b: float | None) -> float | None:
        """The better of two values of the metric by its direction (None: no value)."""
        if a is None or b is None:
            return b if a is None else a
        return a if self.metric.sign * a >= self.metric.sign * b else b

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        # trial_fn ends a trial hit by a permanent error normally (no retry): say so here.
        path = storage.join(self.experiment_dir, TRIAL_ERRORS_DIR, f"{trial.trial_id}.txt")
        try:
            error = storage.read_text(path).strip()
        except (FileNotFoundError, OSError):
            return
        self._say(f"trial {self._name(trial)} ERROR (not retried): {error} [{path}]", err=True)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        where = getattr(trial, "error_file", None) or getattr(trial, "path", "") or ""
        message = str(getattr(trial, "error_msg", "") or "").strip().splitlines()
        self._say(f"trial {self._name(trial)} ERROR: {message[-1] if message else 'failed'}"
                  f"{f' (traceback in {where})' if where else ''}", err=True)

    # --- the status table -----------------------------------------------------------------------------
    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        now = time.monotonic()
        if self.status_every <= 0 or now - self._last_status < self.status_every:
            return
        self._last_status = now
        for line in self.status_table(trials, now - self._t0):
            self._say(line)

    def status_table(self, trials: list, elapsed: float) -> list[str]:
        """The status since the last table, or nothing when nothing changed: a header with the
        elapsed time, the counts per status and the best value of the metric so far (R@10 by
        default; the lowest for a rank); then a row (trial, status, epoch, its value, its best,
        time since it started) for every running or paused trial and for every trial that
        finished since the last table, under the column names in the first table only. A finished
        trial is listed once and pending ones are only counted, so no line repeats itself from
        table to table."""
        now = time.monotonic()
        state = tuple((t.trial_id, t.status, self._last.get(t.trial_id, {}).get("epoch", 0)) for t in trials)
        if state == self._shown_state:
            return []
        self._shown_state = state
        counts: dict[str, int] = {}
        for t in trials:
            counts[_short(t.status)] = counts.get(_short(t.status), 0) + 1
        m = self.metric
        best = max(((v["best"], tid) for tid, v in self._last.items() if v["best"] is not None),
                   key=lambda pair: m.sign * pair[0], default=None)
        names = {t.trial_id: self._name(t) for t in trials}
        head = (f"status after {_clock(elapsed)}: " + ", ".join(f"{n} {s}" for s, n in counts.items())
                + (f"; best {m.short} {best[0]:{m.spec}} ({names.get(best[1], best[1])})" if best else ""))
        rows = []
        for t in trials:
            if t.trial_id not in self._started or t.trial_id in self._finished_shown:
                continue
            if t.status in ("TERMINATED", "ERROR"):
                self._finished_shown.add(t.trial_id)
            last = self._last.get(t.trial_id, {})
            value, top = last.get("value"), last.get("best")
            rows.append((names[t.trial_id], _short(t.status), str(last.get("epoch", 0)),
                         "-" if value is None else f"{value:{m.spec}}", "-" if top is None else f"{top:{m.spec}}",
                         _clock(now - self._start_time.get(t.trial_id, now))))
        if not rows:
            return [head]
        header = ("trial", "status", "epoch", m.short, "best", "for")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        fmt = "  " + "  ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths))
        columns = [] if self._columns_shown else [fmt.format(*header)]
        self._columns_shown = True
        return [head, *columns, *(fmt.format(*r) for r in rows)]

    def _say(self, line: str, err: bool = False) -> None:
        if self.console is not None:
            self.console.say(line, err=err)

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles its RunConfig (callbacks included) into the experiment; a console holds the
        # terminal's file descriptors and a lock. A restored sweep attaches a new one.
        return {**self.__dict__, "console": None}


def _fixed_workers(setting) -> int:
    """A trial's worker count when fixed; 0 for an elastic range (the epoch's ``workers`` metric says)."""
    return setting if isinstance(setting, int) else 0
