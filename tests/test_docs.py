"""The documentation a user reads is checked against the code: the settings page is the generated
reference, every relative link resolves, every ``raymcn ...`` command shown parses with the real
command-line parser (a subcommand or a flag that does not exist fails here), every command of the
lab's guide is run by a test or named as one only the real cluster runs, a figure quoted in
several places equals its one source, and a quoted default equals the generated settings page."""

from __future__ import annotations

import ast
import functools
import json
import re
import shlex
from pathlib import Path

import pytest

from raymcn.cli import build_parser
from raymcn.reference import field_comments, reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_settings_page_is_the_generated_reference():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert page == reference(), "docs/settings.md is stale: run `raymcn config --reference > docs/settings.md`"


def test_every_setting_has_a_meaning_in_the_reference():
    import dataclasses

    from raymcn.config import Config

    comments = field_comments()
    missing = [f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
               for f in dataclasses.fields(type(getattr(Config(), s.name)))
               if not comments.get(type(getattr(Config(), s.name)).__name__, {}).get(f.name)]
    assert not missing, f"settings without a comment at their field in config.py: {missing}"


def _links(text: str) -> list[str]:
    return [m for m in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", m) and not m.startswith("#")]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = [link for link in _links(page.read_text()) if not (page.parent / link.split("#")[0]).exists()]
    assert not broken, f"{page.name}: links to files that do not exist: {broken}"


def _block_lines(text: str) -> list[str]:
    """Every command line of the page's shell code blocks: continuations joined, comments dropped."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def _nested_raymcn(line: str) -> str | None:
    """The raymcn command a `ray submit ... sweep.py -- ARGS` or `ray exec CLUSTER 'raymcn ...'` runs."""
    if not line.startswith("ray "):
        return None
    words = shlex.split(line)
    if words[1] == "submit" and "--" in words:
        script = next(w for w in words[2:] if w.endswith(".py"))
        name = {"sweep.py": "sweep", "train.py": "train"}.get(Path(script).name)
        return f"raymcn {name} " + shlex.join(words[words.index("--") + 1:]) if name else None
    if words[1] == "exec":
        inner = [w for w in words[2:] if not w.startswith("-")][-1]
        return inner if inner.startswith("raymcn ") else None
    return None


def _commands(text: str) -> list[str]:
    """Every `raymcn ...` command of the page's code blocks (also those run through `ray submit` or
    `ray exec`) and inline code."""
    found = []
    for line in _block_lines(text):
        if line.startswith("raymcn "):
            found.append(line)
        elif _nested_raymcn(line):
            found.append(_nested_raymcn(line))
    found += [c for c in re.findall(r"`(raymcn [^`]+)`", text) if "\n" not in c]
    return found


# `raymcn doctor` is being built beside the lab's guide; until the parser has it, the options it is
# specified with stand in for the parser's (the real parser wins as soon as it has the subcommand).
PLANNED = {"doctor": {"-h", "--help", "--config", "--set", "--address", "--step", "--json"}}


def _subcommands() -> dict[str, set[str]]:
    """subcommand -> the option strings it accepts (from the real parser)."""
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    real = {name: {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}
    return {**PLANNED, **real}


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_raymcn_command_shown_names_a_real_subcommand_and_flags(page):
    known = _subcommands()
    bad = []
    for command in _commands(page.read_text()):
        words = shlex.split(command.replace("[", " ").replace("]", " "))[1:]
        if not words or words[0].startswith("<") or words[0].endswith(":"):
            continue  # a placeholder (`raymcn <command>`) or a message quoted from the console
        name = words[0]
        if name in ("--help", "-h"):
            continue
        if name not in known:
            bad.append(f"{command}: no subcommand {name!r}")
            continue
        flags = [w.split("=", 1)[0] for w in words[1:] if w.startswith("--")]
        bad += [f"{command}: {name} has no flag {f}" for f in flags if f not in known[name]]
    assert not bad, f"{page.name}: " + "; ".join(bad)


# Every place that shows how to run a benchmark: the docs, and the files that name commands.
COMMAND_FILES = [*DOCS, ROOT / "Makefile", ROOT / "cluster.yaml", *sorted((ROOT / "sweeps").glob("*.yaml"))]


def _bench_commands(text: str) -> list[tuple[str, str]]:
    """(benchmark, its arguments) of every ``python -m bench.NAME ...`` shown, inline or in a block
    (continuations joined; a placeholder name in capitals left out)."""
    text = text.replace("\\\n", " ")
    found = re.findall(r"python -m bench\.([a-z_]+)([^`\n#]*)", text)
    return [(name, args.strip()) for name, args in found]


@pytest.mark.parametrize("path", COMMAND_FILES, ids=lambda p: p.name)
def test_every_benchmark_command_shown_runs_a_real_benchmark_with_its_flags(path):
    """Benchmarks run as modules (``python -m bench.NAME``): a command shown names a benchmark that
    exists and only flags its parser takes; none shows the old script form ``python bench/NAME.py``."""
    import importlib

    text = path.read_text()
    assert "python bench/" not in text, f"{path.name}: run a benchmark as `python -m bench.NAME`"
    bad = []
    for name, args in _bench_commands(text):
        try:
            parser = importlib.import_module(f"bench.{name}").build_parser()
        except ModuleNotFoundError:
            bad.append(f"bench.{name}: no such benchmark")
            continue
        words = [w for w in shlex.split(args) if not w.startswith(("[", "<"))]
        flags = {o for a in parser._actions for o in a.option_strings}
        bad += [f"bench.{name} {args}: no flag {w}" for w in words if w.startswith("--") and w.split("=")[0] not in flags]
    assert not bad, f"{path.name}: " + "; ".join(bad)


# --- the lab's guide: every command is run by a test, or named as real-cluster only ------------------
GUIDE = ROOT / "docs" / "lab-guide.md"
# Commands that are neither raymcn's nor the launcher's, each with the file that runs it and a
# string that file must hold (so the mapping cannot outlive what it points at).
RUN_ELSEWHERE = {
    'pip install "ray[default]==2.60.0"': ("tests/test_cluster_yaml.py", "==2.60.0"),  # the pin setup installs
    "make install": (".ci/run", "make test"),  # CI installs through the same target
    "source .venv/bin/activate": ("Makefile", "VENV ?= .venv"),
}
# Commands only a real cluster (or a person at a terminal) runs; the guide must say so in its
# section on what the tests run.
REAL_CLUSTER_ONLY = {
    ("attach", "--tmux"): "it takes over the terminal; the tmux session it shows is the launcher tier's",
}


@functools.cache
def _launcher_commands() -> set[tuple[str, ...]]:
    """(subcommand, its flags) of every `ray` command tests/test_launcher.py runs through `_ray`."""
    tree = ast.parse((ROOT / "tests" / "test_launcher.py").read_text())
    runs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_ray":
            words = []
            for arg in node.args:
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                    break  # the cluster file: what follows is the command's own arguments
                words.append(arg.value)
            runs.add(_ray_key(words))
    return runs


def _ray_key(words: list[str]) -> tuple[str, ...]:
    """A `ray` command's subcommand and flags, without the confirmation skip (-y)."""
    return (words[0], *sorted(w for w in words[1:] if w.startswith("-") and w not in ("-y", "--yes")))


def _uncovered(line: str) -> str | None:
    """Why no test covers the command ``line``, or None when one does."""
    if line.startswith("raymcn "):
        return None  # checked against the parser by test_every_raymcn_command_shown_...
    if line.startswith("ray "):
        words = shlex.split(line)
        head = words[:words.index("--")] if "--" in words else words
        if words[1] == "exec":
            head = [w for w in head if w != head[-1]]  # the command it runs is checked on its own
            inner = words[-1]
            if not inner.startswith("raymcn "):
                return f"`{inner}` (run by ray exec) is not a raymcn command"
        key = _ray_key([w for w in head[1:] if w.startswith("-") or w == head[1]])
        if key in _launcher_commands() or key in REAL_CLUSTER_ONLY:
            return None
        return f"tests/test_launcher.py runs no `ray {' '.join(key)}`"
    for command, (where, evidence) in RUN_ELSEWHERE.items():
        if line == command:
            return None if evidence in (ROOT / where).read_text() else f"{where} no longer holds {evidence!r}"
    return "no test runs it"


def test_every_command_of_the_lab_guide_is_run_by_a_test():
    lines = _block_lines(GUIDE.read_text())
    assert len(lines) >= 12, "the guide's code blocks were not found"
    bad = [f"{line}: {why}" for line in lines if (why := _uncovered(line))]
    assert not bad, "commands of docs/lab-guide.md that no test covers:\n" + "\n".join(bad)


def test_the_guide_names_what_only_the_real_cluster_runs():
    text = re.sub(r"\s+", " ", GUIDE.read_text())
    section = text[text.index("## What the tests run"):text.index("## Troubleshooting")]
    for key in REAL_CLUSTER_ONLY:
        assert f"`ray {' '.join(key)}`" in section, f"the guide does not say that only the cluster runs ray {key}"
    assert ("get-auth-token", "--generate") in _launcher_commands()  # the parse found the launcher's commands


def test_the_pin_the_guide_installs_is_the_clusters():
    pin = re.search(r'pip install "ray\[default\]==([\d.]+)"', GUIDE.read_text()).group(1)
    assert f"=={pin}" in (ROOT / "cluster.yaml").read_text()


# --- figures quoted in several places: each equals its one source ------------------------------------
def _measured(name: str) -> dict:
    return json.loads((ROOT / "docs" / "measurements" / f"{name}.json").read_text())


def _loader(dtype: str, key: str = "b") -> float:
    """bench/loader.py at HowTo100M size: a path's videos/s (b: raymcn's reader), or a plain figure."""
    value = _measured("loader")["results"]["long"]["dtypes"][dtype][key]
    return value["videos_per_s"] if isinstance(value, dict) else value


def _original_loader() -> float:
    """bench/loader.py's (a): one np.load per npz file, videos/s."""
    return _measured("loader")["results"]["long"]["a"]["videos_per_s"]


def _cell(page: str, pattern: str) -> str:
    """A figure read from the page that is its source (a measured table)."""
    return re.search(pattern, _flat(page)).group(1)


@functools.cache
def _flat(page: str) -> str:
    return re.sub(r"\s+", " ", (ROOT / page).read_text())


@functools.cache
def _estimate(use_gpu: bool = True, workers: int | None = None, over: tuple = ()) -> dict:
    from raymcn.config import load_config
    from raymcn.train.preflight import footprint

    extra = {"scale.use_gpu": use_gpu, **({"scale.num_workers": workers} if workers else {}), **dict(over)}
    return footprint.estimate_worker_memory(load_config(ROOT / "sweeps" / "paper.yaml", extra))


@functools.cache
def _preflight_message(device_bytes: int) -> tuple[str, dict]:
    """What the preflight says for the paper's batch on one GPU (bench/grad_cache.py --only preflight)."""
    from raymcn.config import Config
    from raymcn.train.preflight import footprint

    ok, message, over = footprint.fits(Config().replace({"scale.num_workers": 1, "scale.use_gpu": True}), device_bytes)
    return message, over


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _case_count() -> int:
    tree = ast.parse((ROOT / "tests" / "test_preflight.py").read_text())
    cases = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "CASES")
    return len(cases.elts)


def _lines_of(name: str) -> int:
    return len(next(ROOT.joinpath("raymcn").rglob(name)).read_text().splitlines())


CHECKPOINT_ASYNC = r"\*\*stall, upload in Ray's thread \(`async`, raymcn's\)\*\* \| \*\*([\d.]+) s\*\*"
CHECKPOINT_SYNC = r"\| stall, upload in the step loop \(`sync`\) \| ([\d.]+) s:"
SWEEP = ROOT / "sweeps" / "stage_order_bohb.yaml"

# (what, its source as text, [(page, pattern with one group per figure)]). Every pattern must match
# its page at least once (whitespace runs count as one space), and every match must equal the
# source. A figure reworded on a page fails here until its pattern follows.
FIGURES = [
    ("fp16 shards: videos/s with clips drawn (bench/loader.py)", lambda: f"{_loader('float16'):.0f}", [
        ("README.md", r"\| fp16 \(default\) \| [\d.]+ MB \| (\d+) \|"),
        ("docs/performance.md", r"\*\*\(b\) raymcn[^|]*\| \*\*\d+ \(\d+\)\*\* \| \*\*(\d+) \("),
        ("docs/performance.md", r"delivers (\d+) HowTo100M videos/s"),
        ("docs/faults.md", r"at the (\d+) videos/s of the loader benchmark")]),
    ("fp32 shards: videos/s with clips drawn", lambda: f"{_loader('float32'):.0f}", [
        ("README.md", r"\| fp32 \| [\d.]+ MB \| (\d+) \|"),
        ("docs/performance.md", r"\*\*\(b\) raymcn[^|]*\| \*\*(\d+) \(")]),
    ("the original loader: videos/s", lambda: f"{_original_loader():.0f}", [
        ("README.md", r"one `np.load` per npz file \((\d+)/s\)"),
        ("docs/performance.md", r"\(a\) original: one `np.load` per npz, 1 process[^|]*\| (\d+) \(")]),
    ("MB per video, fp32 and fp16 shards", lambda: f"{_loader('float32', 'mb_per_video'):.2f} "
                                                   f"{_loader('float16', 'mb_per_video'):.2f}", [
        ("README.md", r"\| fp32 \| ([\d.]+) MB \| \d+ \| [\d.]+× \| \| fp16 \(default\) \| ([\d.]+) MB"),
        ("docs/performance.md", r"fp32 shards, ([\d.]+) MB per video \| fp16 shards \(default\), ([\d.]+) MB")]),
    ("fp16 shards against the original loader", lambda: f"{_loader('float16') / _original_loader():.1f}", [
        ("README.md", r"\| fp16 \(default\) \| [\d.]+ MB \| \d+ \| ([\d.]+)× \|"),
        ("README.md", r"at ([\d.]+)× the original loader's videos/s"),
        ("docs/performance.md", r"([\d.]+)× the original one-file-per-`np.load` loader")]),
    ("replaying 90 % of a HowTo100M epoch at the loader's speed, hours",
     lambda: f"{1.05e6 / round(_loader('float16')) / 3600:.1f}", [
        ("docs/faults.md", r"~([\d.]+) h at the \d+ videos/s")]),
    ("fp16 shards' bytes against fp32 (bench/shard_dtype.py)",
     lambda: f"{_measured('shard_dtype')['bytes']['float16'] / _measured('shard_dtype')['bytes']['float32']:.2f}", [
        ("README.md", r"as fp16 \(([\d.]+)× the bytes of fp32"),
        ("README.md", r"fp16 features \(([\d.]+)× the bytes\)"),
        ("docs/data.md", r"for ([\d.]+)× the bytes")]),
    ("a paper-dims checkpoint's stall, upload in Ray's thread (docs/faults.md's table)",
     lambda: _cell("docs/faults.md", CHECKPOINT_ASYNC), [
        ("raymcn/config.py", r"a paper-dims checkpoint stalled the steps ([\d.]+) s"),
        ("docs/settings.md", r"a paper-dims checkpoint stalled the steps ([\d.]+) s")]),
    ("a paper-dims checkpoint's stall, upload in the step loop (docs/faults.md's table)",
     lambda: _cell("docs/faults.md", CHECKPOINT_SYNC), [
        ("raymcn/config.py", r"\(([\d.]+) s with the upload in the step loop"),
        ("docs/settings.md", r"\(([\d.]+) s with the upload in the step loop"),
        ("docs/faults.md", r"a paper-dims checkpoint caused, ([\d.]+) s with the upload in the step loop")]),
    ("a question about a drained node, ms (bench/drain_check.py)", lambda: f"{_measured('drain_check')['ask_ms']:.2f}", [
        ("docs/faults.md", r"\*\*([\d.]+) ms per question\*\*"),
        ("raymcn/config.py", r"a barrier over the ranks: ([\d.]+) ms with 2 workers"),
        ("docs/settings.md", r"a barrier over the ranks: ([\d.]+) ms with 2 workers")]),
    ("asking every 10 steps, % of the A100 step floor",
     lambda: f"{_measured('drain_check')['share_of_step']['10'] * 100:.2f}", [
        ("docs/faults.md", r"every 10 steps ([\d.]+) %"),
        ("raymcn/config.py", r"([\d.]+) % of a paper step at every 10 steps"),
        ("docs/settings.md", r"([\d.]+) % of a paper step at every 10 steps")]),
    ("activations of a paper share, bf16 and fp32 (the preflight's estimate)",
     lambda: f"{_gib(_estimate()['activations'])} {_gib(_estimate(use_gpu=False)['activations'])}", [
        ("docs/memory.md", r"([\d.]+) GiB under bf16 autocast on GPU, ([\d.]+) GiB in fp32 on CPU")]),
    ("a paper share's whole estimate (sweeps/paper.yaml)", lambda: _gib(_estimate()["total"]), [
        ("sweeps/paper.yaml", r"the preflight estimates ([\d.]+) GiB")]),
    ("the paper's batch on one 24 GB GPU: the preflight's message", lambda: _preflight_message(24 * 10**9)[0], [
        ("docs/memory.md", r"``` (does not fit: estimated .*?\(scale\.num_workers\)\.) ```")]),
    ("the paper's batch on one 40 GB A100: estimate, usable, with caching",
     lambda: " ".join([_gib(_estimate(workers=1)["total"]), f"{40 * 10**9 * 0.9 / 2**30:.2f}",
                       _gib(_estimate(workers=1, over=tuple(_preflight_message(40 * 10**9)[1].items()))["total"])]), [
        ("docs/memory.md", r"On a 40 GB A100 the estimate \(([\d.]+) GiB of ([\d.]+) usable\) also asks for caching, "
                           r"again 2 chunks of 2048 clips \(([\d.]+) GiB\)")]),
    ("the one-minute run: R@10 and chance (docs/performance.md)",
     lambda: "{:.0f} {}".format(float(_cell("docs/performance.md", r"\*\*R@10 = ([\d.]+) %\*\*")),
                                _cell("docs/performance.md", r"where chance is \*\*([\d.]+) %\*\*")), [
        ("README.md", r"R@10 ≈ (\d+) % where chance is ([\d.]+) %")]),
    ("the embedded default sweep's answer (docs/sweeps.md's example)",
     lambda: _cell("docs/sweeps.md", r"(Answer: VT_A .*? would likely go unseen\.)"), [
        ("README.md", r"(Answer: VT_A .*? would likely go unseen\.)")]),
    ("malformed configs the preflight test feeds", lambda: str(_case_count()), [
        ("docs/memory.md", r"feeds (\d+) malformed configs")]),
    ("the sweep's confirmation: seeds and epochs (sweeps/stage_order_bohb.yaml)",
     lambda: "{} {}".format(*(lambda c: (c["sweep"]["confirm"]["repeats"], c["schedule"]["epochs"]))(
         __import__("yaml").safe_load(SWEEP.read_text()))), [
        ("README.md", r"over (\d+) fresh seeds at the full (\d+) epochs"),
        ("docs/lab-guide.md", r"over (\d+) fresh seeds at the full (\d+) epochs"),
        ("docs/sweeps.md", r"confirmed over (\d+) fresh seeds at the full (\d+) epochs"),
        ("docs/sweeps.md", r"confirms over (\d+) seeds at the full (\d+) epochs")]),
    ("the batch pipeline: later and first batch waits with and without the thread, ms (bench/overhead.py)",
     lambda: "{:.1f} {:.1f} {:.1f} {:.1f}".format(*(lambda m: (
         m["train-raydata"]["data"], m["train-raydata-noprefetch"]["data"],
         m["train-raydata"]["first batch"], m["train-raydata-noprefetch"]["first batch"]))(
         _measured("overhead")["step_ms"])), [
        ("docs/ray-cost.md", r"the wait per later batch is ([\d.]+) ms with the thread and ([\d.]+) ms without, the "
                             r"epoch's first batch ([\d.]+) ms and ([\d.]+) ms")]),
    ("raymcn's samples/s against the same ranks as plain Ray actors (bench/overhead.py)",
     lambda: f"{_measured('overhead')['arm4_over_arm2']:.2f}", [
        ("docs/ray-cost.md", r"Goal arm 4 ≥ 0\.9 × arm 2: \*\*([\d.]+), met"),
        ("docs/ray-cost.md", r"\*\*4 TorchTrainer \+ Ray Data \(raymcn as it runs\)\*\* \| \*\*\d+\*\* \| \*\*([\d.]+)\*\*"),
        ("docs/performance.md", r"trains at \*\*([\d.]+)\*\* of the same ranks as plain Ray actors")]),
    ("the embedded default sweep before and after, minutes (bench/sweep_time.py)",
     lambda: "{:.2f} {:.2f}".format(*(lambda m: (m["baseline"], m["current"]))(
         {k: v / 60 for k, v in _measured("sweep_time")["median_wall_s"].items()})), [
        ("docs/ray-cost.md", r"([\d.]+) min before this work, \*\*([\d.]+) min\*\* now"),
        ("docs/performance.md", r"sweep took ([\d.]+) min before this work and ([\d.]+) min after")]),
    ("a sweep trial's wall and fixed cost, s (bench/trial_cost.py)",
     lambda: "{:.1f} {:.1f}".format(*(lambda m: (m["wall_s"], m["fixed_s"]))(
         _measured("trial_cost")["steady"]["current"])), [
        ("docs/ray-cost.md", r"trial wall / fixed cost \(wall − steps\) \| ([\d.]+) / ([\d.]+) \|")]),
]
# Sizes quoted as "about N lines": within 10 % of the file's length.
ABOUT_LINES = [("docs/development.md", r"At about (\d+) lines it is the longest", "config.py")]


@pytest.mark.parametrize("what, source, quotes", FIGURES, ids=[f[0][:50] for f in FIGURES])
def test_a_figure_quoted_in_several_places_equals_its_source(what, source, quotes):
    expected = source()
    bad = []
    for page, pattern in quotes:
        found = [" ".join(m.groups()) for m in re.finditer(pattern, _flat(page))]
        if not found:
            bad.append(f"{page}: the quote of {what!r} was not found (reworded? update its pattern here)")
        bad += [f"{page} says {f!r}, the source says {expected!r}" for f in found if f != expected]
    assert not bad, f"{what}: " + "; ".join(bad)


@pytest.mark.parametrize("page, pattern, name", ABOUT_LINES, ids=[a[2] for a in ABOUT_LINES])
def test_a_quoted_file_size_is_about_right(page, pattern, name):
    quoted, actual = int(re.search(pattern, _flat(page)).group(1)), _lines_of(name)
    assert abs(quoted - actual) <= 0.1 * actual, f"{page} says about {quoted} lines; {name} has {actual}"


# --- defaults quoted on the pages equal the generated settings page -----------------------------------
_KEY = r"`([a-z]+\.[a-z_0-9]+)`"
_VALUE = r"`?([\w.]+)`?(?: ?(ms|s|min|h)\b)?"
DEFAULT_QUOTES = [  # "`key` (default 120 s)", "`key`, default 3", "`key` = 20", "`key` (30 min)", "default (`key: v`)"
    _KEY + r"(?: [a-z]+)?,? \(?default:? " + _VALUE,
    _KEY + r" = " + _VALUE,
    _KEY + r" \(([\d.]+) ?(ms|s|min|h)\b",
    r"default[^.`]{0,20}`([a-z]+\.[a-z_0-9]+): ([\w.]+)`()",
]
_SECONDS = {"ms": 0.001, "s": 1, "min": 60, "h": 3600}


def _settings_defaults() -> dict[str, str]:
    page = (ROOT / "docs" / "settings.md").read_text()
    return dict(re.findall(r"^\| `([a-z]+\.[a-z_0-9]+)` \| `([^`]*)` \|", page, flags=re.M))


def _as_value(text: str, unit: str | None = None):
    """A default or a quote of it, comparable: seconds for durations, numbers, else the text."""
    from raymcn.config import parse_interval

    if unit:
        return float(text) * _SECONDS[unit]
    try:
        return float(text)
    except ValueError:
        interval = parse_interval(text) if re.fullmatch(r"\d+[smh]", text) else None
        return interval[1] if interval else text


def default_quotes(text: str) -> list[tuple[str, str, str | None]]:
    """(key, value, unit) of every default the text quotes, in the forms of DEFAULT_QUOTES."""
    flat = re.sub(r"\s+", " ", text)
    return [(m.group(1), m.group(2), m.group(3) or None) for form in DEFAULT_QUOTES for m in re.finditer(form, flat)]


@pytest.mark.parametrize("page", [p for p in DOCS if p.name != "settings.md"], ids=lambda p: p.name)
def test_a_quoted_default_equals_the_settings_page(page):
    defaults = _settings_defaults()
    bad = [f"`{key}`: the page says {value}{' ' + unit if unit else ''}, the default is {defaults[key]}"
           for key, value, unit in default_quotes(page.read_text())
           if key in defaults and _as_value(value, unit) != _as_value(defaults[key])]
    assert not bad, f"{page.name}: " + "; ".join(bad)


def test_the_default_check_reads_the_quotes_it_should():
    quotes = {(k, v, u) for k, v, u in default_quotes(GUIDE.read_text())}
    assert ("run.checkpoint_every", "30", "min") in quotes and ("run.stall_timeout_s", "600", "s") in quotes
    assert _as_value("30", "min") == _as_value("30m") and _as_value("10", "min") == _as_value("600.0")
