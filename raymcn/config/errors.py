"""The errors raymcn names to its user, and what is shown of them: which a restart cannot cure
(:class:`PermanentError`, among them a storage no retry makes room on, :class:`StorageError`), which
``raymcn doctor`` checks before a sweep (:class:`NodeInputError`), a configuration's problems
(:class:`ConfigError`), Ray out of reach (:class:`RayUnavailable`). Stdlib only."""

from __future__ import annotations

import errno


def reason(error: BaseException) -> str:
    """What a user is shown of ``error``: its class and the first line of its message (a Ray task's
    error, ``RayTaskError(RuntimeError)``, is named by the class of the error inside it), never a
    guess at the cause."""
    cause = getattr(error, "cause", None) if type(error).__name__.startswith("RayTaskError") else None
    shown = cause if isinstance(cause, BaseException) else error
    lines = [line.strip() for line in str(shown).strip().splitlines() if line.strip()]
    return f"{type(shown).__name__}: {lines[0]}" if lines else type(shown).__name__


class PermanentError(Exception):
    """An error a restart from the last checkpoint cannot cure: a bad setting, a missing or damaged
    input, a diverged loss, a full or read-only storage. Such a run fails at once instead of being
    retried ``scale.max_failures`` times (``launch.FailFastOnPermanentErrors``); a sweep trial that
    hits one ends as errored without a retry (a full storage stops the whole sweep instead,
    resumable). Lost processes and nodes are not permanent: they are retried."""


# What a write fails with when its filesystem cannot take it, which no retry or restart changes:
# full, over quota, mounted read-only, a file larger than the filesystem allows.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})


class StorageError(PermanentError):
    """A write to a run's storage (or a worker's temp folder) failed with one of
    :data:`STORAGE_ERRNOS`; the message names the path, its filesystem, the free and needed bytes
    and what to do (``train/checkpoints/space.py`` writes it). ``errno``: the failed write's."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message, code)
        self.errno = code

    def __str__(self) -> str:
        return str(self.args[0])


def storage_cause(error: BaseException | None) -> BaseException | None:
    """The :class:`StorageError`, or the ``OSError`` of one of :data:`STORAGE_ERRNOS`, that caused
    ``error`` (found as :func:`permanent_cause` finds one), if any."""
    cause = permanent_cause(error)
    return cause if is_storage_error(cause) else None


def is_storage_error(error: BaseException | None) -> bool:
    return isinstance(error, StorageError) or (isinstance(error, OSError) and error.errno in STORAGE_ERRNOS)


def permanent_cause(error: BaseException | None) -> BaseException | None:
    """The :class:`PermanentError` (or ``FileNotFoundError``, or a storage ``OSError``:
    :data:`STORAGE_ERRNOS`) that caused ``error``, if any.

    Follows ``__cause__``/``__context__``, the ``cause`` Ray's task errors (and
    ``launch.PermanentRunError``) carry and the ``controller_failure`` of Ray Train's
    ``ControllerError``, so it finds a worker's error inside what the Train controller or Tune hands
    on (their chains do not survive pickling; those attributes do).
    """
    stack, seen = [error], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if type(e).__name__.startswith("RayTaskError") and isinstance(getattr(e, "cause", None), BaseException):
            stack.append(e.cause)  # Ray's task error is also an instance of its cause's class: the cause itself
            continue
        if isinstance(e, (PermanentError, FileNotFoundError)) or is_storage_error(e):
            return e
        stack += [getattr(e, "controller_failure", None), getattr(e, "cause", None), e.__cause__, e.__context__]
    return None


class RayUnavailable(RuntimeError):
    """Ray could not be started or reached (``train/on_ray/cluster.py``): the command ran nothing;
    the message says which instance, why that one, what failed and what to do."""


class NodeInputError(Exception):
    """An error about what a node reads or runs with (its shards, samples, eval set, config), one
    ``raymcn doctor`` checks on every node before a sweep (:func:`doctor_hint`)."""


def doctor_hint(cause: BaseException) -> str:
    """A pointer to ``raymcn doctor`` when ``cause`` is one it checks on every node before a sweep
    (a missing or unreadable file or mount, another node's software); "" otherwise."""
    if isinstance(cause, (OSError, ImportError, NodeInputError)) and not is_storage_error(cause):
        return ("`raymcn doctor --config ...` checks every node's shards, eval set, word vectors, storage and "
                "versions before a sweep")
    return ""


class ConfigError(ValueError, PermanentError, NodeInputError):
    """A configuration problem; the message lists every problem found, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(self.problems))


def shadowed_package_error() -> ImportError | None:
    """The error to raise when ``raymcn`` was imported from a folder that is not the package: Python
    started in the folder that holds a clone named ``raymcn`` finds the clone's folder first, takes
    it for a namespace package (it has no ``__init__.py``), and the clone's scripts (``train.py``,
    ``sweep.py``) stand in for the package's modules, which ends in a circular import that names
    neither. None when ``raymcn`` is the package itself."""
    import os
    import sys

    package = sys.modules.get("raymcn")
    if package is None or getattr(package, "__file__", None) is not None:
        return None
    paths = [str(p) for p in getattr(package, "__path__", [])]
    folders = [p for p in paths if not os.path.isfile(os.path.join(p, "__init__.py"))]
    installed = [p for p in paths if p not in folders]
    instead = f" instead of the installed package ({', '.join(installed)})" if installed else ""
    return ImportError(f"Python imported the folder {', '.join(folders) or '?'} as the package raymcn{instead}: "
                       f"it has no __init__.py (a clone of raymcn?) and Python looks in the folder it started in "
                       f"({os.getcwd()}) first. Start Python from another folder, or rename the clone's folder "
                       "(e.g. to raymcn-src)")
