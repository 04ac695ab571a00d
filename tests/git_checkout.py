"""A git checkout of raymcn in a temporary folder, with an uncommitted change: what the provenance tests
run from (``conftest.checkout``).

It holds a copy of the package, the sweep files and ``pyproject.toml``, committed; then
:data:`CHANGED` is edited (:data:`CHANGE` appended) and not committed. Its package's sources equal
the checkout's under test, so a Ray worker that imports raymcn from either has the same sources'
digest. A process started in its root (``python -m raymcn.cli``) imports its package; an in-process
test points ``provenance.collect.PACKAGE_DIR`` at it.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHANGED = "sweeps/smoke.yaml"  # a sweep file edited and not committed: what a researcher's tree often holds
CHANGE = "# an uncommitted change, for the provenance tests\n"
IDENTITY = ["-c", "user.name=raymcn tests", "-c", "user.email=tests@raymcn.invalid", "-c", "commit.gpgsign=false"]


@dataclass(frozen=True)
class Checkout:
    root: Path

    def git(self, *args: str) -> str:
        return subprocess.run(["git", *IDENTITY, "-C", str(self.root), *args], check=True, capture_output=True,
                              text=True).stdout

    @property
    def commit(self) -> str:
        return self.git("rev-parse", "HEAD").strip()

    @property
    def package(self) -> Path:
        return self.root / "raymcn"

    def commit_all(self, message: str) -> str:
        """Commit every change (the uncommitted one included): a new commit, a clean tree."""
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)
        return self.commit


def make_checkout(where: Path) -> Checkout:
    """The checkout in ``where`` (module doc): committed, then :data:`CHANGED` edited."""
    where.mkdir(parents=True)
    ignored = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO / "raymcn", where / "raymcn", ignore=ignored)
    shutil.copytree(REPO / "sweeps", where / "sweeps", ignore=ignored)
    shutil.copy(REPO / "pyproject.toml", where / "pyproject.toml")
    checkout = Checkout(where)
    checkout.git("init", "-q")
    checkout.commit_all("raymcn as under test")
    with open(where / CHANGED, "a") as f:
        f.write(CHANGE)
    return checkout
