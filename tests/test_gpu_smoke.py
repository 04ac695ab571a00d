"""bench.gpu_smoke, the one command someone with a GPU runs: checked here on CPU at its smoke size
(``--device cpu --smoke``: the suite's smoke run of it), in a process where Ray cannot be imported
(the benchmark must not need it). On a machine with CUDA the ``gpu`` test runs it on the GPU and
checks the memory estimate against the peak."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import last_json

ROOT = Path(__file__).resolve().parents[1]


def _smoke(tmp_path: Path, *args: str) -> dict:
    blocked = tmp_path / "no_ray" / "ray"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("ray is not installed on this machine")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked.parent), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_smoke", *args, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert last_json(proc.stdout) == report
    return report


@pytest.mark.slow  # every variant's step on CPU: the full tier
def test_the_gpu_smoke_runs_every_variant_without_ray(tmp_path):
    report = _smoke(tmp_path, "--device", "cpu", "--smoke")
    assert set(report["variants"]) == {"plain", "cached", "ring"}
    for name, v in report["variants"].items():
        assert all(math.isfinite(x) for x in v["losses"].values()), name
        assert {"data", "forward", "loss", "backward", "optimizer"} <= set(v["phases_s"]), name
        assert v["samples_per_s"] > 0 and v["estimate_bytes"] > 0
    assert report["variants"]["cached"]["phases_s"]["reforward"] > 0  # the cached step did cache
    assert report["variants"]["plain"]["phases_s"]["reforward"] == 0
    # on one rank the ring is the gathered loss: the same terms
    plain, ring = report["variants"]["plain"]["losses"], report["variants"]["ring"]["losses"]
    assert plain.keys() == ring.keys()
    assert all(math.isclose(plain[k], ring[k], rel_tol=1e-5) for k in plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_the_estimate_is_never_below_the_peak(tmp_path):
    report = _smoke(tmp_path, "--steps", "3")
    for name, v in report["variants"].items():
        assert v["estimate_over_peak"] >= 1.0, (name, v)


def _check_comparison(report: dict, workload: str = "plain", levers: tuple[str, ...] | None = None) -> dict:
    """What every --compare row must hold: the eager row is the reference, the FLOPs are one count
    (the same arithmetic), the MFU is those FLOPs per second of step over the measured peak, a
    compiled variant says its compile time and no other does, and every variant's losses after the
    same steps from the same weights on the same batch are the eager one's up to rounding (their
    kernels sum in other orders)."""
    from bench import gpu_smoke

    rows = report["compare"][workload]
    assert list(rows) == list(levers or gpu_smoke.LEVERS)
    peak = report["matmul_peak"]["flops_per_s"]
    flops = {r["flops_per_step"] for r in rows.values()}
    assert len(flops) == 1 and flops.pop() > 0
    eager = rows["eager"]
    assert eager["vs_eager"] == 1.0 and eager["compile_s"] == 0 and eager["steps_to_repay_compile"] is None
    for name, r in rows.items():
        assert min(r["s_per_step_rounds"]) <= r["s_per_step_wall"] <= max(r["s_per_step_rounds"]), name  # the median
        assert math.isclose(r["mfu"], r["flops_per_step"] / r["s_per_step_wall"] / peak, rel_tol=1e-9), name
        assert math.isclose(r["vs_eager"], eager["s_per_step_wall"] / r["s_per_step_wall"], rel_tol=1e-9), name
        assert (r["compile_s"] > 0) == name.endswith("compiled"), (name, r["compile_s"])
        assert r["warmup_s"] >= r["compile_s"] and r["warmup_s"] > 0, name  # the compiling is part of the warm-up
        for k, v in eager["losses"].items():
            assert math.isclose(r["losses"][k], v, rel_tol=1e-3, abs_tol=1e-6), (name, k, r["losses"][k], v)
    profiled = [name for name, r in rows.items() if "kernel_profile" in r]
    if profiled:  # eager's, and the fastest other variant's
        others = [name for name in rows if name != "eager"]
        fastest = min(others, key=lambda n: rows[n]["s_per_step_wall"]) if others else None
        assert profiled == [n for n in rows if n in ("eager", fastest)], profiled
        for name in profiled:
            _check_profile(rows[name]["kernel_profile"])
    return rows


def _check_profile(ops: list[dict], top: int | None = None) -> None:
    """A kernel profile: the largest first, each a positive share of the block's time (together at
    most all of it), at least one call a step."""
    assert ops and (top is None or len(ops) <= top)
    times = [op["self_ms_per_step"] for op in ops]
    assert times == sorted(times, reverse=True) and times[-1] > 0
    assert all(0 < op["share"] <= 1 and op["calls_per_step"] > 0 and op["op"] for op in ops)
    assert sum(op["share"] for op in ops) <= 1 + 1e-9


def test_the_comparison_times_the_variants_in_turns_and_reports_each_against_eager():
    """--compare's arithmetic and turns, with a layout that needs no compiling (fast): every
    variant's rounds, one FLOP count, MFU over the measured peak, the ratio to eager."""
    from bench import gpu_smoke
    from raymcn.train.preflight.step_probe import one_rank_group

    device = torch.device("cpu")
    peak = gpu_smoke.matmul_peak(device, 256)
    assert peak["dtype"] == "float32" and peak["flops_per_s"] > 0
    with one_rank_group(device):
        rows, skipped = gpu_smoke.compare(gpu_smoke.variants(True, 8)["plain"], device, warmup=1, steps=1, rounds=2,
                                          peak_flops=peak["flops_per_s"], say=lambda line: None, levers=["1d"],
                                          profile_top=5)
    assert skipped == {}
    _check_comparison({"compare": {"plain": rows}, "matmul_peak": peak}, levers=("eager", "1d"))
    for name in ("eager", "1d"):  # the only other variant is the fastest
        _check_profile(rows[name]["kernel_profile"], top=5)
    ops = {op["op"] for op in rows["eager"]["kernel_profile"]}
    assert any("convolution" in op for op in ops), ops  # DAVEnet's convolutions are the step's largest part
    profile = gpu_smoke._profile_table("plain", "eager", rows["eager"]["kernel_profile"], "cpu")
    assert profile.startswith("plain, eager: where a step's CPU time goes (top 5)")
    assert all(len(r["s_per_step_rounds"]) == 2 for r in rows.values())
    table = gpu_smoke._compare_table("plain", rows)
    assert table.splitlines()[0].startswith("| plain | clips/s | s/step | MFU | peak | est/peak | vs eager | warm-up s |")
    assert "| eager |" in table and "| 1.00x |" in table and "n/a (CPU)" in table


def test_a_budget_leaves_out_the_builds_that_would_pass_it_and_says_why():
    """--budget bounds the building (compiling is where a GPU's minutes go): with none left, eager
    alone is built and timed, every other variant named with its reason; each build is handed to
    ``on_built`` as it ends (the partial file's), and without a budget every variant is built."""
    from bench import gpu_smoke
    from raymcn.train.preflight.step_probe import one_rank_group

    device = torch.device("cpu")
    said, handed = [], []
    with one_rank_group(device):
        rows, skipped = gpu_smoke.compare(gpu_smoke.variants(True, 8)["plain"], device, warmup=1, steps=1, rounds=1,
                                          peak_flops=1e9, say=said.append, levers=["1d", "compiled"], budget_s=0,
                                          on_built=lambda built: handed.append(dict(built)))
        assert list(rows) == ["eager"] and list(skipped) == ["1d", "compiled"]
        for name in skipped:  # the reason names the budget; no build of a compiled kind was seen to cite
            assert skipped[name].startswith("not built: ") and skipped[name].endswith(", past --budget 0 s")
            assert f"  {name}: {skipped[name]}" in said
        assert "a build of its kind takes" in skipped["1d"] and "of its kind" not in skipped["compiled"]
        assert [list(b) for b in handed] == [["eager"]] and handed[0]["eager"]["warmup_s"] > 0
        rows, skipped = gpu_smoke.compare(gpu_smoke.variants(True, 8)["plain"], device, warmup=1, steps=1, rounds=1,
                                          peak_flops=1e9, say=said.append, levers=["1d"], budget_s=1e9)
    assert list(rows) == ["eager", "1d"] and skipped == {}


def test_a_profile_that_fails_keeps_the_comparison_and_names_its_reason(monkeypatch):
    """The profile comes after the timed rounds: if it raises (a profiler the device's driver
    refuses), the rows keep their figures and say why they have no profile."""
    from bench import gpu_smoke
    from raymcn.train.preflight.step_probe import one_rank_group

    def refuse(rig, steps, top):
        raise RuntimeError("CUPTI_ERROR_INSUFFICIENT_PRIVILEGES")

    monkeypatch.setattr(gpu_smoke, "kernel_profile", refuse)
    said = []
    device = torch.device("cpu")
    with one_rank_group(device):
        rows, _ = gpu_smoke.compare(gpu_smoke.variants(True, 8)["plain"], device, warmup=1, steps=1, rounds=1,
                                    peak_flops=1e9, say=said.append, levers=["eager"], profile_top=5)
    assert rows["eager"]["s_per_step_wall"] > 0 and "kernel_profile" not in rows["eager"]
    assert rows["eager"]["kernel_profile_error"] == "RuntimeError: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES"
    assert said[-1] == "  eager: no kernel profile (RuntimeError: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES)"


def test_the_command_says_which_variants_its_budget_left_out(tmp_path):
    """`--compare --budget 0` from the command line: the table has eager alone, a line per variant
    left out, and the JSON keeps the reasons and each build's warm-up time."""
    report = _smoke(tmp_path, "--device", "cpu", "--smoke", "--compare", "--levers", "1d", "compiled",
                    "--budget", "0", "--profile-top", "0")
    assert list(report["compare"]["plain"]) == ["eager"]
    assert list(report["skipped"]["plain"]) == ["1d", "compiled"]
    assert list(report["warm_up"]["plain"]) == ["eager"]
    assert report["warm_up"]["plain"]["eager"]["warmup_s"] == report["compare"]["plain"]["eager"]["warmup_s"] > 0


@pytest.mark.slow
@pytest.mark.soak  # six variants, three of them compiled by Inductor's C++ on the CPU: minutes
def test_the_comparison_runs_every_lever_without_ray(tmp_path):
    """`python -m bench.gpu_smoke --compare` at tiny dims on a CPU, in a process without Ray: the
    header says it is a CPU, a table row per variant, the JSON's rows as _check_comparison says."""
    report = _smoke(tmp_path, "--device", "cpu", "--smoke", "--compare")
    assert report["device"] == "cpu" and report["variants"] == {}
    rows = _check_comparison(report)
    assert "kernel_profile" in rows["eager"]  # on by default


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_every_lever_keeps_the_estimate_above_its_peak(tmp_path):
    """The memory preflight with compile and each layout on a GPU: estimate >= each variant's peak."""
    report = _smoke(tmp_path, "--compare", "--steps", "2", "--rounds", "2")
    for name, v in _check_comparison(report).items():
        assert v["estimate_over_peak"] >= 1.0, (name, v)
