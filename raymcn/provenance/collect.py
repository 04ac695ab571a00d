"""What a process can say about itself in a few milliseconds: raymcn's code, the installed packages, the
machine, and a file's identity. Stdlib only; torch is never imported (its CUDA build is read from the
loaded module, else from its ``version.py``).

**The code** is known two ways. Everywhere: a digest of the package's source files (every file under
``raymcn/`` but compiled ones), each file hashed as git hashes a blob, so that the digest of any commit
follows from ``git ls-tree`` without a checkout (``raymcn reproduce`` finds the commit of a run made
where ``.git`` was absent: the lab's servers receive the checkout through ``ray up``'s rsync, which
leaves ``.git`` out). Where the package sits in a git checkout: its commit, whether the tree is dirty,
and the patch of its uncommitted changes (``git diff HEAD``, plus the untracked files git does not
ignore, as new files: a module written and not yet added is code the run ran; each up to
:data:`UNTRACKED_MAX_BYTES`, at most :data:`UNTRACKED_MAX_FILES`, the others named as left out).

**A file's identity**: its size and SHA-256, of the whole file up to :data:`WHOLE_FILE_MAX` bytes,
else of its first and last :data:`ENDS_BYTES` (a 3.6 GB word2vec file costs 8 MiB of reading; a
change confined to its middle with the size unchanged is not seen, and ``digest_of`` says so). A
shard manifest is digested whole at any size (``bench/provenance.py``: HowTo100M's, about 150 MB).
"""

from __future__ import annotations

import getpass
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # raymcn/ as this process imported it
PATCH_KEPT_BYTES = 1 << 20  # a longer patch is cut in the record (its digest is of the whole)
UNTRACKED_MAX_BYTES = 256 << 10
UNTRACKED_MAX_FILES = 50
WHOLE_FILE_MAX = 64 << 20
ENDS_BYTES = 4 << 20
COMPILED = (".pyc", ".pyo")
KEY_PACKAGES = ("ray", "numpy")  # named in every line that says an environment, beside torch


def blob_id(data: bytes) -> str:
    """git's id of a file holding ``data`` (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def source_files(package_dir: Path | None = None) -> dict[str, str]:
    """Every source file of the package (path from the checkout's root, ``raymcn/...``) -> its blob id."""
    package_dir = package_dir or PACKAGE_DIR
    files = {}
    for path in package_dir.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in COMPILED:
            files[path.relative_to(package_dir.parent).as_posix()] = blob_id(path.read_bytes())
    return files


def source_digest(files: dict[str, str]) -> str:
    """The SHA-256 of ``path blob`` lines, sorted: equal for equal sources, wherever they lie."""
    return hashlib.sha256("".join(f"{p} {b}\n" for p, b in sorted(files.items())).encode()).hexdigest()


def git(root: Path, *args: str, check: bool = True) -> str | None:
    """``git args`` in ``root`` (never taking the index's lock: a user's own git command may run
    meanwhile); its stdout, or None when git is missing or fails (with ``check``)."""
    try:
        done = subprocess.run(["git", "--no-optional-locks", "-C", str(root), *args], capture_output=True,
                              check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if check and done.returncode != 0:
        return None
    return done.stdout.decode(errors="replace")


def checkout_root(package_dir: Path | None = None) -> Path | None:
    """The git checkout whose root holds the package, or None (an installed copy, a synced tree
    without ``.git``, or a package that merely lies inside some other repository)."""
    root = (package_dir or PACKAGE_DIR).parent
    if not (root / ".git").exists() or shutil.which("git") is None:
        return None
    top = git(root, "rev-parse", "--show-toplevel")
    return root if top is not None and Path(top.strip()).resolve() == root.resolve() else None


def installed_version() -> str:
    try:
        return importlib.metadata.version("raymcn")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def code_identity(package_dir: Path | None = None) -> dict[str, Any]:
    """raymcn's code as this process runs it (module doc): ``version``, ``source_digest``, and from
    a checkout ``commit``, ``branch``, ``repository`` (its origin's URL), ``dirty``, ``patch`` (cut at
    :data:`PATCH_KEPT_BYTES`), ``patch_sha256`` (of the whole), ``patch_files`` and
    ``untracked_left_out``; ``origin``: ``git`` or ``sources`` (no checkout)."""
    package_dir = package_dir or PACKAGE_DIR
    code: dict[str, Any] = {"version": installed_version(), "source_digest": source_digest(source_files(package_dir)),
                            "origin": "sources", "commit": None}
    root = checkout_root(package_dir)
    head = git(root, "rev-parse", "HEAD", "--abbrev-ref", "HEAD") if root else None
    if head is None:
        return code
    commit, branch = (head.split() + ["", ""])[:2]
    status = git(root, "status", "--porcelain", "--untracked-files=normal") or ""
    patch, left_out = _patch(root)
    code.update(origin="git", commit=commit, branch=branch, dirty=bool(status.strip()),
                repository=(git(root, "config", "--get", "remote.origin.url") or "").strip(),
                patch_sha256=hashlib.sha256(patch.encode()).hexdigest(),
                patch_files=sorted(set(re.findall(r"^diff --git a/\S+ b/(\S+)$", patch, re.MULTILINE))),
                patch=patch[:PATCH_KEPT_BYTES], untracked_left_out=left_out)
    if len(patch) > PATCH_KEPT_BYTES:
        code["patch_cut_at"] = PATCH_KEPT_BYTES
    return code


# a patch `git apply` takes whatever the user's git configuration says (colour, an external diff tool,
# text conversions, no a/ b/ prefixes)
PLAIN_DIFF = ("diff", "--binary", "--no-color", "--no-ext-diff", "--no-textconv", "--src-prefix=a/", "--dst-prefix=b/")


def _patch(root: Path) -> tuple[str, list[str]]:
    """(``git diff HEAD`` with the untracked files as new ones, the untracked files left out with why)."""
    patch = git(root, *PLAIN_DIFF, "HEAD") or ""
    untracked = (git(root, "ls-files", "--others", "--exclude-standard", "-z") or "").split("\0")
    left_out = []
    for i, name in enumerate(n for n in untracked if n):
        size = (root / name).stat().st_size if (root / name).is_file() else 0
        if i >= UNTRACKED_MAX_FILES or size > UNTRACKED_MAX_BYTES:
            left_out.append(f"{name} ({size} bytes)")
            continue
        patch += git(root, *PLAIN_DIFF, "--no-index", "--", "/dev/null", name, check=False) or ""
    return patch, left_out


def torch_build() -> tuple[str | None, str | None]:
    """(torch's version as ``torch.__version__`` prints it, the CUDA version it was built for; None:
    a CPU build or no torch), without importing it. Its version names the build ("2.3.1+cu121"),
    which the package's metadata ("2.3.1") does not."""
    loaded = sys.modules.get("torch")
    if loaded is not None and hasattr(loaded, "version"):
        return str(loaded.__version__), loaded.version.cuda
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None, None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return version_of("torch"), None

    def value(name: str) -> str | None:
        found = re.search(rf"^{name}\b[^=\n]*=\s*'([^']*)'", text, re.MULTILINE)
        return found.group(1) if found else None

    return value("__version__") or version_of("torch"), value("cuda")


def packages() -> dict[str, str]:
    """Every installed distribution on ``sys.path`` -> its version, from the metadata folders' names
    (a listing, not a parse: importlib.metadata reads each file, about 0.5 s for 170 packages). A
    folder inside an installation (Ray puts its vendored ``thirdparty_files`` on the path once
    imported) is part of that package, not a package of its own."""
    found: dict[str, str] = {}
    for entry in sys.path:
        if any(part in ("site-packages", "dist-packages") for part in Path(entry).parts[:-1]):
            continue
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.endswith(".dist-info"):
                dist, _, version = name[:-len(".dist-info")].partition("-")
                found.setdefault(dist.lower().replace("-", "_"), version)
    return dict(sorted(found.items()))


def version_of(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(all_packages: bool = True) -> dict[str, Any]:
    """Python and the key packages (torch with its CUDA build, Ray, numpy), and with ``all_packages``
    every installed one."""
    torch, cuda = torch_build()
    out: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable, "torch": torch,
                           **{name: version_of(name) for name in KEY_PACKAGES}, "cuda": cuda}
    if all_packages:
        out["packages"] = packages()
    return out


def host() -> dict[str, Any]:
    """This machine: its name, the user, the system, the CPU and its count, the NVIDIA GPUs and driver."""
    names, driver = gpus()
    return {"name": socket.gethostname(), "user": _user(), "system": platform.platform(terse=True),
            "cpu": cpu_model(), "cpus": os.cpu_count() or 0, "gpus": names, "gpu_driver": driver}


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container's user without a passwd entry
        return ""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


NVIDIA_PROC = Path("/proc/driver/nvidia")  # the NVIDIA driver's files on Linux


def gpus(proc: Path = NVIDIA_PROC) -> tuple[list[str], str | None]:
    """(the model of every NVIDIA GPU of this machine, the driver's version), read from the driver's
    files under ``proc`` (no CUDA context, no process), else from ``nvidia-smi``; ([], None) without one."""
    names = []
    for info in sorted(proc.glob("gpus/*/information")):
        found = re.search(r"^Model:\s*(.+)$", info.read_text(), re.MULTILINE)
        names.append(found.group(1).strip() if found else "unknown")
    try:  # "NVRM version: NVIDIA UNIX [Open Kernel Module for ]x86_64 [Kernel Module]  535.104.05  ..."
        version = re.search(r"NVRM version:.*?\s(\d+\.\d+(?:\.\d+)*)\s", (proc / "version").read_text())
    except OSError:
        version = None
    if names or version:
        return names, version.group(1) if version else None
    if shutil.which("nvidia-smi") is None:
        return [], None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return [], None
    rows = [[c.strip() for c in line.split(",")] for line in done.stdout.splitlines() if "," in line]
    return [r[0] for r in rows], (rows[0][1] if rows else None)


def file_identity(path: str | os.PathLike, whole: bool = False) -> dict[str, Any]:
    """``path``, its ``bytes`` and ``sha256`` (module doc: of the whole file, or its two ends; ``whole``:
    of the whole file at any size, as for a shard manifest, whose middle lists most shards' digests);
    ``missing`` when it is not a file here."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError:
        return {"path": str(path), "missing": True}
    digest = hashlib.sha256()
    whole = whole or size <= WHOLE_FILE_MAX
    with path.open("rb") as f:
        if whole:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        else:
            digest.update(f.read(ENDS_BYTES))
            f.seek(size - ENDS_BYTES)
            digest.update(f.read(ENDS_BYTES))
    return {"path": str(path), "bytes": size, "sha256": digest.hexdigest(),
            "digest_of": "the whole file" if whole else f"its first and last {ENDS_BYTES >> 20} MiB"}
