"""``raymcn reproduce RUN``: the commands that recreate a run (or a sweep) from its record, and what in
this machine's environment differs from it.

It reads the folder's record (``raymcn.provenance``; its first driver entry, what the run started
with: a later resume on other code or data is named) and prints a shell script:

1. the code: a clone at the recorded commit with the recorded patch of uncommitted changes applied
   (a here-document). A run made where ``.git`` was absent (the lab's servers receive the checkout
   through ``ray up``'s rsync) recorded only its sources' digest: the commit of this checkout's
   history whose sources have that digest is looked up (``git ls-tree``, no checkout);
2. the environment: ``make install`` with the recorded Python and torch build, then the recorded
   Ray and numpy;
3. the run: ``raymcn train --config RUN/raymcn_config.yaml`` (its resolved settings; a sweep's folder:
   ``raymcn sweep --config EXP/raymcn_sweep.yaml``), on the data the record names by digest;

then, as comments, what differs here: this checkout, this environment, this host, and the data at
the recorded paths.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from typing import Any

from raymcn import storage
from raymcn.config import RECORD_FILE, RUN_CONFIG_FILE, SWEEP_CONFIG_FILE, load_config_text
from raymcn.doctor.driver import CUDA_INDEX
from raymcn.provenance import collect, record
from raymcn.provenance.compare import compare
from raymcn.provenance.describe import code_label, data_label, environment_label

HELP = "print the commands that recreate a run or sweep from its record, and what differs here"
COMMITS_SEARCHED = 2000  # of this checkout's history, for a run recorded without a commit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN", help="a run's folder (or a sweep's, or a trial's under EXP/train/), "
                   "a path or URI: the one holding raymcn_provenance.jsonl")


def run(args: argparse.Namespace) -> int:
    """``raymcn reproduce RUN``; status 2 when RUN holds no record or no settings."""
    where = storage.normalize(args.run_dir)
    entries = record.read(where)
    found = record.drivers(entries)
    names = storage.files(where)
    settings = next((n for n in (RUN_CONFIG_FILE, SWEEP_CONFIG_FILE) if n in names), None)
    if not found or settings is None:
        missing = RECORD_FILE if not found else f"{RUN_CONFIG_FILE} or {SWEEP_CONFIG_FILE}"
        print(f"raymcn reproduce: {where}: no {missing} there (a run or sweep of raymcn keeps both; one from "
              "before raymcn kept a record has none)", file=sys.stderr)
        return 2
    print(script(where, found, settings), end="")
    return 0


def script(where: str, found: list[dict[str, Any]], settings: str) -> str:
    """The script for the folder ``where`` (its driver entries ``found``, its settings file ``settings``)."""
    first = found[0]
    lines = [f"# What recreates {where}: its record ({record.path_of(where)}), as it started",
             f"# on {first.get('time', '?')} on {(first.get('host') or {}).get('name', '?')}: "
             f"{shlex.join(first.get('command') or [])}"]
    if later := [e for e in found[1:] if compare(first, e)]:
        lines.append(f"# (resumed {len(later)} time(s) with other code, environment or data: each entry of its record "
                     "says with what; this recreates its start)")
    lines += ["set -e", *code_steps(first.get("code") or {}), *environment_steps(first.get("environment") or {}),
              *run_steps(where, settings, first), *differences(first)]
    return "\n".join(lines) + "\n"


def code_steps(code: dict[str, Any]) -> list[str]:
    """Step 1: the clone at the commit, the patch applied."""
    commit, note = code.get("commit"), ""
    if not commit:
        commit = commit_of_sources(code.get("source_digest", ""))
        note = (f" (recorded without git; this checkout's commit {commit[:7]} has the run's sources)" if commit else "")
    lines = [f"# 1. The code: {code_label(code)}{note}."]
    if not commit:
        return lines + [f"#    No commit of this checkout's last {COMMITS_SEARCHED} has sources "
                        f"{str(code.get('source_digest', ''))[:12]}: find raymcn {code.get('version', '?')} with them."]
    source = code.get("repository") or str(collect.checkout_root() or "")
    if not source:
        lines.append("#    REPOSITORY: a clone of raymcn's history (none was recorded)")
    folder, origin = f"raymcn-{commit[:7]}", shlex.quote(source) if source else '"$REPOSITORY"'
    lines += [f"git clone {origin} {folder} && cd {folder}",
              f"git checkout --detach {commit}"]
    patch = code.get("patch") or ""
    if code.get("dirty") and patch:
        end = f"RAYMCN_PATCH_{str(code.get('patch_sha256', ''))[:8]}"
        while end in patch:
            end += "_"
        lines += [f"git apply --whitespace=nowarn <<'{end}'", patch.rstrip("\n"), end]
    if code.get("patch_cut_at"):
        lines.append(f"#    (the record kept the patch's first {code['patch_cut_at']} bytes only; its digest is of the whole)")
    if code.get("untracked_left_out"):
        lines.append(f"#    (untracked files left out of the patch: {', '.join(code['untracked_left_out'])})")
    return lines


def commit_of_sources(digest: str) -> str | None:
    """The newest commit of this checkout's history (every ref, at most :data:`COMMITS_SEARCHED`) whose
    package sources have ``digest`` (``collect.source_digest`` of ``git ls-tree``'s blob ids); None."""
    root = collect.checkout_root()
    if root is None or not digest:
        return None
    package = collect.PACKAGE_DIR.name
    for commit in (collect.git(root, "rev-list", f"--max-count={COMMITS_SEARCHED}", "--all") or "").split():
        listing = collect.git(root, "ls-tree", "-r", commit, "--", package) or ""
        files = {path: blob for mode, kind, blob, path in (re.split(r"\s+", line, maxsplit=3)
                                                           for line in listing.splitlines()) if kind == "blob"}
        if collect.source_digest(files) == digest:
            return commit
    return None


def torch_install(torch: str, cuda: str | None) -> tuple[str, str]:
    """(the requirement, ``make install``'s TORCH_INDEX) of a recorded torch build: ``+cpu`` from
    PyTorch's CPU index, ``+cuXYZ`` from its CUDA XY.Z index, no local tag from pip's default index
    (where torch is a CUDA build, ``cuda`` says which)."""
    release, _, local = torch.partition("+")
    if local == "cpu":
        index = "cpu"
    elif local.startswith("cu"):
        index = CUDA_INDEX.format(tag=local[2:])
    else:
        index = "default"
    return f"torch=={release}", index


def environment_steps(env: dict[str, Any]) -> list[str]:
    """Step 2: the venv with the recorded Python and torch build, then Ray and numpy as recorded."""
    python = ".".join(str(env.get("python", "3")).split(".")[:2])
    requirement, index = torch_install(str(env.get("torch", "")), env.get("cuda"))
    pins = " ".join(f"{name}=={env[name]}" for name in ("ray", "numpy") if env.get(name))
    return [f"# 2. The environment: {environment_label(env)}.",
            f"make install PYTHON=python{python} TORCH={requirement} TORCH_INDEX={shlex.quote(index)}",
            *([f".venv/bin/python -m pip install -q {pins}"] if pins else [])]


def run_steps(where: str, settings: str, first: dict[str, Any]) -> list[str]:
    """Step 3: the command with the recorded settings (a named run under another name: the recorded
    one would continue the original), and the data it must find."""
    path = storage.join(where, settings)
    command = "sweep" if settings == SWEEP_CONFIG_FILE else "train"
    cfg = load_config_text(storage.read_text(path), source=path)
    extra = f" --set run.name={cfg.run.name}-reproduced" if cfg.run.name else ""
    lines = [f"# 3. The {'sweep' if command == 'sweep' else 'run'}, with its recorded settings"
             + (" (a trial of a sweep, as a single run)" if first.get("trial") else "")
             + (f" (renamed: run.name={cfg.run.name} would continue the original)" if extra else "") + ":",
             f".venv/bin/raymcn {command} --config {shlex.quote(path)}{extra}",
             f"#    on the data: {data_label(first.get('data') or {})}"]
    return lines


def present_entry(first: dict[str, Any]) -> dict[str, Any]:
    """This checkout, environment and host, and the data now at the record's paths, as a driver entry."""
    data = dict(first.get("data") or {})
    if shards := data.get("shards"):
        manifest = (shards.get("manifest") or {}).get("path")
        data["shards"] = {**shards, "manifest": collect.file_identity(manifest, whole=True) if manifest else {}}
    if evalset := data.get("eval_set"):
        path = (evalset.get("file") or {}).get("path")
        data["eval_set"] = {**evalset, "file": collect.file_identity(path) if path else {}}
    if (words := data.get("word_vectors")) and words.get("path"):
        data["word_vectors"] = collect.file_identity(words["path"])
    return {"code": collect.code_identity(), "environment": collect.environment(), "host": collect.host(),
            "data": data, "seeds": first.get("seeds") or {}}


def differences(first: dict[str, Any]) -> list[str]:
    """What differs here from the record's start, as comments (``facet: recorded -> here``)."""
    changes = compare(first, present_entry(first))
    if not changes:
        return ["# Here: the same code, environment, host and data as the record."]
    return ["# What differs here (this checkout, environment, host and the data at the recorded paths):",
            *(f"#   {k}: {new}" if not old else f"#   {k}: {old} -> {new}" for k, old, new in changes)]
