"""Every benchmark at its smoke size (``--smoke``): it runs to the end, and its figures have the keys
its tables and ``docs/measurements`` use, with counts that follow from the smoke size and ratios
that are finite and positive. Never a timing.

The benchmarks other tests already run count as their smoke runs and are not run again here:
``bench.kmeans`` (tests/test_dist_kmeans.py), ``bench.gpu_smoke`` (tests/test_gpu_smoke.py),
``bench.rung_correlation`` (tests/test_rung_correlation.py), ``bench.sweep_efficiency``
(tests/test_sweep_efficiency.py, slow) and ``bench.chaos`` (tests/test_chaos.py, multinode).

The benchmarks that start Ray in this process share one instance (``ray_local``, the last tests of
this file). ``bench.trial_cost``'s and ``bench.compile_cache``'s sweeps start one of their own in a
subprocess, so they run first, before that instance exists (two instances at once break Ray Train's
placement-group cleaner);
``bench.scale`` runs without its ``--ray`` conversion, which would start one too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import last_json, stop_shared_ray

from bench import (
    checkpoint,
    compile_cache,
    compression,
    drain_check,
    eval_sharding,
    grad_cache,
    harness,
    loader,
    memory,
    overhead,
    provenance,
    scale,
    shard_dtype,
    step,
    sweep_time,
    trial_cost,
)

pytestmark = pytest.mark.timeout(900)


def smoke(module, tmp_path: Path, *args: str) -> dict:
    """``module.main`` at its smoke size in this process; its figures (``--out``), its partial file gone."""
    out = tmp_path / f"{module.__name__.rsplit('.', 1)[-1]}.json"
    assert module.main(["--smoke", "--out", str(out), *args]) == 0
    assert not Path(f"{out}.partial").exists()
    figures = json.loads(out.read_text())
    assert figures["machine"] and figures["commit"] and figures["command"].startswith("python -m bench.")
    return figures


def positive(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def test_a_benchmarks_partial_file_leaves_the_checkout_it_times_clean():
    """bench.sweep_time times this checkout's own sweep while saving its progress beside ``--out``
    (docs/measurements/): git ignores that file, so the runs' provenance calls the tree clean."""
    from raymcn.provenance.collect import checkout_root, git

    root = checkout_root(Path(harness.REPO) / "raymcn")
    if root is None:
        pytest.skip("not a git checkout")
    results = harness.Results("sweep_time", argparse.Namespace(out="docs/measurements/sweep_time.json", json=False))
    # provenance's own git call: it prints an ignored path and fails on any other
    assert git(root, "check-ignore", "--no-index", str(results.partial)), f"git does not ignore {results.partial}"


def test_a_benchmark_that_dies_keeps_what_it_measured(tmp_path, capsys):
    out = tmp_path / "figures.json"
    with pytest.raises(RuntimeError, match="rank 1 aborted"):
        with harness.Results("example", argparse.Namespace(out=str(out), json=False)) as results:
            results.save(runs={"torchrun": [{"steady_samples_per_s": 100.0}]})
            raise RuntimeError("rank 1 aborted")
    saved = json.loads(Path(f"{out}.partial").read_text())
    assert saved["partial"] is True and saved["runs"] == {"torchrun": [{"steady_samples_per_s": 100.0}]}
    assert f"{out}.partial" in capsys.readouterr().err and not out.exists()
    with harness.Results("example", argparse.Namespace(out=str(out), json=True)) as results:
        results.save(runs={})
        results.finish({"runs": {}})
    assert json.loads(out.read_text())["runs"] == {} and not Path(f"{out}.partial").exists()
    assert last_json(capsys.readouterr().out)["machine"]


def test_the_figures_name_the_machine_the_commit_and_the_command(tmp_path):
    """Every benchmark's JSON says where it comes from, whether it ran from a shell or a test: the
    command as typed, the checkout's commit; a key the benchmark set itself is kept."""
    import subprocess

    out = tmp_path / "figures.json"
    p = harness.parser("An example.", smoke="nothing")
    args = harness.parse_args(p, ["--smoke", "--out", str(out)])
    with harness.Results("example", args) as results:
        results.finish({"machine": "as the benchmark saw it"})
    figures = json.loads(out.read_text())
    head = subprocess.run(["git", "-C", str(harness.REPO), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert figures["commit"] == head and figures["machine"] == "as the benchmark saw it"
    assert figures["command"] == f"python -m bench.example --smoke --out {out}"


def test_a_benchmarks_help_describes_it_by_its_docstrings_whole_first_paragraph():
    """A first sentence wrapped over two lines reads whole in ``--help``, not cut at the line's end;
    the usage examples after the blank line stay out."""
    doc = "Example: the step, timed;\nwith --x, side by side.\n\n    python -m bench.example --x\n"
    assert harness.parser(doc, smoke="nothing").description == "Example: the step, timed; with --x, side by side."


ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 vaes\n\n"


@pytest.mark.parametrize("cpuinfo, name", [
    (ZEN3 + ZEN3.replace("processor\t: 0", "processor\t: 1"), "AMD EPYC (family 25 model 1 AVX2)"),
    (ZEN3.replace(": 25", ": 26").replace(": 1\nmodel name", ": 2\nmodel name").replace("avx2", "avx2 avx512f"),
     "AMD EPYC (family 26 model 2 AVX-512)"),
    ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n\n", "unknown CPU"),  # aarch64: no model name
])
def test_the_machine_line_tells_cpu_generations_with_one_model_name_apart(cpuinfo, name):
    """A VM's model name may be a bare "AMD EPYC" on a Zen 3 and on a Zen 5 (the embedded default
    sweep took more than twice as long on the first): the family, model and widest vector extension
    of the first processor tell them apart."""
    assert harness.cpu_name(cpuinfo) == name
    assert harness.machine_line().split(", ")[0].startswith(harness.cpu_name(Path("/proc/cpuinfo").read_text()))


# --- no Ray ----------------------------------------------------------------------------------------------------
def test_chaos_charges_each_restart_to_the_fault_before_it(tmp_path):
    """bench.chaos's steps lost per fault, from rank 0's step trace: two trials of 4 steps. A
    restart (a step run again) is charged to the first fault struck at its line, else to the last
    fault before it; a new trial (step 0 after the last step) is no restart."""
    from bench.chaos import steps_replayed

    steps = [0, 1, 2, 2, 3, 0, 1, 2, 1, 2, 3]  # trial 1 restarts at line 3, trial 2 at line 8
    (tmp_path / "rank0.jsonl").write_text("".join(json.dumps({"step": s, "total_loss": 1.0}) + "\n" for s in steps))
    faults = [{"trace_at": 3}, {"trace_at": 7}, {"trace_at": 8}, {"trace_at": 8}]  # the last during the restart
    assert steps_replayed(tmp_path, faults) == [1, 0, 2, 0]
    assert steps_replayed(tmp_path, [{"trace_at": 2}, {"trace_at": 6}]) == [1, 2]  # struck a line early: the last before


@pytest.mark.slow  # over 8 s at smoke size: the full tier
@pytest.mark.soak  # a benchmark's smoke: before a release
def test_scale(tmp_path):
    figures = smoke(scale, tmp_path, "--no-ray")
    assert [s["fraction"] for s in figures["scales"]] == [4000, 2000]
    for s in figures["scales"]:
        assert s["captions"] == scale.HOWTO100M_CAPTIONS // s["fraction"]
        assert positive(s["pickle_bytes"], s["unpickle_peak"], s["bytes_per_pickle_byte"], s["store_bytes"])
        assert s["local"]["writers"] >= 1 and positive(s["local"]["writer_pss_max"], s["local"]["driver_pss"])
    train = figures["training"]
    assert train["videos"] == 20_000 and positive(train["manifest_bytes"], train["steps_per_epoch"], train["peak"])


def test_sweep_time(tmp_path):
    """At its smoke size the benchmark times `sweep.py --help` in HEAD's tree and in this checkout."""
    figures = smoke(sweep_time, tmp_path)
    assert figures["baseline"] == "HEAD"
    for which in ("baseline", "current"):
        (run,) = figures["runs"][which]
        assert positive(run["wall_s"], run["lines"], figures["median_wall_s"][which])
        assert run["cpu_s"] >= 0 <= run["others_cpu_s"]  # a --help can end before the sampler's first reading
    (current,) = figures["runs"]["current"]
    shown = sweep_help()
    assert current["lines"] == len(shown) and current["stdout_tail"] == shown[-len(current["stdout_tail"]):]


def sweep_help() -> list[str]:
    """``sweep.py --help``'s lines in this checkout, as ``bench.sweep_time``'s child prints them."""
    proc = subprocess.run([sys.executable, "sweep.py", "--help"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=120, check=True,
                          env={**os.environ, "RAY_ADDRESS": "local"})
    return proc.stdout.splitlines()


def test_provenance(tmp_path):
    figures = smoke(provenance, tmp_path)
    parts = ("code_s", "environment_s", "host_s", "data_s", "entry_and_append_s", "node_part_s")
    assert positive(*(figures["driver"][k] for k in parts), figures["data"]["manifest_digest_s"],
                    figures["data"]["word_vectors_digest_s"])
    assert figures["data"]["manifest_mb"] == pytest.approx(provenance.SMOKE["manifest_mb"] * (1 << 20) / 1e6)
    assert figures["data"]["word_vectors_gb"] == pytest.approx(provenance.SMOKE["word_vectors_gb"])
    assert figures["lab_run_start_s"] == pytest.approx(figures["driver"]["entry_and_append_s"] + sum(
        figures["data"][k] for k in ("manifest_digest_s", "word_vectors_digest_s")))


def test_compression(tmp_path):
    figures = smoke(compression, tmp_path)
    assert [(r["features"], r["codec"]) for r in figures["codecs"]] == [
        (kind, codec) for kind in ("relu", "pooled") for codec in ("zstd-1", "zstd-3", "lz4")]
    for r in figures["codecs"]:
        assert positive(r["ratio"], r["decode_mb_s"], r["videos_s"], r["vs_uncompressed"])
        assert r["ratio"] > 1  # half the relu features are zeros, a tenth of the pooled ones


def test_memory(tmp_path):
    figures = smoke(memory, tmp_path)
    assert [(r["N"], r["negatives"]) for r in figures["loss"]] == [
        (n, neg) for n in (1, 2) for neg in ("gathered", "ring")]
    for r in figures["loss"]:
        assert r["B"] == 256 and r["b"] == 256 // r["N"]
        assert positive(r["ratio"], r["estimate_over_measured"], r["raymcn_peak"], r["dataparallel_peak"])
    assert [r["queue_dtype"] for r in figures["refit"]] == ["float32", "bfloat16"]
    for r in figures["refit"]:  # allocator bytes, not time: building X straight into place saves a copy
        assert positive(r["peak_lean"], r["estimate"]) and r["peak_lean"] < r["peak_current"]


def test_eval_sharding(tmp_path):
    figures = smoke(eval_sharding, tmp_path)
    assert figures["same"] is True and figures["settings"]["clips"] == 16
    assert set(figures["median_s"]) == {"every rank, whole set (before)", "sharded, scored once (now)"}
    assert positive(*figures["median_s"].values())


@pytest.mark.slow  # over 8 s at smoke size: the full tier
@pytest.mark.soak  # a benchmark's smoke: before a release
def test_step(tmp_path):
    figures = smoke(step, tmp_path)
    assert [r["clips"] for r in figures["rows"]] == [4, 8]
    for r in figures["rows"]:
        assert set(r["terms_measured"]) == set(step.TERMS) == set(r["terms_estimated"])
        assert positive(r["peak_alloc_bytes"], r["peak_fwd_bwd_bytes"], r["saved_activation_bytes"],
                        r["estimate"]["total"])
    summary = figures["summary"]
    assert positive(*summary["estimate_over_measured"], *summary["fwd_bwd_estimate_over_measured"])


@pytest.mark.slow  # over 8 s at smoke size: the full tier
@pytest.mark.soak  # a benchmark's smoke: before a release
def test_grad_cache(tmp_path):
    figures = smoke(grad_cache, tmp_path)
    assert [(r["clips"], r["chunk"]) for r in figures["step"]] == [(64, 0), (64, 32)]
    for r in figures["step"]:
        assert positive(r["peak_alloc_bytes"], r["estimate"]["total"])
    bn = figures["bn"]
    assert [r["chunk"] for r in bn["rows"]] == [32, 64]
    control = bn["rows"][-1]  # one chunk of every clip: the plain step's BatchNorm statistics
    assert control["grads"]["all"]["rel"] < 1e-4 and control["grads"]["all"]["cos"] == pytest.approx(1.0, rel=1e-4)
    assert [m["device"] for m in figures["preflight"]] == ["24 GB", "40 GB (A100)"]


# --- Ray: bench.trial_cost's own instance first, then one for all the others ---------------------------------
@pytest.mark.ray
@pytest.mark.soak  # a benchmark's smoke over a minute: before a release
@pytest.mark.slow
def test_trial_cost(tmp_path):
    """First of the Ray tests: its sweep starts a Ray instance of its own (run with the others'
    instance, its Tune trials would not see the sweep's RAYMCN_TIMELINE)."""
    figures = smoke(trial_cost, tmp_path)
    (run,) = figures["runs"]["current"]
    assert figures["trials_per_sweep"] == 1 and len(run["trials"]) == 1
    (trial,) = run["trials"]
    assert positive(trial["wall_s"], trial["steps_s"]) and math.isfinite(trial["fixed_s"])
    assert {"plan (the trial's run plan)", "fit() -> every rank in the worker function", "epochs: steps"} <= set(
        trial["items_s"])
    assert positive(figures["steady"]["current"]["wall_s"])


@pytest.mark.ray
@pytest.mark.soak  # a benchmark's smoke over a minute (two compiled trials): before a release
@pytest.mark.slow
def test_compile_cache(tmp_path):
    """Second of the Ray tests: its sweep starts a Ray instance of its own, whose processes get the
    benchmark's empty TORCHINDUCTOR_CACHE_DIR (the suite's instance, started before, would not).
    Both trials trace the model in new worker processes, so both count the same graphs."""
    stop_shared_ray()  # a previous module's instance: ours to stop (ray_local starts it again)
    figures = smoke(compile_cache, tmp_path)
    assert figures["settings"]["epochs"] == 1
    first, second = figures["trials"]
    assert sorted([first["optim.lr"], second["optim.lr"]]) == sorted(compile_cache.LEARNING_RATES)
    for trial in (first, second):
        assert [e["epoch"] for e in trial["epochs"]] == [1]
        assert trial["compiled_graphs"] >= 1 and positive(trial["time_compile_s"], trial["wall_s"])
    assert second["compiled_graphs"] == first["compiled_graphs"]
    assert figures["second_over_first"]["compiled_graphs"] == 1.0
    assert positive(figures["second_over_first"]["time_compile_s"], figures["second_over_first"]["wall_s"])
    assert figures["inductor_cache"]["files"] > 0  # the trials' workers compiled into the benchmark's folder


@pytest.mark.ray
@pytest.mark.slow  # a Ray Train run or a sweep: the slow tier
@pytest.mark.soak  # a benchmark's smoke: before a release
def test_loader(ray_local, tmp_path):
    figures = smoke(loader, tmp_path, "--workdir", str(tmp_path / "work"))
    row = figures["results"]["short"]
    d = row["dtypes"]["float16"]
    assert row["videos"] == 32 and positive(row["a"]["videos_per_s"], row["a2"]["videos_per_s"])
    for key in ("b", "c", "c2", "d", "d2"):
        assert positive(d[key]["videos_per_s"], d[key]["mb_per_s"]), key
    assert d["b"]["videos"] == d["c2"]["videos"] == 32 and d["b"]["bad"] == 0  # 4 steps of 8 videos, read once
    assert set(d["ratios"]) == {"b_over_a", "b_over_a2", "b_over_c", "c2_over_c", "b_over_c2", "b_over_d",
                                "b_over_d2"}
    assert positive(*d["ratios"].values())


@pytest.mark.ray
@pytest.mark.slow  # a Ray Train run or a sweep: the slow tier
@pytest.mark.soak  # a benchmark's smoke: before a release
def test_checkpoint(ray_local, tmp_path):
    figures = smoke(checkpoint, tmp_path, "--workdir", str(tmp_path / "work"))
    assert positive(figures["size_bytes"], figures["save_s"], figures["load"]["load_s"])
    assert {"model", "optimizer", "objective"} <= set(figures["parts_bytes"])
    assert [r["mode"] for r in figures["stalls"]["local"]] == ["async"] and "not_measured" not in figures
    for r in figures["stalls"]["local"]:
        assert positive(r["stall_s"], r["upload_s"])
    assert positive(figures["planning"]["at_0"]["steps_planned"], figures["planning"]["at_90"]["steps_planned"])
    assert figures["first_batch"]["videos"] == 16 and positive(figures["first_batch"]["at_90"]["seconds"])


@pytest.mark.ray
@pytest.mark.soak  # a benchmark's smoke over a minute: before a release
@pytest.mark.slow  # a Ray Train run or a sweep: the slow tier
def test_overhead(ray_local, tmp_path, capsys):
    """Both smoke arms ran their 2 epochs to the end: among them the torchrun arm, whose ranks
    must exit cleanly (a rank's abort at exit fails the arm)."""
    figures = smoke(overhead, tmp_path)
    assert list(figures["runs"]) == list(overhead.SMOKE_ARMS)
    for arm, (run,) in figures["runs"].items():
        assert len(run["epoch_samples_per_s"]) == 2 and positive(run["steady_samples_per_s"]), arm
        assert [r["rank"] for r in run["ranks"]] == [0, 1], arm  # both ranks entered and were timed
    assert list(figures["attribution"]) == ["all of Ray (1 -> 4)"]
    assert positive(*figures["attribution"]["all of Ray (1 -> 4)"].values())
    # --from: the tables again from what a partial file holds (here: every arm of the run)
    partial = tmp_path / "overhead.json.partial"
    partial.write_text(json.dumps({"machine": figures["machine"], "runs": figures["runs"],
                                   "settings": {k: figures[k] for k in ("workers", "epochs", "repeats", "overrides")}}))
    capsys.readouterr()
    assert overhead.main(["--from", str(partial), "--json"]) == 0
    again = last_json(capsys.readouterr().out)
    assert again["steady_samples_per_s"] == figures["steady_samples_per_s"]
    assert again["attribution"] == figures["attribution"]


@pytest.mark.ray
@pytest.mark.slow  # a Ray Train run or a sweep: the slow tier
@pytest.mark.soak  # a benchmark's smoke: before a release
def test_drain_check(ray_local, tmp_path):
    figures = smoke(drain_check, tmp_path)
    ranks = figures["raw"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(len(r["ask_s"]) == 1 for r in ranks)
    assert all(r["answers_none"] for r in ranks)  # nothing drained: every rank got None every time
    assert positive(figures["ask_ms"], figures["broadcast_ms"], *figures["share_of_step"].values())
    under = [int(n) for n, share in figures["share_of_step"].items() if share < 0.01]
    assert figures["chosen_every"] == (min(under) if under else None)  # the smallest N under 1 %


@pytest.mark.ray
@pytest.mark.slow  # a Ray Train run or a sweep: the slow tier
@pytest.mark.soak  # a benchmark's smoke over a minute: before a release
def test_shard_dtype(ray_local, tmp_path):
    figures = smoke(shard_dtype, tmp_path)
    assert figures["bytes"]["float16"] < figures["bytes"]["float32"]  # the features at 2 bytes instead of 4
    for dtype in shard_dtype.DTYPES:
        (curve,) = figures["loss_curves"][dtype]
        assert len(curve) == 1 and positive(*curve)
    assert math.isfinite(figures["largest_loss_gap"])
    assert set(figures["summary"]) == {*shard_dtype.METRICS, "total_loss"}

