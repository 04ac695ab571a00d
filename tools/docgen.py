"""Every measured figure and every captured console block of the README and docs/*.md, written from
its file under docs/measurements/ (no figure is typed on a page).

A page marks what is generated with an HTML comment pair, which Markdown does not show::

    fp16 shards read <!-- gen:loader.fp16 -->180<!-- /gen --> videos/s   (inline)
    <!-- gen:sweep.end -->                                              (a block: the text on
    ...                                                                  its own lines)
    <!-- /gen -->

``python -m tools.docgen`` rewrites what lies between each pair from :data:`GENERATORS`;
``--check`` writes nothing and exits 1 naming every page that differs (``tests/test_docs.py``
runs it). ``--capture NAME`` reruns a cheap, deterministic command and stores its console text as
``docs/measurements/NAME.txt`` (:data:`CAPTURES`); the long runs (a sweep, the benchmarks) store
theirs in their own JSON (``bench.sweep_time`` keeps the end of ``make sweep`` it ran) or text
(``tools.ray_results``: Ray's result API on a finished ``make sweep``).

A JSON carries what its run recorded (bench.harness stamps machine, commit and command), nothing
added by hand; the commit that wrote its figures comes from git (:func:`written_at`), and
``run.NAME`` shows both beside a benchmark's figures: every page says at which commit its figures
were measured. ``--stale`` lists a JSON as stale only when a change does alter its figures: a
measurement with a quick form (:data:`QUICK`, e.g. the preflight's messages, computed rather than
measured) is recomputed from today's code, here and by ``tests/test_docs.py``; every other one is
judged by whoever reads its commit on the page, so a later commit never makes it stale and never
asks for a note (:data:`HELD` only tells the reader what a change left as it was). The
measurements are read, never recomputed by the pages: a figure changes when its command is rerun
and its JSON replaced, then this script is run. Two tables are not measurements: development.md's list of the
documented commands, from ``tools/doc_commands.py``, and sweeps.md's table of the metrics, from
``raymcn/config/metrics.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "docs" / "measurements"
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "settings.md")]
MARK = re.compile(r"<!-- gen:([\w.-]+) -->(.*?)<!-- /gen -->", re.DOTALL)


@functools.cache
def m(name: str) -> dict:
    """docs/measurements/NAME.json."""
    return json.loads((MEASURED / f"{name}.json").read_text())


def txt(name: str) -> str:
    """docs/measurements/NAME.txt, a captured console text."""
    return (MEASURED / f"{name}.txt").read_text().rstrip("\n")


def table(header: list[str], rows: list[list], right: int = 1) -> str:
    """A Markdown table; columns from ``right`` on are right-aligned."""
    align = ["---" if i < right else "---:" for i in range(len(header))]
    lines = [header, align, *[[str(c) for c in r] for r in rows]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def fence(text: str) -> str:
    return f"```\n{text}\n```"


def minsec(seconds: float) -> str:
    """``12 min 60 s`` never: whole seconds first (779.6 s is 13 min 0 s)."""
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60} s"


def ci(lo: float, hi: float, fmt: str = ".1f") -> str:
    return f"[{lo:{fmt}}, {hi:{fmt}}]"


# --- where and how each measurement was made --------------------------------------------------------------
# What bench.harness (and tools.test_durations) stamp on the figures they write. JSONs written before the
# harness stamped carry only what their run recorded; nothing is filled in by hand (tests/test_docs.py).
STAMP = ("machine", "commit", "commit_note", "command")
NOT_RECORDED = "machine not recorded"


def machine(name: str) -> str:
    """NAME.json's machine, short: ``AMD EPYC, 2 cores, torch 2.13.0+cpu`` (the host's name and the
    thread count left out); for a GPU's figures the GPU, torch and CUDA; :data:`NOT_RECORDED` for a
    run that recorded none."""
    f = m(name)
    if f.get("gpus"):
        return f"{f['gpus'][0]}, torch {f['torch']}, CUDA {f['cuda']}"
    if not f.get("machine"):
        return f"{f['cpus']} CPUs, model not recorded" if f.get("cpus") else NOT_RECORDED
    line = re.sub(r", [^,]+(?=, torch )", "", f["machine"])  # the host's name
    return re.sub(r"\(R\)| Processor| with \d+ threads?", "", line)


# Notes about a run's provenance that older versions of some JSONs carried, added by hand (no run writes them).
_HAND_NOTES = ("machine_note", "commit_note", "command_note", "note", "preflight_note")


def _figures(recorded: dict, top: bool = True) -> dict:
    """A JSON's figures: all of it but the stamp and any note about where it came from."""
    return {k: _figures(v, False) if isinstance(v, dict) else v for k, v in recorded.items()
            if not (top and k in STAMP) and k not in _HAND_NOTES}


@functools.cache
def written_at(name: str) -> str | None:
    """The commit that wrote NAME.json's figures as they are today, from git: the oldest commit of the
    newest run of the file's versions that hold every figure of today's (the stamp aside; a later
    version may have dropped some). The code measured is that commit's or older. None while the
    figures are not committed yet."""
    path = f"docs/measurements/{name}.json"
    today, found = _figures(m(name)), None
    for commit in _git("log", "--format=%h", "--", path).stdout.split():
        then = _git("show", f"{commit}:{path}")
        held = _figures(json.loads(then.stdout)) if then.returncode == 0 else {}
        if any(held.get(key, held) != value for key, value in today.items()):
            break
        found = commit
    return found


def recorded_commit(name: str) -> str | None:
    """The commit NAME.json's run recorded (bench.harness stamps it), or None."""
    commit = m(name).get("commit")
    return commit if commit and commit != "unknown" else None


def rerun(name: str) -> str:
    """The command that writes NAME.json again today: the one its run recorded, else :data:`RERUN`'s
    (filled in from the settings the JSON records)."""
    return m(name).get("command") or RERUN[name].format(**m(name))


def ran(name: str) -> str:
    """Where NAME.json's figures come from, as a page shows it beside them: ``python -m bench.kmeans
    --json`` (AMD EPYC, 2 cores, torch 2.13.0+cpu; commit f6a06d7); for a run that recorded less,
    what it did not record, and the commit that wrote its JSON."""
    recorded, commit = m(name).get("command"), recorded_commit(name)
    if recorded and commit:
        note = f"; {m(name)['commit_note']}" if m(name).get("commit_note") else ""
        return f"`{recorded}` ({machine(name)}; commit {commit}{note})"
    f = m(name)
    has_machine = bool(f.get("machine") or f.get("gpus"))
    where = [machine(name)] if has_machine else [f"{f['cpus']} CPUs"] if f.get("cpus") else []
    unknown = [what for what, known in (("command", recorded), ("machine", has_machine)) if not known]
    where += [f"{' and '.join(unknown)} not recorded"] if unknown else []
    return f"`{rerun(name)}` ({'; '.join([*where, f'written at {written_at(name)}'])})"


# The measurements whose command and machine a page shows (``run.NAME``).
SHOWN_RUNS = ("chaos", "test_durations", "drain_check", "eval_sharding", "grad_cache", "kmeans", "loader",
              "loader_short_and_long", "memory", "overhead", "preflight", "rung_correlation", "scale", "shard_dtype",
              "sweep_efficiency", "sweep_time", "trial_cost", "compression", "compile_cache")


# --- the first GPU: bench.gpu_smoke and the runs of gpu_runs.json ------------------------------------------
def gpu_where() -> str:
    g = m("gpu_runs")
    return (f"one {g['gpus'][0]} (torch {g['torch']}, CUDA {g['cuda']}, ray {g['ray']}; transcribed from the runs' "
            f"logs, written at {written_at('gpu_runs')})")


def gpu_smoke() -> str:
    rows = [[name, v["clips"], f"{v['s_per_step_wall']:.3f}", f"{v['samples_per_s']:.0f}", f"{v['peak_bytes'] / 2**30:.2f}",
             f"{v['estimate_bytes'] / 2**30:.2f}", f"{v['estimate_over_peak']:.2f}"]
            for name, v in m("gpu_smoke")["variants"].items()]
    return table(["variant", "clips", "s per step", "samples/s", "peak GiB", "estimate GiB", "estimate / peak"], rows)


def gpu_ratios() -> str:
    r = [v["estimate_over_peak"] for v in m("gpu_smoke")["variants"].values()]
    return f"{min(r):.2f}–{max(r):.2f}"


def gpu_today() -> str:
    """Today's estimate of bench.gpu_smoke's workloads over the peaks its GPU run measured: computed
    from today's code (the model traced on this machine), the peaks read from gpu_smoke.json."""
    from bench.gpu_smoke import todays_estimate_over_peak

    r = todays_estimate_over_peak(m("gpu_smoke")).values()
    return f"{min(r):.2f}–{max(r):.2f}"


def gpu_tier() -> str:
    t = m("gpu_runs")["gpu_tier"]
    return f"{len(t['passed'])} passed, {len(t['skipped'])} skipped ({', '.join(sorted(set(t['skipped'].values())))})"


# What each test of the gpu tier checks, for the sentence that says what is unrun.
GPU_TESTS = {
    "test_on_two_gpus_a_prefetch_thread_feeding_gpu_1_leaves_no_context_on_gpu_0": "a rank on GPU 1 leaving GPU 0 alone",
    "test_on_gpus_the_multi_rank_run_under_nccl":
        "NCCL between 2–4 ranks with SyncBatchNorm, evaluation and a resume on GPU",
    "test_on_gpus_the_paper_step_peaks_below_the_estimate_at_each_rank": "the 4 ranks' memory at the paper's step",
}


def gpu_unrun() -> str:
    """What the gpu tier skipped on the GPUs it had: each skipped test's subject."""
    return "; ".join(GPU_TESTS[t.split("::")[1]] for t in m("gpu_runs")["gpu_tier"]["skipped"])


def gpu_data_phase() -> str:
    """The data phase of bench.gpu_smoke's plain step: the batch's wait, its pinning and copy."""
    v = m("gpu_smoke")["variants"]["plain"]
    return f"{v['phases_s']['data'] * 1e3:.1f} ms of a {v['s_per_step_wall']:.3f} s step on {m('gpu_smoke')['gpus'][0]}"


def _gpu_tests() -> list[str]:
    """Every test of the suite marked ``gpu`` (FILE::NAME), read from the test files' source."""
    import ast

    found = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("mark.gpu" in ast.unparse(d) for d in node.decorator_list):
                found.append(f"tests/{path.name}::{node.name}")
    return found


def gpu_not_yet_run() -> str:
    """How many of the gpu tier's tests today were not in the run gpu_runs.json records."""
    t = m("gpu_runs")["gpu_tier"]
    ran = set(t["passed"]) | set(t["skipped"])
    tests = _gpu_tests()
    return f"{sum(x not in ran for x in tests)} of its {len(tests)} tests today came after that run"


def gpu_train() -> str:
    t = m("gpu_runs")["train"]
    return (f"{t['epochs']} epochs, held-out R@10 {t['text_to_video_R@10']:.1f}; only "
            f"`{'`, `'.join(t['processes_on_the_gpu'])}` on the GPU, never the driver")


def gpu_sweep() -> str:
    s = m("gpu_runs")["sweep"]
    return (f"{s['trials_finished']} of its {s['trials']} trials trained its {s['epochs_per_trial']} epochs through "
            f"Tune before the run's {s['timeout_s']} s limit")


def gpu_doctor() -> str:
    d = m("gpu_runs")["doctor_step"]
    (row, why), = d["failed"].items()
    return f"{d['rows_passed']} rows passed; `{row}` failed {d['failed_note']}"


# --- the loader at HowTo100M size (bench.loader --sizes long --repeat 3) -------------------------------
def _long() -> dict:
    return m("loader")["results"]["long"]


def _vps(dtype: str, arm: str = "b") -> float:
    return _long()["dtypes"][dtype][arm]["videos_per_s"]


def _original() -> float:
    """The original loader at its best: one `np.load` per npz file in 4 processes (a DataLoader's
    workers), the honest baseline (arm a2; the single process, arm a, is slower)."""
    return _long()["a2"]["videos_per_s"]


LOADER_ARMS = [("a", "(a) original: one `np.load` per npz, 1 process"), ("a2", "(a2) the same, 4 processes (a DataLoader's workers)"),
               ("b", "**(b) raymcn: per-rank step reads, CRC, 32 clips drawn**"),
               ("c2", "(c2) (b)'s work in one process without Ray"), ("d2", "(d2) `cat` of the shard bytes, 4 at once")]
# The JSON also holds (c), a sequential tar reader, and (d), one `cat`: between the rows shown.


def loader_full() -> str:
    def cell(dtype: str, arm: str) -> str:
        r = _long()[arm] if arm in ("a", "a2") else _long()["dtypes"][dtype][arm]
        return f"{r['videos_per_s']:.0f} ({r['mb_per_s']:.0f})"

    rows = [[label, cell("float32", arm), cell("float16", arm)] for arm, label in LOADER_ARMS]
    return table(["videos/s (MB/s)", f"fp32 shards, {_long()['dtypes']['float32']['mb_per_video']:.2f} MB/video",
                  f"fp16 shards, {_long()['dtypes']['float16']['mb_per_video']:.2f} MB/video"], rows)


def loader_short_long() -> str:
    res = m("loader_short_and_long")["results"]
    rows = []
    for size, label in (("short", "short, ~0.33 MB"), ("long", "HowTo100M-like, ~10 MB")):
        cells = []
        for d in ("float32", "float16"):
            b, c2 = res[size]["dtypes"][d]["b"]["videos_per_s"], res[size]["dtypes"][d]["c2"]["videos_per_s"]
            cells += [f"{b:.0f} / {c2:.0f}", f"{b / c2:.2f}"]
        rows.append([f"{label} ({res[size]['videos']})", *cells])
    return table(["videos", "fp32: (b) / (c2) videos/s", "(b)/(c2)", "fp16: (b) / (c2) videos/s", "(b)/(c2)"], rows)


# --- shards: fp16 against fp32 (bench.shard_dtype) --------------------------------------------------
def shard_bytes() -> str:
    b = m("shard_dtype")["bytes"]
    return f"{b['float16'] / b['float32']:.2f}"


def shard_dtype_paired() -> str:
    s, names = m("shard_dtype")["summary"], {"text_to_video_R@1": "R@1", "text_to_video_R@5": "R@5",
                                            "text_to_video_R@10": "R@10", "text_to_video_MedR": "MedR", "total_loss": "final loss"}
    rows = [[label, f"{s[k]['float32'][0]:.2f}", f"{s[k]['float16'][0]:.2f}", f"{s[k]['difference'][0]:+.2f} {ci(*s[k]['difference'][1:], '.2f')}"]
            for k, label in names.items()]
    return table([f"mean over seeds {', '.join(map(str, m('shard_dtype')['seeds']))}", "fp32 shards", "fp16 shards",
                  "fp16 − fp32, paired, 95 % interval"], rows)


# --- the embedded default sweep (bench.sweep_time) ---------------------------------------------------
def sweep_wall() -> str:
    return minsec(m("sweep_time")["median_wall_s"]["current"])


def sweep_before() -> str:
    return minsec(m("sweep_time")["median_wall_s"]["baseline"])


def _tail() -> list[str]:
    return m("sweep_time")["runs"]["current"][-1]["stdout_tail"]


def _short_paths(line: str) -> str:
    return re.sub(r"/tmp/raymcn-sweeptime-\w+/results-current-\d+", "~/raymcn_results", line)


def sweep_end() -> str:
    """What the end of `make sweep` printed, from its phase lines on (paths shortened to the default
    results folder)."""
    tail = _tail()
    start = next(i for i, line in enumerate(tail) if line.startswith("search: "))
    return fence("\n".join(_short_paths(line) for line in tail[start:]).rstrip())


def sweep_progress() -> str:
    """The last per-trial and per-epoch lines the same sweep printed before its end."""
    tail = _tail()
    end = next(i for i, line in enumerate(tail) if line.startswith("search: "))
    lines = [line for line in tail[:end] if line.startswith("trial ") or re.match(r"\S+ epoch \d+/\d+ ", line)]
    return fence("\n".join(lines[-5:]))  # (a status table printed between them is left out)


def sweep_runs() -> str:
    n = len(m('sweep_time')['runs']['current'])
    return f"the median of {n} runs" if n > 1 else "1 run"


def sweep_lines() -> str:
    runs = m("sweep_time")["runs"]
    return f"{runs['current'][-1]['lines']} console lines (before: {runs['baseline'][-1]['lines']})"


# --- faults under a soak (bench.chaos) ---------------------------------------------------------------
def chaos() -> str:
    c = m("chaos")
    kinds = ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in c["per_kind"].items())
    return table(["", ""], [
        ["faults injected", f"{len(c['faults'])}: {kinds}"],
        ["worker-group restarts", str(c["restarts"])],
        ["SIGSTOPped ranks named by a stall record", _named(c["faults"])],
        ["drains answered by a checkpoint at once (registered before the deadline)",
         f"{c['drains_answered']} of {c['per_kind']['drain_node']} ({c.get('drains_registered', 0)})"],
        ["steps run again per reboot (a checkpoint every 2 steps)", _reboots(c["steps_lost"])],
        ["wall time", f"quiet {c['quiet_s']:.0f} s, under faults {c['loud_s']:.0f} s ({c['lost_per_fault_s']:.1f} s per fault)"],
        ["trials whose per-epoch metrics differ from the quiet sweep's", str(len(c["differences"]))],
        ["the same answer line", "yes" if c["same_answer"] else "no"]])


def _reboots(lost: dict[str, list[int]]) -> str:
    """``planned 0–1 in 3; unplanned (node lost, head) 0–2 in 6``: the soak's steps run again."""
    def span(values: list[int]) -> str:
        low, high = min(values, default=0), max(values, default=0)
        return f"{low}–{high}" if low != high else str(high)

    planned, unplanned = lost["drain_node"], lost["lose_node"] + lost["reboot_head"]
    return f"planned {span(planned)} in {len(planned)}; unplanned (node lost, head) {span(unplanned)} in {len(unplanned)}"


def _named(faults: list[dict]) -> str:
    """``4 of 7, 13–17 s after the stop`` from the soak's stall_rank faults (bench.chaos's details)."""
    stops = [f["detail"] for f in faults if f["kind"] == "stall_rank"]
    waits = [int(re.search(r" for (\d+) s ", d).group(1)) for d in stops if "(named by the watchdog)" in d]
    span = f"{min(waits)}" if waits and min(waits) == max(waits) else f"{min(waits, default=0)}–{max(waits, default=0)}"
    return f"{len(waits)} of {len(stops)}" + (f", {span} s after the stop" if waits else "")


# --- memory ------------------------------------------------------------------------------------------
def _preflight(device: str) -> dict:
    return next(p for p in m("preflight")["preflight"] if p["device"].startswith(device))


def preflight_24gb() -> str:
    return fence(textwrap.fill(_preflight("24 GB")["message"], 118))


def preflight_a100() -> str:
    p = _preflight("40 GB")
    est, usable = re.search(r"estimated ([\d.]+) GiB .*?= ([\d.]+) GiB\)", p["message"]).groups()
    then = re.search(r"estimated ([\d.]+) GiB", p["then"]).group(1)
    return f"{est} GiB of {usable} usable; with caching {then} GiB"


def grad_cache() -> str:
    rows, plain = [], {}
    for s in m("grad_cache")["step"]:
        peak, ph = s["peak_alloc_bytes"] / 1e9, s["phase_s"]
        if not s["chunk"]:
            plain[s["clips"]] = s
        base = plain.get(s["clips"])
        rel = [f"{s['step_s'] / base['step_s']:.2f}", f"{s['peak_alloc_bytes'] / base['peak_alloc_bytes']:.2f}"] if s["chunk"] else ["–", "–"]
        rows.append([s["clips"], s["chunk"] or "off", f"{peak:.2f}", f"{s['estimate']['total'] / s['peak_alloc_bytes']:.2f}",
                     f"{s['step_s']:.1f}", f"{ph['forward']:.1f}", f"{ph['backward']:.1f}", f"{ph['reforward']:.1f}" if s["chunk"] else "–", *rel])
    return table(["clips", "chunk", "peak GB", "estimate / peak", "step s", "forward", "backward", "re-forward",
                  "time / plain", "peak / plain"], rows, right=0)


def grad_cache_slopes() -> str:
    s = m("grad_cache")["slopes"]
    return f"{s['off']['bytes_per_clip'] / 1e6:.2f} MB per clip without caching and {s['cached']['bytes_per_clip'] / 1e6:.2f} MB with it"


def grad_cache_bn() -> str:
    """What chunk statistics do to DAVEnet's gradient: its cosine to the plain step's at the smallest
    chunk bench.grad_cache measured."""
    bn = m("grad_cache")["bn"]
    row = min(bn["rows"], key=lambda r: r["chunk"])
    return (f"chunks of {row['chunk']} of {bn['clips']} clips turn DAVEnet's gradient to a cosine of "
            f"{row['grads']['davenet']['cos']:.2f} with the plain step's")


LOSS_MEMORY_BATCHES = (4096,)  # the pages show these; the JSON holds every B measured


def loss_memory() -> str:
    rows, mib = [], 2**20
    by = {}
    for r in m("memory")["loss"]:
        by.setdefault((r["B"], r["N"]), {})[r["negatives"]] = r
    for (b, n), r in sorted(by.items()):
        if b not in LOSS_MEMORY_BATCHES:
            continue
        g, ring = r["gathered"], r["ring"]
        rows.append([b, f"{g['dataparallel_peak'] / mib:.0f}", n, f"{g['raymcn_peak'] / mib:.0f}", f"{g['ratio']:.2f}",
                     f"{ring['raymcn_peak'] / mib:.0f}", f"{ring['ratio']:.2f}", f"{g['target']:.3g}",
                     f"{g['estimate_over_measured']:.2f}, {ring['estimate_over_measured']:.2f}"])
    return table(["B", "DataParallel MiB", "N", "gathered MiB", "ratio", "ring MiB", "ratio", "target",
                  "estimate / measured"], rows, right=0)


# --- the other benchmarks -----------------------------------------------------------------------------
def kmeans() -> str:
    rows = [[r["world"], f"{r['s_per_iteration']:.2f}", f"{r['s_per_refit']:.0f} s", f"{r['speedup']:.2f}×", f"{r['max_centroid_diff']:.1e}"]
            for r in m("kmeans")["rows"]]
    return table(["ranks", "s per Lloyd iteration", "a 100-iteration refit", "speed-up", "largest centroid difference"], rows, right=0)


def eval_sharding() -> str:
    e = m("eval_sharding")["median_s"]
    before, now = e["every rank, whole set (before)"], e["sharded, scored once (now)"]
    return f"{before:.2f} s before, {now:.2f} s now ({now / before:.2f})"


def compression() -> str:
    c = m("compression")["codecs"]
    ratios = [x["ratio"] for x in c if x["codec"].startswith("zstd")]
    lz4 = [x["vs_uncompressed"] for x in c if x["codec"].startswith("lz4")]
    zs = [x["vs_uncompressed"] for x in c if x["codec"] == "zstd-1"]
    return (f"zstd packs these synthetic fp16 features {min(ratios):.2f}–{max(ratios):.2f}× but level 1 gives "
            f"{min(zs):.2f}–{max(zs):.2f}× the videos/s of uncompressed shards" + (f" (lz4 {min(lz4):.2f}–{max(lz4):.2f}×)" if lz4 else ""))


def scale() -> str:
    s = m("scale")["scales"]
    gb = 1e9
    rows = [["captions", *[f"{x['captions'] / 1e6:.1f} M" for x in s]],
            ["caption pickle", *[f"{x['pickle_bytes'] / 1e6:.0f} MB" for x in s]],
            ["driver: unpickle", *[f"{x['unpickle_s']:.1f} s" for x in s]],
            ["driver: the table in memory", *[f"{x['unpickle_peak'] / gb:.2f} GB" for x in s]],
            ["vocabulary pass", *[f"{x['vocab_pass_s']:.1f} s" for x in s]],
            ["caption store: build / on disk", *[f"{x['store_build_s']:.1f} s / {x['store_bytes'] / gb:.2f} GB" for x in s]],
            ["a local writer (PSS)", *[f"{x['local']['writer_pss_max'] / 1e6:.1f} MB" for x in s]],
            ["a Ray writer (PSS)", *[f"{x['ray']['writer_pss_max'] / 1e6:.1f} MB" for x in s]],
            ["bytes in memory per pickle byte", *[f"{x['bytes_per_pickle_byte']:.2f}" for x in s]]]
    t = m("scale")["training"]
    rows.append([f"training side at {t['videos'] / 1e6:.2f} M videos: manifest load / video index / peak",
                 f"{t['manifest_load_s']:.1f} s / {t['inputs_s']:.1f} s / {t['peak'] / gb:.2f} GB", ""])
    return table(["figure", *[f"1/{x['fraction']} of HowTo100M" for x in s]], rows)


def bytes_per_pickle_byte() -> str:
    """The most memory per pickle byte any measured scale needed."""
    return f"{max(x['bytes_per_pickle_byte'] for x in m('scale')['scales']):.2f}"


RUNG_EPOCHS = (1, 2, 3, 4, 10)  # the pages show these; the JSON holds every epoch


def rung_correlation() -> str:
    r = m("rung_correlation")
    rows = [[f"{a['epoch']} ({a['rung (budget_epoch)']})", f"{a['before rho']:.2f} {a['before 95% CI']}", f"{a['after rho']:.2f} {a['after 95% CI']}",
             f"{u['before rho']:.2f} {u['before 95% CI']}", f"{u['after rho']:.2f} {u['after 95% CI']}"]
            for a, u in zip(r["rows"], r["upper_half"]) if a["epoch"] in RUNG_EPOCHS]
    n = r["settings"]["configs"]
    return table(["epoch (budget epoch)", f"before, all {n}", f"after, all {n}", f"before, upper {n // 2}", f"after, upper {n // 2}"], rows)


def sweep_efficiency() -> str:
    e = m("sweep_efficiency")
    budget = e["settings"]["budget"]
    rows = []
    for name, a in e["algorithms"].items():
        rows.append([name, f"{a['best_r10']['mean']:.1f} {ci(*a['best_r10']['ci95'])}",
                     f"{a['epochs_to_random_best']['mean']:.1f} {ci(*a['epochs_to_random_best']['ci95'])}",
                     f"{a['ratio_to_budget']['mean']:.2f} {ci(*a['ratio_to_budget']['ci95'], '.2f')}",
                     f"{a['reached']}/{a['of']}", f"{a['trials_mean']:.1f} ({a['full_trials_mean']:.1f})"])
    return table(["algorithm", f"best R@10 at {budget} trial-epochs", "trial-epochs to random's best", f"ratio to {budget}",
                  "seeds that reached it", "trials (full-length)"], rows)


ARMS = [("torchrun", "1 bare DDP under `torchrun`"), ("ray-ddp", "2 the same ranks as plain Ray actors"),
        ("train-local", "3 TorchTrainer, raymcn's worker, in-process reader"),
        ("train-raydata", "**4 TorchTrainer + Ray Data (raymcn as it runs)**"),
        ("train-raydata-noprefetch", "4 with `data.prefetch_batches=0`")]


def overhead() -> str:
    o = m("overhead")
    sps, cpu = o["steady_samples_per_s"], o["cpu_ms_per_sample"]
    rows = [[label, f"{sps[k]:.0f}", f"{sps[k] / sps['ray-ddp']:.2f}", f"{cpu[k]['ranks']:.2f} / {cpu[k]['all']:.2f}",
             f"{o['cpu_percent_of_one_core'][k]['training ranks']:.0f}"] for k, label in ARMS]
    att = "; ".join(f"{k} {v['throughput_ratio']:.2f}" for k, v in o["attribution"].items())
    return table(["arm", "samples/s", "vs arm 2", "CPU ms per sample: ranks / all", "ranks' CPU, % of a core"], rows) + \
        f"\n\nThroughput ratios: {att}."


def overhead_goal() -> str:
    return f"{m('overhead')['arm4_over_arm2']:.2f}"


def feed() -> str:
    s = m("overhead")["step_ms"]
    on, off = s["train-raydata"], s["train-raydata-noprefetch"]
    return (f"{on['data']:.1f} ms with the thread and {off['data']:.1f} ms without; the epoch's first batch "
            f"{on['first batch']:.1f} ms and {off['first batch']:.1f} ms")


TRIAL_ITEMS = ["fit() -> every rank in the worker function", "  fit() -> Train controller's title seen",
               "  controller -> first worker actor's title seen",
               "  last worker process started -> in the function (imports, process group)",
               "worker set-up (reader, eval set, model, DDP)", "first batch + first step", "epochs: steps",
               "epochs: between the steps (evaluation, checkpoint, report)", "teardown: last rank done -> fit() returned",
               "plan (the trial's run plan)", "between trials: previous driver done -> this driver entered"]


def trial_cost() -> str:
    c = m("trial_cost")["steady"]["current"]
    rows = [[k.strip().replace("->", "→"), f"{c['items_s'][k]:.2f}"] for k in TRIAL_ITEMS if k in c["items_s"]]
    rows.append(["**trial wall / fixed cost (wall − steps)**", f"**{c['wall_s']:.1f} / {c['fixed_s']:.1f}**"])
    return table(["item (indented ones overlap the first)", "s"], rows)


def trial_fixed() -> str:
    return f"{m('trial_cost')['steady']['current']['fixed_s']:.1f} s"


def drain_share(every: int = 10) -> str:
    """Asking every ``every`` steps (the cost measured on a CPU machine), as a share of a 4-GPU
    server's share of the paper step measured on one GPU (bench.gpu_smoke's plain variant; the ring
    variant's is shorter). The page names both machines."""
    return f"{100 * m('drain_check')['ask_ms'] / 1e3 / (every * _gpu_step()):.2f}"


def _gpu_step() -> float:
    return m("gpu_smoke")["variants"]["plain"]["s_per_step_wall"]


# --- the lab's sizes and durations (docs/lab-guide.md), computed from what was measured ----------------------
def _epoch_steps() -> int:
    return m("scale")["training"]["steps_per_epoch"]


def _sweep_estimate(path: str):
    """raymcn doctor's own estimate of a shipped sweep file on the lab's 2 servers (8 GPUs), from the
    step measured on a GPU and the fixed cost of a trial measured on a CPU; no evaluation counted."""
    from raymcn.config import load_config
    from raymcn.doctor.estimate import estimate

    cfg = load_config(ROOT / path)
    return estimate(cfg, cfg.schedule.steps_per_epoch or _epoch_steps(), _gpu_step(), 0.0, {"GPU": 8, "CPU": 128},
                    m("trial_cost")["steady"]["current"]["fixed_s"])


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min" if seconds >= 60 else \
        f"{seconds:.0f} s"


def paper_checkpoint() -> str:
    """faults.md: one checkpoint of ``sweeps/paper.yaml`` as the preflight computes it (no measurement)."""
    from raymcn.config import load_config
    from raymcn.storage import size_text
    from raymcn.train.checkpoints.space import checkpoint_bytes

    return size_text(checkpoint_bytes(load_config(ROOT / "sweeps" / "paper.yaml")))


def lab_sizes() -> str:
    """lab-guide.md's table: what the lab's data and runs take, each from the measurement it comes
    from, with that measurement's machine."""
    t, long, scales = m("scale")["training"], _long(), m("scale")["scales"]
    videos, steps, batch = t["videos"], _epoch_steps(), 128
    mb = {d: long["dtypes"][d]["mb_per_video"] for d in ("float16",)}
    whole = max(scales, key=lambda x: x["captions"])
    pickle_gb = whole["pickle_bytes"] * whole["fraction"] / 1e9
    bpp = max(x["bytes_per_pickle_byte"] for x in scales)
    from raymcn.data.write.captions import UNPICKLE_BYTES_PER_FILE_BYTE as asked  # what the conversion checks

    bohb = _sweep_estimate("sweeps/stage_order_bohb.yaml")
    gpu, cpu = machine("gpu_smoke").split(",")[0], machine("loader")
    rows = [
        ["the shards, fp16 (the default)", f"{mb['float16'] * videos / 1e6:.1f} TB",
         f"bench.loader's {mb['float16']:.2f} MB a video × {videos / 1e6:.2f} M videos", cpu],
        ["memory for the caption table while converting", f"{asked * pickle_gb:.1f} GB",
         f"bench.scale: {bpp:.2f} bytes per byte of a {pickle_gb:.1f} GB caption pickle; the conversion asks for "
         f"{asked:g}", machine("scale")],
        ["reading every npz file once (converting takes longer)", _hours(videos / _original()),
         f"bench.loader: {_original():.0f} videos/s, `np.load` in 4 processes", cpu],
        ["a paper epoch: the GPUs' compute alone", _hours(steps * _gpu_step()),
         f"bench.gpu_smoke: {steps} steps × {_gpu_step():.3f} s, a rank's share", gpu],
        ["a paper epoch: the reading, if 2 CPUs read", _hours(steps * batch / _vps("float16")),
         f"bench.loader: {steps} steps × {batch} videos at {_vps('float16'):.0f} videos/s", cpu],
        ["the stage-order sweep: compute and trial start-up", f"{bohb.wall_s[0] / 3600:.0f}–{bohb.wall_s[1] / 3600:.0f} h",
         f"the doctor's estimate: {bohb.search_trials} trials, then {bohb.confirm_runs} runs of {bohb.epochs} epochs, "
         "2 at once",
         f"{gpu}; start-up: {machine('trial_cost').split(',')[0]}"],
    ]
    return table(["what", "from", "measured on", "about"], [[r[0], r[2], r[3], r[1]] for r in rows], right=3)


# --- the suite's tiers (tools/test_durations.py, from a fresh-clone `.ci/run`) --------------------------------
TIER_NAMES = {"fast": "`make test`", "slow": "`make test-slow`", "compat": "`make test-compat`", "top": "`make test-top`",
              "ci": "CI: all four (`.ci/run`)", "soak": "`make test-soak`", "full": "`make test-full`",
              "os": "`sudo tools/os_tier` (Ubuntu 26.04)"}
SLOWEST = 3  # development.md lists each tier's slowest tests; the JSON holds every test's time


UNRECORDED = "no complete run recorded yet"


def tier(name: str) -> str:
    """``10 min 5 s, 1 180 tests``: a tier's pytest time on the machine of test_durations.json, or
    :data:`UNRECORDED` for a tier the file lacks (a run stopped before the tier ended)."""
    t = m("test_durations")["tiers"].get(name)
    return f"{minsec(t['seconds'])}, {t['tests']} tests" if t else UNRECORDED


def tiers() -> str:
    """development.md's table: each tier's time and tests, and where it ran."""
    recorded = m("test_durations")["tiers"]

    def ran_on(t: dict) -> str:  # a sum of tiers, or a file from before the versions were recorded: none
        return f"{t['python']}, {t['torch']}" if "python" in t else ""

    rows = [[TIER_NAMES[n], minsec(recorded[n]["seconds"]), recorded[n]["tests"], recorded[n]["skipped"],
             ran_on(recorded[n])] if n in recorded else [TIER_NAMES[n], UNRECORDED, "", "", ""] for n in TIER_NAMES]
    return table(["tier", "pytest time", "tests", "skipped (no GPU)", "Python, torch"], rows)


def slowest_tests() -> str:
    """Each tier's slowest tests, the list the next cut between the tiers starts from: a row per tier,
    its tests slowest first, each with its seconds."""
    rows = [[TIER_NAMES[n], "; ".join(f"`{test.removeprefix('tests/')}` {seconds:.0f}"
                                      for test, seconds in list(tests.items())[:SLOWEST])]
            for n, tests in m("test_durations")["tests"].items()]
    return table(["tier", "its slowest tests, seconds"], rows, right=2)


def commands() -> str:
    """development.md's list: the README's and the guide's commands by how the suite runs them
    (tools/doc_commands.py, which tests/test_docs.py checks)."""
    from tools.doc_commands import CHANGED, COMMANDS, PARSED, RUN

    def name(shape: str, shown) -> str:
        return shown.label or f"`{shape}`"

    def files(shown) -> str:  # the test files' names: where to look
        return ", ".join(dict.fromkeys(f"`{t.split('::')[0].removeprefix('tests/')}`" for t in shown.tests))

    run = [name(s, c) for s, c in COMMANDS.items() if c.kind == RUN]
    out = f"Run as written: {', '.join(run)}."
    for kind, why in ((CHANGED, "what changes"), (PARSED, "why not run")):
        rows = [[name(s, c), c.how, files(c)] for s, c in COMMANDS.items() if c.kind == kind]
        if rows:
            out += f"\n\n{kind.capitalize()}:\n\n" + table(["command", why, "tests"], rows, right=3)
    return out


def metrics() -> str:
    """sweeps.md's list of the retrieval metrics, from the one table (raymcn/config/metrics.py):
    what ``sweep.metric`` may name, grouped by which way is better and which queries each is over."""
    from raymcn.config import metric_table

    groups: dict[tuple[str, bool], list[str]] = {}
    for m in metric_table():
        groups.setdefault((m.direction, m.over_all_queries), []).append(f"`{m.name}`")
    return "\n".join(f"- {'higher' if direction == 'max' else 'lower'} is better, over "
                     f"{'all' if over_all else 'the present'} queries: {', '.join(names)}"
                     for (direction, over_all), names in groups.items())


def compile_cache() -> str:
    """memory.md's figure: what a sweep's second compiled trial spent compiling against its first."""
    first, second = (t["time_compile_s"] for t in m("compile_cache")["trials"])
    return f"{second:.1f} s against the first's {first:.1f} s ({second / first:.2f}×)"


GENERATORS: dict[str, Callable[[], str]] = {
    **{f"run.{name}": functools.partial(ran, name) for name in SHOWN_RUNS},
    "drain.ask-ms": lambda: f"{m('drain_check')['ask_ms']:.2f}",
    "drain.share-10": drain_share,
    "drain.gpu-step": lambda: f"{_gpu_step():.3f} s",
    "gpu.where": gpu_where, "gpu.command": lambda: f"`{m('gpu_smoke')['command']}`", "gpu.smoke": gpu_smoke, "gpu.ratios": gpu_ratios,
    "gpu.today": gpu_today, "gpu.tier": gpu_tier,
    "gpu.unrun": gpu_unrun,
    "gpu.train": gpu_train, "gpu.sweep": gpu_sweep, "gpu.doctor": gpu_doctor,
    "gpu.not-yet-run": gpu_not_yet_run, "gpu.data-phase": lambda: gpu_data_phase(), "grad-cache.bn": lambda: grad_cache_bn(),
    "gpu.cosine": lambda: f"{m('gpu_runs')['gpu_tier']['gradient_cosine_cached_vs_plain']:.6f}",
    "commands": commands, "metrics": metrics, "lab.sizes": lab_sizes, "checkpoint.paper": paper_checkpoint, "compile.cache": compile_cache,
    "measurements.ages": lambda: measurement_ages(),
    "tests.fast": lambda: tier("fast"), "tests.ci": lambda: tier("ci"), "tests.full": lambda: tier("full"), "tests.tiers": tiers,
    "tests.slowest": slowest_tests,
    "loader.full": loader_full, "loader.short-long": loader_short_long,
    "loader.fp16": lambda: f"{_vps('float16'):.0f}",
    "loader.fp16-vs-original": lambda: f"{_vps('float16') / _original():.1f}",
    "shards.bytes": shard_bytes, "shards.paired": shard_dtype_paired,
    "sweep.wall": sweep_wall, "sweep.before": sweep_before, "sweep.end": sweep_end, "sweep.progress": sweep_progress,
    "sweep.lines": sweep_lines, "sweep.runs": sweep_runs,
    "chaos": chaos, "preflight.24gb": preflight_24gb, "preflight.a100": preflight_a100,
    "grad-cache": grad_cache, "grad-cache.slopes": grad_cache_slopes, "loss-memory": loss_memory,
    "kmeans": kmeans, "eval-sharding": eval_sharding, "compression": compression, "scale": scale, "scale.per-pickle-byte": bytes_per_pickle_byte,
    "rung-correlation": rung_correlation, "sweep-efficiency": sweep_efficiency,
    "overhead": overhead, "overhead.goal": overhead_goal, "feed": feed, "trial-cost": trial_cost,
    "trial-cost.fixed": trial_fixed,
    "config-error": lambda: fence(txt("config_error")),
    "sweep.ray-results": lambda: fence(txt("ray_results")),  # written by python -m tools.ray_results
}

# NAME -> the command whose console text docs/measurements/NAME.txt holds (run by --capture NAME and
# compared by tests/test_docs.py); each is cheap, needs no Ray and prints the same on any machine.
CAPTURES = {
    "config_error": ["raymcn", "train", "--set", "optim.lrr=1", "--set", "schedule.stage_order=VA_T"],
}


# --- which code wrote each measurement (``--stale``) ---------------------------------------------------
_RUN = ("raymcn/train", "raymcn/model", "raymcn/losses", "raymcn/collectives.py", "raymcn/config")
# NAME -> the files and folders whose code decides docs/measurements/NAME.json's figures: the benchmark
# (or the tests) that measured them and the raymcn code it measured. A JSON whose commit is older than
# a change to one of them may no longer describe today's code.
PRODUCERS: dict[str, tuple[str, ...]] = {
    "test_durations": ("tests", "pyproject.toml", "Makefile", ".ci/run", *_RUN, "raymcn/sweep", "raymcn/data"),
    "compile_cache": ("bench/compile_cache.py", *_RUN, "raymcn/sweep"),
    "chaos": ("bench/chaos.py", *_RUN, "raymcn/servers", "raymcn/sweep", "raymcn/phases.py", "raymcn/data/read"),
    "compression": ("bench/compression.py", "raymcn/data/formats", "raymcn/data/read"),
    "drain_check": ("bench/drain_check.py", "raymcn/train/on_ray/cluster.py"),
    "eval_sharding": ("bench/eval_sharding.py", *_RUN, "raymcn/data/evalsets.py"),
    "grad_cache": ("bench/grad_cache.py", "bench/step.py", *_RUN),
    "gpu_runs": ("tests/test_gpu_path.py", "tests/test_gpu_smoke.py", "tests/test_feed.py", *_RUN, "raymcn/sweep",
                 "raymcn/doctor", "raymcn/data/read"),
    "gpu_smoke": ("bench/gpu_smoke.py", *_RUN),
    "kmeans": ("bench/kmeans.py", "raymcn/losses/cluster.py", "raymcn/collectives.py"),
    "loader": ("bench/loader.py", "bench/readers.py", "raymcn/data"),
    "loader_short_and_long": ("bench/loader.py", "bench/readers.py", "raymcn/data"),
    "memory": ("bench/memory.py", "raymcn/losses", "raymcn/collectives.py", "raymcn/train/preflight/footprint.py"),
    "overhead": ("bench/overhead.py", *_RUN, "raymcn/data/read"),
    "preflight": ("bench/grad_cache.py", "raymcn/train/preflight", "raymcn/config"),
    "rung_correlation": ("bench/rung_correlation.py", *_RUN, "raymcn/sweep"),
    "scale": ("bench/scale.py", "raymcn/data"),
    "shard_dtype": ("bench/shard_dtype.py", *_RUN, "raymcn/data"),
    "sweep_efficiency": ("bench/sweep_efficiency.py", *_RUN, "raymcn/sweep"),
    "sweep_time": ("bench/sweep_time.py", "raymcn", "sweep.py"),
    "trial_cost": ("bench/trial_cost.py", *_RUN, "raymcn/sweep", "raymcn/data/read"),
}


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)


# NAME -> how to write NAME.json again today, for a JSON whose run recorded no command (formatted with
# the JSON's own fields: the settings it records). A run stamped by the harness names its own.
RERUN: dict[str, str] = {
    "chaos": "python -m bench.chaos --faults 21",
    "compression": "python -m bench.compression --disk-mb-s {disk_mb_s:g} --reader-ms {reader_ms:g} --cores {cores}",
    "drain_check": "python -m bench.drain_check --out docs/measurements/drain_check.json",
    "eval_sharding": "python -m bench.eval_sharding --out docs/measurements/eval_sharding.json",
    "grad_cache": "python -m bench.grad_cache --clips 64 128 256 --bn-clips 128 --out docs/measurements/grad_cache.json",
    "gpu_runs": "python -m pytest -m gpu -s (then a train, a sweep and doctor --step on the GPU; the file is "
                "transcribed from their logs)",
    "kmeans": "python -m bench.kmeans --out docs/measurements/kmeans.json",
    "loader": "python -m bench.loader --sizes long --repeat 3 --out docs/measurements/loader.json",
    "loader_short_and_long": "python -m bench.loader --out docs/measurements/loader_short_and_long.json",
    "memory": "python -m bench.memory --out docs/measurements/memory.json",
    "overhead": "python -m bench.overhead --arms torchrun ray-ddp train-local train-raydata train-raydata-noprefetch "
                "--out docs/measurements/overhead.json",
    "rung_correlation": "python -m bench.rung_correlation --processes 1 --out docs/measurements/rung_correlation.json",
    "scale": "python -m bench.scale --out docs/measurements/scale.json",
    "shard_dtype": "python -m bench.shard_dtype --out docs/measurements/shard_dtype.json",
    "sweep_efficiency": "python -m bench.sweep_efficiency --out docs/measurements/sweep_efficiency.json",
    "trial_cost": "python -m bench.trial_cost --out docs/measurements/trial_cost.json",
}


@dataclass(frozen=True)
class Held:
    """What a reader of a measurement's page should know about a change since it was measured:
    ``why`` its figures still hold, as read through commit ``through``. A note for the reader only:
    no later commit makes it expire, and none is needed for a measurement to stay off the stale list."""

    through: str
    why: str


MAIN = "0fa4b64"  # the commit most of these notes were read through
# Read through MAIN, since the measurements: the step gained two settings, off by default (compile,
# DAVEnet's layout); the connection gained handshakes; evaluation computes two more metrics;
# `python -m raymcn`; gpu_smoke's --compare gained a kernel profile and a --budget; channels-last
# weights take the format's exact strides; none runs in a measured path.
HELD: dict[str, Held] = {
    "chaos": Held(MAIN, "code reorganised; tests/test_chaos.py, asserting the outcome shown, passed in the recorded "
                        "soak tier"),
    "compile_cache": Held(MAIN, "only the benchmark's step rig changed, which a sweep does not run"),
    "compression": Held(MAIN, "it times pyarrow's codecs on generated bytes; raymcn's code only moved"),
    "drain_check": Held(MAIN, "the call it times is unchanged; the benchmark's default step changed"),
    "eval_sharding": Held(MAIN, "code moved; two more metrics from the same ranks (microseconds)"),
    "grad_cache": Held(MAIN, "the estimate gained ring, DDP and GPU terms only, none in this step"),
    "gpu_runs": Held(MAIN, "a record of one run; the doctor's failure it shows was fixed since (c99452f)"),
    "gpu_smoke": Held(MAIN, "the same batches and steps; the benchmark since adds MFU and --compare"),
    "kmeans": Held(MAIN, "the iteration's product is unchanged; the reseed on the device adds little"),
    "loader": Held(MAIN, "bytes: the format is unchanged; rates: a reader before its read-ahead"),
    "loader_short_and_long": Held(MAIN, "only code the read path does not run moved"),
    "memory": Held(MAIN, "rerun at 39c05ec (AMD EPYC family 26): every peak within 4 bytes"),
    "overhead": Held(MAIN, "the loop was reorganised; a step's work and Ray's start unchanged"),
    "rung_correlation": Held(MAIN, "both arms ran one code; the R@10 levels are 2fcddd1's"),
    "scale": Held(MAIN, "files renamed, benchmark-only code moved out"),
    "shard_dtype": Held(MAIN, "the format is unchanged; both dtypes trained by one code"),
    "sweep_efficiency": Held(MAIN, "all three searches ran one code; the R@10 levels are 18e8d4e's"),
    "sweep_time": Held("65b04ba", "measured at a647186; since, the connection's wait takes its address as a list, "
                                  "and the end of a sweep names its code, environment and data (lines the README's "
                                  "capture lacks)"),
    "test_durations": Held("bb21104", "fast, slow, compat, top: CI at d564b5b, whose slow tier failed twice (the "
                                      "drain test's `ray down`, the doctor's rehearsal on a 22 GB disk), both "
                                      "fixed by test changes since; soak at 18a12bf, 3 failures fixed since and "
                                      "rerun passing; Ubuntu 26.04 at a915bee"),
    "trial_cost": Held(MAIN, "how Ray Train starts a trial is unchanged; the code between steps moved"),
}


def _preflight_messages() -> dict:
    from bench.grad_cache import preflight_messages  # the benchmark's own code: what its JSON holds

    return {"preflight": preflight_messages()}


# NAME -> (the test that recomputes it, its figures as today's code computes them, key by key as its JSON
# holds them): a measurement whose figures are cheap and deterministic. It is stale exactly when these differ
# from its JSON's, whatever commits came since; its command rewrites the JSON.
QUICK: dict[str, tuple[str, Callable[[], dict]]] = {
    "preflight": ("tests/test_docs.py::test_the_preflight_messages_on_the_pages_are_what_todays_code_prints",
                  _preflight_messages),
}


def changes_since(commit: str, paths: tuple[str, ...]) -> list[str] | None:
    """The commits after ``commit`` that changed any of ``paths`` (``git log --oneline``, newest
    first); None when ``commit`` is not a commit of this repository."""
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return None
    return _git("log", "--format=%h %s", f"{commit}..HEAD", "--", *paths).stdout.splitlines()


def _measurements() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(MEASURED.glob("*.json"))}


def _changed(name: str, figures: dict) -> tuple[str | None, list[str] | None]:
    """(the commit NAME's figures describe: the one its run recorded, else the one that wrote them,
    :func:`written_at`; the commits that changed its code since, None when that commit is not in
    this repository)."""
    commit = figures["commit"] if figures.get("commit") not in (None, "unknown") else written_at(name)
    return commit, changes_since(commit, PRODUCERS[name]) if commit else None


def stale_measurements(measurements: dict[str, dict] | None = None) -> dict[str, str]:
    """NAME -> why, for each JSON under docs/measurements (or of ``measurements``, NAME -> its
    figures) that no longer describes today's code as far as this repository can tell: its commit
    is not in the repository or not committed yet, or its quick form (:data:`QUICK`) computes other
    figures today. Commits since a measurement alone never make it stale: its page shows its commit."""
    out = {}
    for name, figures in (_measurements() if measurements is None else measurements).items():
        commit = figures["commit"] if figures.get("commit") not in (None, "unknown") else written_at(name)
        if commit is None:
            out[name] = "its figures are not committed"
        elif _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
            out[name] = f"its commit {commit} is not in this repository"
        elif name in QUICK:
            today = QUICK[name][1]()
            differ = sorted(k for k, v in today.items() if figures.get(k) != v)
            if differ:
                out[name] = f"today's code computes other {', '.join(differ)} (checked by {QUICK[name][0]})"
    return out


def measured_commits() -> dict[str, tuple[str | None, int | None]]:
    """NAME -> (the commit its figures describe, how many later commits changed its code, None when
    that commit is not in this repository), for each JSON without a quick form: what ``--stale``
    reports for the reader, never as stale."""
    out = {}
    for name, figures in _measurements().items():
        if name not in QUICK:
            commit, since = _changed(name, figures)
            out[name] = (commit, None if since is None else len(since))
    return out


def measurement_ages() -> str:
    """development.md's table: each measurement, the commit its figures describe, and how they are
    checked: recomputed by a test (:data:`QUICK`), or read against that commit, with the note for the
    reader (:data:`HELD`) where one says what a change left as it was. It changes only with the
    measurements, the quick forms and the notes, never with a later commit."""
    rows = []
    for name, figures in _measurements().items():
        commit = figures["commit"] if figures.get("commit") not in (None, "unknown") else written_at(name)
        if name in QUICK:
            how = f"recomputed from today's code by `{QUICK[name][0].split('::')[0]}`"
        else:
            how = HELD[name].why + f" (read through {HELD[name].through})" if name in HELD else "its page shows the commit"
        rows.append([f"`{name}`", commit or "not committed", how])
    return table(["JSON", "measured at", "how its figures are checked"], rows, right=3)


def capture(name: str) -> str:
    """Run CAPTURES[name] as the user types it; its console text, the command line first."""
    argv = CAPTURES[name]
    code = "import sys; from raymcn.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, *argv[1:]], capture_output=True, text=True, cwd=ROOT, check=False)
    return f"$ {' '.join(argv)}\n{done.stdout}{done.stderr}".rstrip("\n")


def render(text: str) -> str:
    """``text`` with every generated span rewritten; an unknown name raises KeyError."""
    def one(match: re.Match) -> str:
        name, old = match.group(1), match.group(2)
        if name not in GENERATORS:
            raise KeyError(f"no generator named {name!r} (tools/docgen.py GENERATORS)")
        new = GENERATORS[name]()
        if old.startswith("\n"):  # a block: its lines indented as the closing marker is (a list item's)
            indent = old[old.rindex("\n") + 1:]
            body = "\n" + "\n".join(indent + line if line else line for line in new.split("\n")) + "\n" + indent
        else:
            body = new
        return f"<!-- gen:{name} -->{body}<!-- /gen -->"

    return MARK.sub(one, text)


def stale_pages() -> list[Path]:
    """The pages whose text differs from what :func:`render` writes."""
    return [p for p in PAGES if render(p.read_text()) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming every stale page")
    parser.add_argument("--capture", metavar="NAME", choices=sorted(CAPTURES),
                        help="rerun a captured command and store its console text in docs/measurements/NAME.txt")
    parser.add_argument("--stale", action="store_true",
                        help="list each measurement whose figures today's code no longer gives (its quick form "
                             "recomputed) or whose commit this repository lacks, with the command that rewrites it, "
                             "exit 1 if any; for the others, the commit they describe and the later commits that "
                             "changed their code (for the reader, not stale)")
    args = parser.parse_args(argv)
    if args.stale:
        for name, (commit, n) in measured_commits().items():
            if n:
                note = f"; note: {HELD[name].why}" if name in HELD else ""
                print(f"docs/measurements/{name}.json: measured at {commit}; {n} later commits changed its code "
                      f"(not stale: its page shows the commit{note})")
        stale = stale_measurements()
        for name, why in stale.items():
            print(f"docs/measurements/{name}.json: STALE: {why}\n  rerun: {rerun(name)}")
        return 1 if stale else 0
    if args.capture:
        (MEASURED / f"{args.capture}.txt").write_text(capture(args.capture) + "\n")
    stale = stale_pages()
    if args.check:
        for page in stale:
            print(f"{page.relative_to(ROOT)} differs from what python -m tools.docgen writes", file=sys.stderr)
        return 1 if stale else 0
    for page in stale:
        page.write_text(render(page.read_text()))
        print(f"rewrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
