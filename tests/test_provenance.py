"""Every number traces back to what made it (``raymcn/provenance/``, ``train/run_record.py``): the record's
parts, the file, what a resume and a run's nodes say, the tables' lines and ``raymcn reproduce``. No Ray:
the runs and the sweep that write records on Ray are tests/test_train_ray.py, tests/test_e2e.py (a
resume on another commit and manifest) and the grid rehearsal of tests/test_rehearsals.py."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY
from git_checkout import CHANGE, CHANGED, make_checkout
from test_sweep_summary import ORDER, confirmed  # noqa: F401 (the fixture)

from raymcn.cli import main, preset_path
from raymcn.config import RECORD_FILE, load_config
from raymcn.provenance import collect, record
from raymcn.provenance.compare import compare, node_disagreements, resume_notes
from raymcn.provenance.describe import MANIFEST_FACET, NODE_FACETS, code_label, facets, mlflow_tags
from raymcn.train import run_record
from raymcn.train.inputs import resolve_inputs


@pytest.fixture(scope="module")
def tiny():
    """(config, inputs) of a tiny run of the embedded default (its corpus generated into the cache once)."""
    cfg = load_config(preset_path(), TINY)
    return cfg, resolve_inputs(cfg)


def apply(patch: str, where: Path) -> None:
    subprocess.run(["git", "-C", str(where), "apply", "--whitespace=nowarn"], input=patch, text=True, check=True)


# --- the code ----------------------------------------------------------------------------------------------
def test_the_patch_recreates_the_sources_and_their_digest_is_computed_from_git_alone(checkout, tmp_path,
                                                                                   monkeypatch):
    """A checkout with an edited file and an untracked module: its record holds the commit, the dirty
    flag and a patch that, applied to a clone at the commit, gives sources of the same digest; the
    commit's own digest follows from `git ls-tree` (how `raymcn reproduce` finds a run's commit
    where .git was absent)."""
    (checkout.package / "new_module.py").write_text("ANSWER = 42\n")  # written, not yet added
    monkeypatch.setattr(collect, "UNTRACKED_MAX_BYTES", 1000)
    (checkout.package / "weights.bin").write_bytes(os.urandom(2000))  # past the limit: named, left out
    code = collect.code_identity(checkout.package)
    assert code["commit"] == checkout.commit and code["dirty"] is True and code["origin"] == "git"
    assert code["patch_files"] == sorted([CHANGED, "raymcn/new_module.py"])
    assert code["untracked_left_out"] == ["raymcn/weights.bin (2000 bytes)"]
    assert code["patch_sha256"] == hashlib.sha256(code["patch"].encode()).hexdigest()
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(checkout.root), str(clone)], check=True)
    at_commit = collect.source_digest(collect.source_files(clone / "raymcn"))
    apply(code["patch"], clone)
    (clone / "raymcn" / "weights.bin").write_bytes((checkout.package / "weights.bin").read_bytes())  # as named
    assert collect.source_digest(collect.source_files(clone / "raymcn")) == code["source_digest"] != at_commit
    assert (clone / CHANGED).read_text() == (checkout.root / CHANGED).read_text()
    from raymcn.reproduce import commit_of_sources

    monkeypatch.setattr(collect, "PACKAGE_DIR", checkout.package)
    assert commit_of_sources(at_commit) == checkout.commit and commit_of_sources(code["source_digest"]) is None


def test_without_a_checkout_of_its_own_the_sources_digest_stands_for_the_code(checkout, tmp_path):
    """A synced copy without .git, and a package that merely lies in another repository's tree: no
    commit, the digest of the same sources, and a label that says there was no checkout."""
    synced = tmp_path / "synced"
    import shutil

    shutil.copytree(checkout.package, synced / "raymcn")
    nested = checkout.root / "vendor"
    shutil.copytree(checkout.package, nested / "raymcn")
    clean = collect.code_identity(checkout.package)
    for package in (synced / "raymcn", nested / "raymcn"):
        code = collect.code_identity(package)
        assert code["commit"] is None and code["origin"] == "sources"
        assert code["source_digest"] == clean["source_digest"]
        assert code_label(code) == f"raymcn {code['version']}, sources {code['source_digest'][:12]} (no git checkout)"


def test_a_file_is_identified_whole_or_by_its_two_ends(tmp_path, monkeypatch):
    small = tmp_path / "eval.pkl"
    small.write_bytes(b"x" * 3000)
    assert collect.file_identity(small) == {"path": str(small), "bytes": 3000, "digest_of": "the whole file",
                                            "sha256": hashlib.sha256(small.read_bytes()).hexdigest()}
    monkeypatch.setattr(collect, "WHOLE_FILE_MAX", 1000)
    monkeypatch.setattr(collect, "ENDS_BYTES", 100)
    data = bytearray(os.urandom(3000))
    big = tmp_path / "word2vec.bin"
    big.write_bytes(bytes(data))
    seen = collect.file_identity(big)
    assert seen["sha256"] == hashlib.sha256(bytes(data[:100] + data[-100:])).hexdigest()
    assert seen["digest_of"] == f"its first and last {100 >> 20} MiB" and seen["bytes"] == 3000
    data[1500] ^= 1  # a change in the middle, the size kept: not seen (the module doc says so)
    big.write_bytes(bytes(data))
    assert collect.file_identity(big)["sha256"] == seen["sha256"]
    data[-1] ^= 1
    big.write_bytes(bytes(data))
    assert collect.file_identity(big)["sha256"] != seen["sha256"]
    assert collect.file_identity(tmp_path / "gone") == {"path": str(tmp_path / "gone"), "missing": True}
    manifest = collect.file_identity(big, whole=True)  # a manifest: whole at any size
    assert manifest["sha256"] == hashlib.sha256(bytes(data)).hexdigest() and manifest["digest_of"] == "the whole file"


@pytest.mark.parametrize("version, driver", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n", "535.104.05"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  (dvs-builder)\n",
     "570.86.15")])
def test_the_gpus_and_the_driver_are_read_from_the_drivers_files(tmp_path, version, driver):
    """The NVIDIA driver's files under /proc (its proprietary and its open kernel module): every GPU's
    model, in bus order, and the driver's version, without a CUDA context."""
    for bus, model in (("0000:3b:00.0", "NVIDIA A100-SXM4-80GB"), ("0000:d8:00.0", "NVIDIA A100-SXM4-80GB")):
        (tmp_path / "gpus" / bus).mkdir(parents=True)
        (tmp_path / "gpus" / bus / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 56\n")
    (tmp_path / "version").write_text(version + "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    assert collect.gpus(tmp_path) == (["NVIDIA A100-SXM4-80GB"] * 2, driver)
    from raymcn.provenance.describe import gpus_text

    assert gpus_text(*collect.gpus(tmp_path)) == f"2x NVIDIA A100-SXM4-80GB, driver {driver}"


def test_the_installed_packages_are_listed_as_importlib_reads_them():
    import importlib.metadata

    listed = collect.packages()
    for name in ("torch", "ray", "numpy", "pyarrow"):
        assert listed[name] == importlib.metadata.version(name), name
    env = collect.environment()
    assert env["ray"] == listed["ray"]
    import torch

    assert (env["torch"], env["cuda"]) == (torch.__version__, torch.version.cuda)


def test_torchs_build_is_read_as_torch_prints_it_without_importing_torch(tmp_path):
    """A CUDA build from the package index is "2.3.1" in its metadata and "2.3.1+cu121" in
    ``torch.__version__``: the record keeps the second, read from torch's version.py (a driver that
    never imports torch does not pay its import)."""
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    (package / "version.py").write_text("__version__ = '2.3.1+cu121'\ncuda: Optional[str] = '12.1'\n")
    (tmp_path / "torch-2.3.1.dist-info").mkdir()
    (tmp_path / "torch-2.3.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.3.1\n")
    code = "import json, sys; from raymcn.provenance import collect; print(json.dumps(collect.torch_build()))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parents[1])])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == ["2.3.1+cu121", "12.1"]


# --- the record ----------------------------------------------------------------------------------------------
def test_a_runs_entry_holds_its_code_environment_host_data_and_seeds(tiny, checkout, monkeypatch):
    cfg, inputs = tiny
    monkeypatch.setattr(collect, "PACKAGE_DIR", checkout.package)
    entry = run_record.driver_entry(cfg, inputs)
    assert entry["code"]["commit"] == checkout.commit and entry["code"]["dirty"] and CHANGE in entry["code"]["patch"]
    assert entry["host"]["name"] == __import__("socket").gethostname()
    manifest = Path(inputs.shards_dir) / "manifest.json"
    assert entry["data"]["shards"]["manifest"]["sha256"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert entry["data"]["shards"]["shards"] == len(inputs.shard_bytes) and entry["data"]["shards"]["videos"] == 64
    assert entry["data"]["synthetic"] == {name: cfg.to_flat()[key] for name, key in run_record.SYNTHETIC.items()}
    assert entry["seeds"]["run.seed"] == cfg.run.seed
    carried = {"code": entry["code"], "command": ["raymcn", "sweep"], "host": "head"}
    monkeypatch.setattr(collect, "PACKAGE_DIR", checkout.root / "nowhere" / "raymcn")  # a node without git
    (checkout.root / "nowhere" / "raymcn").mkdir(parents=True)
    trial = run_record.driver_entry(cfg, inputs, carried=carried, trial="abc_00000")
    assert trial["code"]["commit"] == checkout.commit and trial["code"]["origin"] == "carried"
    assert trial["command"] == ["raymcn", "sweep"] and trial["trial"] == "abc_00000"
    assert "run from other sources" in code_label(trial["code"])  # its own (empty) sources are not the checkout's


def test_the_record_is_only_added_to_and_a_failed_write_leaves_it_whole(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    first = record.append(run, {"seeds": {"run.seed": 1}})
    text = (tmp_path / "run" / RECORD_FILE).read_text()
    record.append(run, {"nodes": []}, kind=record.NODES)
    second = record.append(run, {"seeds": {"run.seed": 2}})
    after = (tmp_path / "run" / RECORD_FILE).read_text()
    assert after.startswith(text) and [e["entry"] for e in record.read(run)] == ["start", "nodes", "resume"]
    assert first["entry"] == "start" and second["entry"] == "resume" and record.read(run)[0] == first

    def crash(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="No space left"):
        record.append(run, {"seeds": {"run.seed": 3}})
    assert (tmp_path / "run" / RECORD_FILE).read_text() == after  # the old file, whole
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [RECORD_FILE]  # no temporary left


def test_a_resume_says_each_change_with_both_values_first_since_the_start_and_the_last_resume(tiny):
    cfg, inputs = tiny
    start = {"entry": "start", "time": "T0", **run_record.driver_entry(cfg, inputs)}  # as the record holds it
    assert resume_notes([], start, "run", "R") == [] and resume_notes([start], start, "run", "R") == []
    other_commit = {**start, "code": {**start["code"], "commit": "b" * 40, "dirty": False}}
    shards = start["data"]["shards"]
    other_data = {**start["data"], "shards": {**shards, "manifest": {**shards["manifest"], "sha256": "c" * 64}}}
    resumed = {**other_commit, "data": other_data, "entry": "resume", "time": "T1"}
    lines = resume_notes([start], resumed, "run", "R/raymcn_provenance.jsonl")
    was = facets(start)
    assert lines[0].startswith("note: this run continues with other code") and "R/raymcn_provenance.jsonl" in lines[0]
    assert f"  commit: {was['commit']} -> bbbbbbb" in lines
    assert f"  {MANIFEST_FACET}: {was[MANIFEST_FACET]} -> sha256 cccccccccccc ({len(inputs.shard_bytes)} shards, " \
           "64 videos)" in lines
    # resumed once on the new commit; again with another seed: since the start and since the last resume
    again = {**resumed, "seeds": {"run.seed": 7}}
    lines = resume_notes([start, resumed], again, "run", "R")
    assert "since its start (T0):" in lines
    last = lines.index("since it was last resumed (T1):")
    assert "  run.seed: 1 -> 7" in lines[last:] and not any("commit" in line for line in lines[last:])
    assert [k for k, _, _ in compare(start, start)] == []


def test_the_nodes_of_a_run_fold_by_host_and_those_that_differ_are_named(tmp_path, tiny):
    """Rank 0's part of a run's start: four ranks on two hosts, one with another torch; the record
    gains one nodes entry (not a second for the same nodes) and the lines name both values and where."""
    cfg, inputs = tiny
    run = str(tmp_path / "run")
    record.append(run, run_record.driver_entry(cfg, inputs))
    import torch

    mine = run_record.node_part(0, torch.device("cpu"))
    parts = [{**mine, "rank": 0}, {**mine, "rank": 1}, {**mine, "rank": 2, "host": "b", "torch": "9.9.9"},
             {**mine, "rank": 3, "host": "b", "torch": "9.9.9"}]
    lines = run_record.record_nodes(run, parts)
    assert lines[0].startswith("note: the nodes of this run differ")
    assert lines[1:] == [f"  torch: {mine['torch']} on the driver on {mine['host']}, {mine['host']} (ranks 0, 1); "
                         "9.9.9 on b (ranks 2, 3)"]
    nodes = record.read(run)[-1]["nodes"]
    assert [(n["host"], n["ranks"]) for n in nodes] == [(mine["host"], [0, 1]), ("b", [2, 3])]
    run_record.record_nodes(run, parts)  # a restarted group on the same nodes
    assert [e["entry"] for e in record.read(run)] == ["start", "nodes"]
    assert node_disagreements(None, [nodes[0]]) == [] and set(NODE_FACETS) >= {"torch", "Ray", "Python"}


def test_mlflows_own_tag_names_carry_the_commit(tiny, checkout, monkeypatch):
    cfg, inputs = tiny
    monkeypatch.setattr(collect, "PACKAGE_DIR", checkout.package)
    entries = [{"entry": "start", **run_record.driver_entry(cfg, inputs)}]
    tags = mlflow_tags(entries, "R")
    assert tags["mlflow.source.git.commit"] == checkout.commit and tags["mlflow.source.type"] == "LOCAL"
    assert tags["raymcn.uncommitted_changes"].startswith("patch ") and tags["raymcn.record"] == "R"
    assert all(isinstance(v, str) and len(v) <= 5000 for v in tags.values())


# --- the tables ------------------------------------------------------------------------------------------------
def write_records(exp: Path, commit_of: dict[str, str], entry: dict) -> None:
    """A record per trial of ``exp`` (search trials ``s<i>``, confirmation ``c<j>``), each with ``entry``'s
    parts and its trial's commit."""
    for trial, commit in commit_of.items():
        where = exp / ("confirm/train" if trial.startswith("c") else "train") / f"train-{trial}"
        code = {**entry["code"], "commit": commit, "dirty": False}
        record.append(str(where), {**entry, "code": code, "trial": trial})


def test_the_table_names_one_commit_once_and_two_commits_in_its_answer(confirmed, tiny, capsys):  # noqa: F811
    cfg, inputs = tiny
    entry = run_record.driver_entry(cfg, inputs)
    trials = [f"s{i}" for i in range(8)] + [f"c{j}" for j in range(8)]
    write_records(confirmed, {t: "a" * 40 for t in trials}, entry)
    assert main(["table", str(confirmed), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert out.count("commit aaaaaaa") == 1 and "code: commit aaaaaaa" in out and "Caution" not in out
    assert f"environment: Python {entry['environment']['python']}, torch {entry['environment']['torch']}" in out
    assert "data: the synthetic corpus (videos 64" in out
    from raymcn.results.summary import sweep_summary

    assert sweep_summary(confirmed, plots=False).count("commit aaaaaaa") == 1
    # two confirmation groups' runs were trained after a `git pull`
    plan = load_confirmation_groups(confirmed)
    pulled = {t: "b" * 40 for t, group in plan.items() if group in ("VT_A", "joint")}
    for trial in pulled:
        (confirmed / "confirm/train" / f"train-{trial}" / RECORD_FILE).unlink()
    write_records(confirmed, pulled, entry)
    assert main(["table", str(confirmed), "--no-plots"]) == 0
    out = capsys.readouterr().out
    answer = " ".join(out[out.index("Answer:"):].split("\n\n")[0].split())
    said = answer[answer.index("Caution: the runs compared ran on 2 codes ("):]
    groups = dict(part.split(": ", 1) for part in said[said.index("(") + 1:said.index(")")].split("; "))
    assert {code: sorted(g.split(", ")) for code, g in groups.items()} == {
        "commit aaaaaaa": ["AT_V 2", "AV_T 2"], "commit bbbbbbb": ["VT_A 2", "joint 2"]}
    assert "confound" in said
    assert "code: 2 among the runs: commit aaaaaaa (search 8, confirmation 4 runs); commit bbbbbbb " \
           "(confirmation 4 runs)" in " ".join(out.split())
    assert "Caution: the runs compared ran on 2 codes" in " ".join(sweep_summary(confirmed, plots=False).split())


def load_confirmation_groups(exp: Path) -> dict[str, str]:
    from raymcn.results.confirmation import load_confirmation

    conf = load_confirmation(exp)
    return dict(zip(conf.trials["trial"], conf.trials[ORDER]))


def test_a_sweep_without_records_says_so_once(confirmed, capsys):  # noqa: F811
    assert main(["table", str(confirmed), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert out.count("not recorded") == 1 and "Caution" not in out


# --- raymcn reproduce ---------------------------------------------------------------------------------------------
def reproduce_script(run: Path, capsys) -> str:
    capsys.readouterr()
    assert main(["reproduce", str(run)]) == 0
    return capsys.readouterr().out


def steps(script: str, first: str, last: str | None) -> str:
    """The script's lines from the comment ``# first`` up to ``# last``."""
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"# {first}"))
    end = next((i for i, line in enumerate(lines) if last and line.startswith(f"# {last}")), len(lines))
    return "\n".join(lines[start:end]) + "\n"


@pytest.mark.parametrize("name", ["", "paper-run"])
def test_reproduce_prints_commands_that_recreate_the_code_and_the_settings(name, checkout, tiny, tmp_path,
                                                                         monkeypatch, capsys):
    """Its code steps, run, give a clone with the run's sources (commit and patch); its command's
    settings file loads to the run's resolved configuration (a named run under a new name, else the
    original's folder would be continued); and it says what differs here."""
    cfg, inputs = tiny
    cfg = cfg.replace({"run.name": name})
    monkeypatch.setattr(collect, "PACKAGE_DIR", checkout.package)
    run = tmp_path / "runs" / "mcn-x"
    (run).mkdir(parents=True)
    (run / "raymcn_config.yaml").write_text(cfg.dump_text())
    recorded = record.append(str(run), run_record.driver_entry(cfg, inputs))
    script = reproduce_script(run, capsys)
    assert "# Here: the same code, environment, host and data as the record." in script
    work = tmp_path / "work"
    work.mkdir()
    subprocess.run(["bash", "-c", "set -e\n" + steps(script, "1.", "2.")], cwd=work, check=True, capture_output=True)
    clone = work / f"raymcn-{checkout.commit[:7]}"
    assert collect.source_digest(collect.source_files(clone / "raymcn")) == recorded["code"]["source_digest"]
    assert (clone / CHANGED).read_text().endswith(CHANGE)
    (command,) = [shlex.split(line) for line in script.splitlines() if line.startswith(".venv/bin/raymcn train")]
    config = command[command.index("--config") + 1]
    sets = [command[i + 1] for i, word in enumerate(command) if word == "--set"]
    assert load_config(config, sets) == (cfg.replace({"run.name": f"{name}-reproduced"}) if name else cfg)
    assert f"TORCH=torch=={recorded['environment']['torch'].split('+')[0]}" in script
    checkout.commit_all("the change, committed")  # the checkout moves on: reproduce says so
    assert f"#   commit: {recorded['code']['commit'][:7]} -> {checkout.commit[:7]}" in reproduce_script(run, capsys)


def test_reproduce_of_a_run_made_without_git_finds_its_commit_by_its_sources(tiny, tmp_path, monkeypatch, capsys):
    cfg, inputs = tiny
    checkout = make_checkout(tmp_path / "checkout")
    checkout.commit_all("clean")
    monkeypatch.setattr(collect, "PACKAGE_DIR", checkout.package)
    entry = run_record.driver_entry(cfg, inputs)
    synced = {k: v for k, v in entry["code"].items() if k in ("version", "source_digest")}
    run = tmp_path / "run"
    run.mkdir()
    (run / "raymcn_config.yaml").write_text(cfg.dump_text())
    record.append(str(run), {**entry, "code": {**synced, "origin": "sources", "commit": None}})
    script = reproduce_script(run, capsys)
    assert f"this checkout's commit {checkout.commit[:7]} has the run's sources" in script
    assert f"git checkout --detach {checkout.commit}" in script


def test_reproduce_refuses_a_folder_without_a_record(tmp_path, capsys):
    (tmp_path / "raymcn_config.yaml").write_text(load_config(preset_path(), []).dump_text())
    assert main(["reproduce", str(tmp_path)]) == 2
    assert f"no {RECORD_FILE} there" in capsys.readouterr().err


def test_a_record_line_is_json_a_reader_parses_alone(tiny, tmp_path):
    cfg, inputs = tiny
    run = str(tmp_path / "run")
    record.append(run, run_record.driver_entry(cfg, inputs))
    (line,) = (tmp_path / "run" / RECORD_FILE).read_text().splitlines()
    assert json.loads(line)["code"]["source_digest"] == collect.source_digest(collect.source_files())
