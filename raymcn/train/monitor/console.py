"""What a person sees in the terminal during ``raymcn train`` and ``raymcn sweep``, and where the rest goes.

By default the terminal gets only raymcn's own lines: a start line per trial, one line per
(trial-)epoch, a compact status table, errors, and the final results. Everything else written to
the process's stdout and stderr, at the file-descriptor level (so also Ray's forwarded worker
output, its ``TrainingReport(...)`` dumps, deprecation warnings, dataset execution plans, actor
restart tracebacks, and C++ log lines), goes to a log file beside the run or sweep
(``config.CONSOLE_LOG_FILE``). Logging records at ERROR or above still reach the terminal: errors
are never hidden. ``verbose`` shows everything on the terminal as well (and still writes the log).

Worker processes cannot write to the terminal themselves: Ray forwards their output into the
driver's stdout. Rank 0 marks the lines meant for a person with :data:`TAG` (:func:`tagged`); the
driver's :class:`Console` strips Ray's ``(RayTrainWorker pid=...)`` prefix and the tag, drops a
line it has already shown, and shows it. A rank writes its lines with :func:`write_line`, once.
At the end of ``train`` and ``eval`` the final metrics are shown as :func:`final_summary` makes them.
Stdlib only: no Ray, no torch.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from raymcn.config import CONSOLE_LOG_FILE, Config, Metric, metric_names, reason

_LOGGERS = ("", "ray", "ray.data")  # the root logger and Ray's loggers that do not propagate to it
TAG = "[raymcn] "  # prefix of a worker line meant for the terminal; no Ray prefix contains it
# prefix of rank 0's in-epoch progress lines (train/monitor/in_epoch.py): shown in runs and in sweeps alike
PROGRESS_TAG = "[raymcn progress] "
# prefix of any rank's alerts (a stall named by its watchdog, train/monitor/watchdog.py): shown in runs and sweeps
ALERT_TAG = "[raymcn alert] "
# A warning or error in Ray's log format ("<time>\tWARNING file.py:123 -- message"), from any process
RAY_WARNING = re.compile(r"\b(WARNING|ERROR|CRITICAL) [\w.-]+\.py:\d+ -- (?P<message>.+)$")


def tagged(line: str) -> str:
    """``line`` marked for the terminal (printed by rank 0 of a run)."""
    return f"{TAG}{line}"


def write_line(text: str) -> None:
    """``text`` as one line on this process's stdout, which Ray forwards to the driver's console.
    Not ``print``: Ray Train replaces it in its workers by a function that prints the line and logs
    it too, and both copies reach the driver, so the console log held every line twice."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def epoch_line(epoch: int, epochs: int, metrics: Mapping[str, Any], shown: Metric, name: str = "",
               workers: int = 0) -> str:
    """The one line per (trial-)epoch: ``[name ]epoch 3/6  R@10 18.36  loss 31.95  412 samples/s``.

    ``shown``: the retrieval metric the line shows (``sweep.metric``'s), in its table format.
    ``samples/s`` is the run's throughput in clips per second: the per-worker mean the loop
    reports (``samples_per_s``) times the epoch's world size (the ``workers`` metric, which an
    elastic group may change; else the ``workers`` argument), else per worker.
    Missing metrics are left out, never shown as 0."""
    workers = int(metrics.get("workers") or workers)
    parts = [f"{name} " if name else "", f"epoch {epoch}/{epochs}"]
    if shown.name in metrics:
        parts.append(f"  {shown.short} {format(float(metrics[shown.name]), '5' + shown.spec)}")
    if "total_loss" in metrics:
        parts.append(f"  loss {float(metrics['total_loss']):.4g}")
    if "samples_per_s" in metrics:
        rate = float(metrics["samples_per_s"]) * (workers or 1)
        parts.append(f"  {rate:.0f} samples/s{'' if workers else ' per worker'}")
    return "".join(parts)


class Console:
    """Context manager that owns the terminal for the duration of a run or sweep (module doc).

    Args:
        log_path: file that receives everything written to fd 1 and 2 (appended, created with its
            folder); None: nothing is redirected (only :meth:`say` prints).
        verbose: also show everything on the terminal.
        show_tagged: show worker lines marked with :data:`TAG` (``raymcn train``; a sweep prints
            its epoch lines from Tune's results instead).
    """

    def __init__(self, log_path: str | os.PathLike | None, verbose: bool = False, show_tagged: bool = False):
        self.log_path = Path(log_path) if log_path else None
        self.verbose, self.show_tagged = verbose, show_tagged
        self._lock = threading.Lock()
        self._shown: set[str] = set()
        self._log: IO[str] | None = None
        self._tty_out = self._tty_err = None  # duplicates of the real fd 1 and 2 while redirected
        self._reader: threading.Thread | None = None
        self._handler: logging.Handler | None = None
        self._saved_fds: list[int] = []

    # --- the terminal ---------------------------------------------------------------------------
    def say(self, line: str = "", err: bool = False) -> None:
        """Write ``line`` to the terminal (and the log). Thread-safe; the way raymcn's own lines
        reach the terminal while the console is redirected."""
        text = line if line.endswith("\n") else line + "\n"
        with self._lock:
            self._write_log(text)
            self._write_tty(text, err)

    def _write_tty(self, text: str, err: bool = False) -> None:
        fd = (self._tty_err if err else self._tty_out)
        if fd is None:
            stream = sys.stderr if err else sys.stdout
            stream.write(text)
            stream.flush()
            return
        data = text.encode(errors="replace")
        while data:
            data = data[os.write(fd, data):]

    def _write_log(self, text: str) -> None:
        if self._log is not None:
            self._log.write(text)
            self._log.flush()

    # --- redirection ----------------------------------------------------------------------------
    def __enter__(self) -> Console:
        if self.log_path is None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a", encoding="utf-8", errors="replace")
        sys.stdout.flush()
        sys.stderr.flush()
        self._tty_out, self._tty_err = os.dup(1), os.dup(2)
        read_fd, write_fd = os.pipe()
        self._saved_fds = [self._tty_out, self._tty_err]
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._reader = threading.Thread(target=self._pump, args=(read_fd,), name="raymcn-console", daemon=True)
        self._reader.start()
        # Errors logged in this process still reach the terminal (Tune's "Trial task failed", ...).
        # Ray's loggers ("ray", "ray.data") do not propagate to the root logger: attached to each.
        self._handler = _TerminalErrors(self)
        for name in _LOGGERS:
            logging.getLogger(name).addHandler(self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._tty_out is None:
            return
        for name in _LOGGERS:
            logging.getLogger(name).removeHandler(self._handler)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._tty_out, 1)  # the pipe's last writers are gone once Ray's processes are
        os.dup2(self._tty_err, 2)
        if self._reader is not None:
            self._reader.join(timeout=5)  # the pump ends at EOF; a lingering child must not hang us
        with self._lock:
            for fd in self._saved_fds:
                os.close(fd)
            self._tty_out = self._tty_err = None
            if self._log is not None:
                self._log.close()
                self._log = None

    def _pump(self, read_fd: int) -> None:
        """Every line written to fd 1/2 -> the log; tagged worker lines (and in verbose mode all
        lines) -> the terminal."""
        with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace", newline="") as pipe:
            for line in pipe:
                with self._lock:
                    if self._log is None:
                        continue
                    self._write_log(line)
                    if self.verbose:
                        self._write_tty(line)
                    else:
                        self._show_once(_for_terminal(line, self.show_tagged))

    def _show_once(self, shown: str | None) -> None:
        # Ray Train's print patch may forward a worker's line twice; each rank logs Ray's warnings
        if shown is not None and shown not in self._shown:
            self._shown.add(shown)
            self._write_tty(shown + "\n")


def _for_terminal(line: str, show_tagged: bool) -> str | None:
    """What the quiet terminal shows of a line written to fd 1/2 (None: nothing): a rank's tagged
    line, progress line or alert without Ray's prefix and the tag; a Ray warning or error (each
    message once, prefixed ``Ray WARNING:``); nothing else."""
    for tag, shown in ((ALERT_TAG, True), (PROGRESS_TAG, True), (TAG, show_tagged)):
        if tag in line:
            return line.split(tag, 1)[1].rstrip("\n") if shown else None
    ray = RAY_WARNING.search(line.rstrip("\n"))
    if ray is not None:
        return f"Ray {ray.group(1)}: {ray.group('message')}"
    return None


class _TerminalErrors(logging.Handler):
    """Logging records at ERROR or above, to the terminal (formatted with their traceback)."""

    def __init__(self, console: Console):
        super().__init__(level=logging.ERROR)
        self.console = console
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "_raymcn_shown", False):  # reached through a second attached logger
            return
        record._raymcn_shown = True
        try:
            text = self.format(record)
        except Exception as e:  # noqa: BLE001 - a broken record must not take the run down
            text = f"{record.levelname} {record.name}: {record.msg} (unformatted: {reason(e)})"
        with self.console._lock:
            if self.console._tty_err is not None and not self.console.verbose:
                self.console._write_tty(text + "\n", err=True)


def console_log(where: str, cfg: Config | None = None) -> Path:
    """Where the console log of the run or sweep folder ``where`` goes: inside it, or for a bucket
    URI in the local cache (a log is appended line by line, which an object store cannot do)."""
    from raymcn import storage  # pyarrow's filesystems: only where a command asks (not in every worker)
    from raymcn.config import default_cache_dir

    if storage.is_uri(where):
        return default_cache_dir(cfg or Config()) / "logs" / storage.basename(where) / CONSOLE_LOG_FILE
    return Path(where).expanduser() / CONSOLE_LOG_FILE


def final_summary(metrics: dict[str, float], run_dir: str | Path) -> dict:
    """The ``--json`` object of ``train`` and ``eval``: retrieval metrics, each ``*_loss``, epochs,
    global_step, eval_size."""
    out = {k: metrics[k] for k in metric_names() if k in metrics}
    out.update({k: v for k, v in sorted(metrics.items()) if k.endswith("_loss")})
    out["epochs"] = int(metrics.get("epoch", 0))
    out["global_step"] = int(metrics.get("global_step", 0))
    out["eval_size"] = int(metrics.get("eval_size", 0))
    out["run_dir"] = str(run_dir)
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}
