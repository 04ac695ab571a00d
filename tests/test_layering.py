"""The package layering, checked over every module of raymcn: what each may import, and no
import cycles. Every import counts, also those inside functions (a lazy import still couples).

Layers, left to right: environment (the process's RAYMCN_* variables) -> config, storage -> provenance (a run's
record: stdlib, the config's names and storage) -> data -> model -> losses -> train -> sweep -> results;
collectives (the ranks' collectives, torch only) sits under the losses and serves them and train/;
cli, reproduce, doctor, servers and phases (a sweep's search, then its confirmation) on top; bench/ imports raymcn,
never the reverse. The rules are per folder (a file
moved within its folder keeps its rules): inside data/, formats/ comes first, write/ and read/ use
it, and the corpora (synthetic, evalsets) sit on top; inside train/, the run itself (the modules
at its root) and the checkpoints/, monitor/ and preflight/ rooms never import on_ray/, the only
folder of train/ that imports Ray. Two data modules import Ray, each the Ray side of its room:
read/datasource (Ray Data) and write/ray_writers (Ray actors); the rest of data/ imports without
Ray. Other deviations: sweep/ builds Optuna's sampler for Tune's OptunaSearch, results/ also
uses numpy, scipy, statsmodels and yaml (statistics, the sweep file), monitor/trackers logs a run to
MLflow and W&B (optional extras, imported when asked for) and TensorBoard (tensorboardX, Ray Tune's),
preflight/gpus reads the GPUs' free memory through NVML (nvidia-ml-py), which opens no CUDA context,
and on_ray/cluster finds the Ray instances of this machine by their raylets' command lines (psutil)
and asks the chosen one's GCS for a connection through gRPC (Ray's own transport) before Ray's
connect, which would retry for minutes.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "raymcn"
STDLIB = set(sys.stdlib_module_names) | {"__future__"}
DATA_LIBS = {"numpy", "pyarrow", "torch", "tqdm", "yaml", "isal"}  # isal: the shards' fast CRC-32


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(path: Path) -> set[str]:
    """Every name ``path`` imports, absolute: ``import a.b`` gives a.b, ``from a.b import c`` a.b.c."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _within(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


RAY_DATA_SIDE = {"raymcn.data.read.datasource", "raymcn.data.write.ray_writers"}
TRAIN_ROOMS = {"raymcn.train." + room for room in ("checkpoints", "monitor", "preflight")}
NOT_ON_RAY = {"raymcn.train.on_ray", *RAY_DATA_SIDE}


def folder(module: str) -> str:
    """The package ``module`` lives in (a package's own ``__init__`` lives in itself)."""
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def allowed(module: str) -> tuple[set[str], set[str], set[str]]:
    """(raymcn names it may import, raymcn names it may not, third-party packages it may import)."""
    where = folder(module)
    if module == "raymcn.environment":  # the process's RAYMCN_* variables: stdlib only, below everything
        return set(), set(), set()
    if where == "raymcn.config":  # a package: names, errors, sections, checks, loading
        return {"raymcn.environment", "raymcn.config"}, set(), {"yaml"}
    if module == "raymcn.collectives":  # the ranks' collectives: torch only, under the losses
        return set(), set(), {"torch"}
    if module == "raymcn.storage":
        return {"raymcn.config"}, set(), {"pyarrow"}
    if module == "raymcn.reference":  # config's own documentation, generated from its source
        return {"raymcn.config"}, set(), set()
    if where == "raymcn.provenance":  # a run's record: stdlib, the config's names and storage
        return {"raymcn.config", "raymcn.storage", "raymcn.provenance"}, set(), set()
    if module in ("raymcn.cli", "raymcn.__main__", "raymcn", "raymcn.phases", "raymcn.reproduce") or \
            module.startswith("raymcn.doctor"):
        return {"raymcn"}, set(), {"*"}
    if where == "raymcn.servers":  # on top, beside cli; runs sweeps as `raymcn sweep` processes, imports none
        # ... but connects to Ray as every command does (the connection's module imports no torch)
        return ({"raymcn.config", "raymcn.storage", "raymcn.servers", "raymcn.train.on_ray.cluster"}, set(),
                {"ray", "pyarrow", "yaml"})
    ray = {"ray"} if module in RAY_DATA_SIDE else set()
    forbidden = set() if module in RAY_DATA_SIDE else RAY_DATA_SIDE
    if where == "raymcn.data.formats":
        return {"raymcn.config", "raymcn.data.formats"}, set(), DATA_LIBS
    if where in ("raymcn.data.write", "raymcn.data.read"):
        return {"raymcn.config", "raymcn.data.formats", where}, forbidden, DATA_LIBS | ray
    if where == "raymcn.data":
        return {"raymcn.config", "raymcn.data"}, forbidden, DATA_LIBS
    if where == "raymcn.model":
        return {"raymcn.config.ModelConfig", "raymcn.config.MODALITIES", "raymcn.model"}, set(), {"torch"}
    if where == "raymcn.losses":
        return {"raymcn.config.LossConfig", "raymcn.config.MODALITIES", "raymcn.collectives", "raymcn.losses"}, set(), {
            "torch"}
    if where == "raymcn.train.on_ray":
        return ({"raymcn.config", "raymcn.environment", "raymcn.storage", "raymcn.provenance", "raymcn.data", "raymcn.model",
                 "raymcn.collectives", "raymcn.losses", "raymcn.train"},
                {"raymcn.data.write.ray_writers"}, {"torch", "numpy", "yaml", "ray"} | (
                    {"grpc", "psutil"} if module == "raymcn.train.on_ray.cluster" else set()))
    if where == "raymcn.train" or where in TRAIN_ROOMS:
        return ({"raymcn.config", "raymcn.environment", "raymcn.storage", "raymcn.provenance", "raymcn.data", "raymcn.model",
                 "raymcn.collectives", "raymcn.losses", "raymcn.train"},
                NOT_ON_RAY, {"torch", "numpy", "yaml"} | (
                    {"mlflow", "wandb", "tensorboardX"} if module == "raymcn.train.monitor.trackers" else set()) | (
                    {"pynvml"} if module == "raymcn.train.preflight.gpus" else set()))
    if where == "raymcn.sweep":
        return ({"raymcn.config", "raymcn.environment", "raymcn.storage", "raymcn.provenance", "raymcn.data",
                 "raymcn.train", "raymcn.sweep"},
                {"raymcn.data.write.ray_writers"}, {"ray", "numpy", "optuna"})
    if where == "raymcn.results":
        return {"raymcn.config", "raymcn.provenance", "raymcn.results"}, set(), {
            "pandas", "matplotlib", "numpy", "scipy", "statsmodels", "yaml"}
    raise AssertionError(f"{module}: no layer")


def problems_of(module: str, names: set[str] | None = None) -> list[str]:
    mods, forbidden, libs = allowed(module)
    problems = []
    for name in sorted(imports_of(MODULES[module]) if names is None else names):
        top = name.split(".")[0]
        if top in STDLIB:
            continue
        if top == "raymcn":
            if not _within(name, mods) or _within(name, forbidden):
                problems.append(f"{module} imports {name}")
        elif "*" not in libs and top not in libs:
            problems.append(f"{module} imports {top}")
    return problems


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_imports_only_from_its_layer_and_those_to_its_left(module):
    assert problems_of(module) == []


def test_the_checker_can_fail():
    """What a review found earlier is refused: the objective importing the whole Config, preflight importing
    Ray, the results importing torch, a Ray-free data module importing the datasource."""
    assert problems_of("raymcn.losses.objective", {"raymcn.config.Config"})
    assert problems_of("raymcn.train.preflight.checks", {"ray.train"})
    assert problems_of("raymcn.results.table", {"torch"})
    assert problems_of("raymcn.data.write.shards", {"raymcn.data.read.datasource.rank_dataset"})
    assert problems_of("raymcn.data.formats.sample", {"raymcn.data.write.shards"})  # formats come first
    assert problems_of("raymcn.train.monitor.console", {"raymcn.train.on_ray.launch"})
    assert problems_of("raymcn.collectives", {"raymcn.losses.MCNObjective"})  # below the losses
    assert not problems_of("raymcn.train.on_ray.worker", {"raymcn.data.read.datasource.RankStream", "ray.train"})


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        for name in imports_of(path):
            target = name if name in MODULES else name.rsplit(".", 1)[0]  # a module, or a name in one
            if target in MODULES and target != module and not module.startswith(target + "."):
                graph[module].add(target)
    return graph


def test_no_import_cycles():
    graph, state, stack, cycles = _edges(), {}, [], []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if n.startswith(m + "."):  # a package importing its own submodule is not a cycle
                continue
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(MODULES):
        if m not in state:
            visit(m)
    assert cycles == []


def test_no_module_of_raymcn_imports_the_benchmarks():
    assert not [m for m, p in MODULES.items() if any(n.split(".")[0] == "bench" for n in imports_of(p))]


def ray_private(name: str) -> bool:
    """A Ray module that Ray does not promise to keep: ``ray._private``, ``ray._common``, any ``_internal``."""
    parts = name.split(".")
    return parts[0] == "ray" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def test_raymcn_reads_no_private_module_of_ray():
    """A Ray upgrade may move them without notice; raymcn keeps to Ray's public API."""
    assert ray_private("ray._private.ray_constants.env_bool") and ray_private("ray.train.v2._internal.constants.X")
    assert not ray_private("ray.train.get_preemption_info") and not ray_private("ray.util.state.list_actors")
    assert {m: sorted(n for n in imports_of(p) if ray_private(n)) for m, p in MODULES.items()
            if any(ray_private(n) for n in imports_of(p))} == {}


BENCH = sorted((ROOT.parent / "bench").glob("*.py"))
TESTS = sorted((ROOT.parent / "tests").glob("*.py"))


def test_the_benchmarks_never_import_the_tests():
    """Helpers both need live in the bench package, which the tests import (not the reverse)."""
    tests = {p.stem for p in TESTS}
    assert BENCH and not {p.name: sorted(n for n in imports_of(p) if n.split(".")[0] in tests | {"tests"})
                          for p in BENCH if any(n.split(".")[0] in tests | {"tests"} for n in imports_of(p))}


def _edits_sys_path(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
        if target is not None and ast.unparse(target) == "sys.path":
            return True
    return False


def test_no_benchmark_or_test_edits_sys_path():
    """Benchmarks run as modules (``python -m bench.NAME``) and pytest puts the checkout on the path
    (pyproject.toml): nothing needs ``sys.path.insert``."""
    assert [p.relative_to(ROOT.parent).as_posix() for p in BENCH + TESTS if _edits_sys_path(p)] == []


def test_the_servers_commands_connect_to_ray_without_importing_torch():
    """`raymcn drain` runs from a reboot and `raymcn boot` at a server's start: they connect to Ray
    through the connection every command makes (``train/on_ray/cluster.py``), which must not pull
    torch's seconds of imports in with it."""
    code = ("import sys, raymcn.servers.drain, raymcn.servers.boot, raymcn.train.on_ray.cluster; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
