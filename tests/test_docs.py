"""The documentation a user reads is checked against the code and the measurements: every figure and
console block is what ``python -m tools.docgen`` writes from docs/measurements (and the captured
console texts still have the form today's code prints), the settings page is the generated
reference, every relative link resolves, every ``raymcn ...`` and ``python -m bench.NAME`` command
shown parses with the real parsers, every command in the README's and the lab's guide's code
blocks says how the suite runs it (tools/doc_commands.py: one marked run is run as written by a
named test), and a quoted default equals the settings page."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from test_sweep_summary import confirmed  # noqa: F401 (a fixture: a sweep of the embedded default's shape)

from raymcn.cli import build_parser
from raymcn.reference import field_comments, reference
from tools.doc_commands import COMMANDS, RUN

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "docs" / "measurements"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_settings_page_is_the_generated_reference():
    from raymcn.model.parts import part_names

    page = (ROOT / "docs" / "settings.md").read_text()
    assert page == reference(part_names()), "docs/settings.md is stale: run `raymcn config --reference > docs/settings.md`"


def test_every_setting_has_a_meaning_in_the_reference():
    import dataclasses

    from raymcn.config import Config

    comments = field_comments()
    missing = [f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
               for f in dataclasses.fields(type(getattr(Config(), s.name)))
               if not comments.get(type(getattr(Config(), s.name)).__name__, {}).get(f.name)]
    assert not missing, f"settings without a comment at their field in raymcn/config/sections.py: {missing}"


def _links(text: str) -> list[str]:
    return [m for m in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", m) and not m.startswith("#")]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = [link for link in _links(page.read_text()) if not (page.parent / link.split("#")[0]).exists()]
    assert not broken, f"{page.name}: links to files that do not exist: {broken}"


def _block_lines(text: str, language: str = r"(?:bash|sh|console)?") -> list[str]:
    """Every command line of the page's code blocks in ``language`` (a pattern; default: the shell
    blocks and the unlabelled ones): continuations joined, comments dropped."""
    lines = []
    for block in re.findall(rf"```{language}\n(.*?)```", text, flags=re.S):
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


def _subcommands() -> dict[str, set[str]]:
    """subcommand -> the option strings it accepts (from the real parser)."""
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    real = {name: {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}
    return real


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


# --- every command of the README's and the guide's code blocks: how the suite runs it --------------------
GUIDE = ROOT / "docs" / "lab-guide.md"
RUN_PAGES = [ROOT / "README.md", GUIDE]


def _flags(words: list[str]) -> list[str]:
    return sorted({w.split("=", 1)[0] for w in words if w.startswith("--")})


def signature(line: str) -> str:
    """A command's shape: the program and its subcommand, then its flags sorted (values, paths and
    the cluster file left out); what `ray exec` or `ray submit ... sweep.py --` run follows a `|`."""
    words = shlex.split(line)
    if words[:2] == ["ray", "exec"]:
        return "ray exec | " + signature(words[-1])
    if words[:2] == ["ray", "submit"] and "--" in words:
        cut = words.index("--")
        return " ".join(["ray submit", *_flags(words[:cut]), "| sweep.py", *_flags(words[cut + 1:])])
    head = words[:3] if words[:2] == ["python", "-m"] else words[:2]
    if head[:1] == ["pip"]:
        head = ["pip", "install"]
    return " ".join([*head, *_flags(words[len(head):])])


def _bash_lines(text: str) -> list[str]:
    """Every command line of the page's ```bash blocks."""
    return _block_lines(text, "bash")


def _defined(path: Path, name: str) -> bool:
    if path.suffix != ".py":
        return name in path.read_text()
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree))


def test_signature_keeps_the_shape_and_drops_values():
    assert signature("ray exec cluster.yaml 'raymcn table /shared/x'") == "ray exec | raymcn table"
    assert signature("ray submit --tmux c.yaml sweep.py -- --config a.yaml") == "ray submit --tmux | sweep.py --config"
    assert signature("raymcn train --config x --json --num-workers 2") == "raymcn train --config --json --num-workers"


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.name)
def test_every_command_of_the_readme_and_the_guide_says_how_the_suite_runs_it(page):
    lines = _bash_lines(page.read_text())
    assert lines, f"{page.name}: no ```bash block found"
    missing = sorted({f"{line}  [{signature(line)}]" for line in lines if signature(line) not in COMMANDS})
    assert not missing, (f"{page.name}: commands the registry does not have (add them to tools/doc_commands.py "
                         "with the tests that run or check them):\n" + "\n".join(missing))


@pytest.mark.parametrize("shape", sorted(COMMANDS))
def test_the_tests_named_for_a_documented_command_exist(shape):
    gone = [w for w in COMMANDS[shape].tests if not _defined(ROOT / w.split("::")[0], w.split("::", 1)[1])]
    assert not gone, f"{shape}: named tests or evidence that no longer exist: {gone}"
    assert COMMANDS[shape].kind == RUN or COMMANDS[shape].how, f"{shape}: say what changes, or why it is not run"


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _calls(path: Path, name: str) -> list[set[str]]:
    """The words of each call's string arguments, one set per call, in ``name`` (a test, fixture or
    helper of ``path``) and in every function of ``path`` it calls or takes as a fixture."""
    defs = {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
    seen, todo, calls = set(), [name], []
    while todo:
        fn = defs.get(todo.pop())
        if fn is None or fn.name in seen:
            continue
        seen.add(fn.name)
        todo += [a.arg for a in fn.args.args]
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                if isinstance(node.func, ast.Name):
                    todo.append(node.func.id)
                calls.append({w for arg in node.args for text in _strings(arg) for w in text.split()})
    return calls


def _words(line: str) -> set[str]:
    """What a test must pass in one call to run ``line`` as written: every word but the program, the
    cluster file (a test fills in a copy) and ``--``; a `ray exec`'s command word by word."""
    words = shlex.split(line)[1:]
    if words[:1] == ["exec"]:
        words = words[:-1] + shlex.split(words[-1])[1:]
    return {w for w in words if w not in ("--", "cluster.yaml")}


def runs_as_written(line: str, where: str) -> bool:
    """Whether ``where`` (FILE::NAME) runs ``line`` as written: a Python test through one call that
    holds every word of it, any other file (CI's script) by holding the line itself."""
    path, name = ROOT / where.split("::")[0], where.split("::", 1)[1]
    if path.suffix != ".py":
        return name == line and line in (s.strip() for s in path.read_text().splitlines())
    return any(_words(line) <= call for call in _calls(path, name))


def test_runs_as_written_reads_what_a_test_passes():
    assert runs_as_written("ray up cluster.yaml", "tests/test_launcher.py::cluster")
    assert runs_as_written("ray submit --tmux cluster.yaml sweep.py -- --config sweeps/smoke.yaml",
                           "tests/test_launcher.py::test_a_killed_sweep_resumed_by_hand")
    # a test that submits with --tmux and resumes without it runs neither command of the other's words
    assert not runs_as_written("ray submit --tmux cluster.yaml sweep.py -- --resume latest",
                               "tests/test_launcher.py::test_a_killed_sweep_resumed_by_hand")
    assert not runs_as_written("make install", ".ci/run::make test")


@pytest.mark.parametrize("shape", sorted(s for s, shown in COMMANDS.items() if shown.kind == RUN))
def test_a_command_marked_run_is_run_as_written_by_a_named_test(shape):
    lines = sorted({line for page in RUN_PAGES for line in _bash_lines(page.read_text()) if signature(line) == shape})
    unrun = [line for line in lines if not any(runs_as_written(line, w) for w in COMMANDS[shape].tests)]
    assert not unrun, (f"{unrun}: no test named in tools/doc_commands.py runs it as written; name the test that "
                       "does, or mark it run with changes (saying which) or parsed only")


def _parse_ray(line: str) -> None:
    """Ray's own CLI parses ``line`` (click; nothing runs): an unknown command or flag raises."""
    import click
    from ray.scripts.scripts import cli

    words = shlex.split(line)[1:]
    ctx = click.Context(cli)
    command = cli.get_command(ctx, words[0])
    assert command is not None, f"{line}: Ray has no command {words[0]!r}"
    command.make_context(words[0], words[1:], parent=ctx)


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.name)
def test_a_ray_command_shown_parses_with_rays_own_cli(page):
    import click

    with pytest.raises(click.UsageError):
        _parse_ray("ray attach --tmuxx cluster.yaml")
    for line in _bash_lines(page.read_text()):
        if line.startswith("ray "):
            _parse_ray(line)


def test_every_registered_command_is_still_documented():
    shown = {signature(line) for page in RUN_PAGES for line in _bash_lines(page.read_text())}
    assert not set(COMMANDS) - shown, f"registered but no longer on a page: {sorted(set(COMMANDS) - shown)}"


def test_the_pin_the_guide_installs_is_the_clusters():
    pin = re.search(r'pip install "ray\[default\]==([\d.]+)"', GUIDE.read_text()).group(1)
    assert f"=={pin}" in (ROOT / "cluster.yaml").read_text()


# --- figures and console blocks: generated from docs/measurements, and still of today's form ----------
def test_every_page_is_what_the_generator_writes():
    from tools import docgen

    stale = [str(p.relative_to(ROOT)) for p in docgen.stale_pages()]
    assert not stale, f"{stale}: run `python -m tools.docgen` (docs/development.md says how the pages are generated)"


def _measurements() -> list[Path]:
    return sorted((ROOT / "docs" / "measurements").glob("*.json"))


# What bench.harness (and tools.test_durations) write about where figures come from: a run stamps what it
# knows, and says so when its checkout had uncommitted changes. Anything else about a run's provenance
# (a machine, commit or command filled in afterwards, a note explaining them) was written by hand.
HARNESS_NOTES = {"commit_note": {"measured with uncommitted changes to tracked files", "not run from a git checkout",
                                 "git is not installed"}}


def _hand_written(figures: dict, where: str = "") -> list[str]:
    """The keys of ``figures`` (nested too) that only a person writes: notes about a run's machine,
    commit or command, or a stamp note other than the harness's own."""
    out = []
    for key, value in figures.items():
        if isinstance(value, dict):
            out += _hand_written(value, f"{where}{key}.")
        elif key in ("machine_note", "command_note", "note") or \
                (key in HARNESS_NOTES and value not in HARNESS_NOTES[key]) or "not recorded by the run" in str(value):
            out.append(f"{where}{key}")
    return out


def test_a_note_written_by_hand_is_found():
    assert _hand_written({"commit_note": "measured with uncommitted changes to tracked files", "x": {"y": 1}}) == []
    assert _hand_written({"machine": "a", "machine_note": "corrected", "sweep": {"command_note": "from notes"},
                          "commit_note": "the commit that added this file"}) == \
        ["machine_note", "sweep.command_note", "commit_note"]


@pytest.mark.parametrize("path", _measurements(), ids=lambda p: p.name)
def test_every_measurement_says_where_it_comes_from_and_nothing_is_filled_in_by_hand(path):
    """A figure is only as good as the machine and the code it was measured with. A JSON carries what
    its run recorded (bench.harness stamps machine, commit and command) and nothing added by hand; the
    commit that wrote its figures comes from git (docgen.written_at), so every page can name the code
    the figures describe; a recorded commit is one of this repository; the command shown for it, the
    recorded one or the one that writes it again (docgen.RERUN), parses with its benchmark's parser."""
    import importlib
    import subprocess

    from tools import docgen

    figures = json.loads(path.read_text())
    assert not _hand_written(figures), f"{path.name}: provenance written by hand: {_hand_written(figures)}"
    assert docgen.written_at(path.stem), f"{path.name}: its figures are not committed (git knows no commit that wrote them)"
    if docgen.recorded_commit(path.stem):
        known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{figures['commit']}^{{commit}}"],
                               capture_output=True, check=False).returncode == 0
        assert known, f"{path.name}: commit {figures['commit']!r} is not a commit of this repository"
    words = shlex.split(docgen.rerun(path.stem))
    if words[:2] == ["python", "-m"] and words[2].startswith("bench."):
        importlib.import_module(words[2]).build_parser().parse_args(words[3:])  # exits on an unknown flag


def test_the_commit_that_wrote_a_measurement_ignores_a_later_edit_of_its_stamp():
    """loader.json's figures were written at 19d8398; later commits changed only what was written
    around them (its provenance, added and then removed)."""
    from tools import docgen

    assert docgen.written_at("loader") == "19d8398"


def test_every_measurement_has_the_code_that_writes_it_listed():
    """`python -m tools.docgen --stale` can judge every JSON: each has its producing files in
    docgen.PRODUCERS, and each file listed exists."""
    from tools import docgen

    assert {p.stem for p in _measurements()} == set(docgen.PRODUCERS), "list the JSON's producing code in PRODUCERS"
    gone = sorted({p for paths in docgen.PRODUCERS.values() for p in paths if not (ROOT / p).exists()})
    assert not gone, f"PRODUCERS names files that do not exist: {gone}"


def test_a_measurement_is_stale_only_when_todays_code_gives_other_figures(monkeypatch):
    """Commits since a measurement never make it stale (its page shows its commit); a quick form that
    computes other figures today does, and so does a commit this repository lacks."""
    import subprocess

    from tools import docgen

    first = subprocess.run(["git", "-C", str(ROOT), "rev-list", "--max-parents=0", "HEAD"], capture_output=True,
                           text=True, check=True).stdout.split()[0]
    today = {"preflight": [{"message": "fits"}]}
    monkeypatch.setattr(docgen, "QUICK", {"preflight": ("tests/test_docs.py::a_test", lambda: today)})
    assert docgen.stale_measurements({"preflight": {"commit": first, **today}, "kmeans": {"commit": first}}) == {}
    stale = docgen.stale_measurements({"preflight": {"commit": "HEAD", "preflight": [{"message": "other"}]},
                                       "memory": {"commit": "0" * 40}})
    assert set(stale) == {"preflight", "memory"}, stale
    assert "not in this repository" in stale["memory"]
    assert stale["preflight"] == "today's code computes other preflight (checked by tests/test_docs.py::a_test)"


def test_every_quick_form_is_a_measurement_recomputed_by_a_named_test():
    from tools import docgen

    for name, (test, _) in docgen.QUICK.items():
        path, _, function = test.partition("::")
        assert (MEASURED / f"{name}.json").exists() and f"def {function}(" in (ROOT / path).read_text(), name


def test_a_commit_that_touches_no_measured_code_leaves_the_stale_list_as_it_was(tmp_path):
    """In a clone of this checkout: a commit of a page and of a new model part (a class and its
    table entry, which the default run's figures do not depend on) leaves `--stale`'s stale list
    as it was, and a page-only commit its whole output; a commit that changes what the preflight
    prints (the CUDA context's allowance) makes preflight.json stale."""
    import subprocess

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(clone)], check=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "HEAD", "--binary"], capture_output=True, check=True).stdout
    new = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--others", "--exclude-standard"], capture_output=True,
                         text=True, check=True).stdout.split()
    if dirty or new:  # the checkout's uncommitted changes, as they are (the test runs on today's code)
        if dirty:
            subprocess.run(["git", "-C", str(clone), "apply", "--whitespace=nowarn"], input=dirty, check=True)
        for name in new:
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
        _commit(clone, "the checkout's uncommitted changes")

    def stale() -> tuple[int, str]:
        done = subprocess.run([sys.executable, "-m", "tools.docgen", "--stale"], cwd=clone, capture_output=True,
                              text=True, check=False, env={**os.environ, "PYTHONPATH": str(clone)})
        return done.returncode, done.stdout + done.stderr

    before = stale()
    assert before[0] == 0, before  # the checkout's own measurements: none stale
    (clone / "docs" / "memory.md").write_text((clone / "docs" / "memory.md").read_text() + "\nA sentence.\n")
    _commit(clone, "a page")
    assert stale() == before
    (clone / "raymcn" / "model" / "mean_text.py").write_text(MEAN_TEXT_ENCODER)
    parts = clone / "raymcn" / "model" / "parts.py"
    parts.write_text(parts.read_text().replace('"text_encoder": {"gated": GatedTextEncoder}',
                                               '"text_encoder": {"gated": GatedTextEncoder, "mean": MeanTextEncoder}')
                     .replace("from raymcn.model.heads import MLPReconHead",
                              "from raymcn.model.heads import MLPReconHead\nfrom raymcn.model.mean_text import "
                              "MeanTextEncoder"))
    _commit(clone, "a new text encoder")
    after = stale()
    assert after[0] == 0 and [line for line in after[1].splitlines() if "STALE" in line] == [], after
    footprint = clone / "raymcn" / "train" / "preflight" / "footprint.py"
    footprint.write_text(footprint.read_text().replace("CUDA_CONTEXT_BYTES = 512 << 20",
                                                      "CUDA_CONTEXT_BYTES = 768 << 20"))
    _commit(clone, "a larger CUDA context")
    changed = stale()
    assert changed[0] == 1, changed
    assert "docs/measurements/preflight.json: STALE: today's code computes other preflight" in changed[1]


MEAN_TEXT_ENCODER = '''"""A text encoder: the mean of the caption's word vectors, then a Linear."""

from __future__ import annotations

from torch import nn

from raymcn.config import ModelConfig
from raymcn.model.branch import TextEncoder, word_mask


class MeanTextEncoder(TextEncoder):
    inputs = ("text", "nwords")

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.fc = nn.Linear(cfg.word_dim, cfg.embed_dim)
        self.target_dim = cfg.word_dim

    def forward(self, batch):
        keep = word_mask(batch["nwords"], batch["text"].shape[1]).unsqueeze(-1).to(batch["text"].dtype)
        mean = (batch["text"] * keep).sum(dim=1) / keep.sum(dim=1)
        return self.fc(mean), mean
'''


def _commit(repo, message: str) -> None:
    import subprocess

    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message],
                   check=True)


def test_every_note_names_a_measurement_and_a_commit_of_this_repository():
    import subprocess

    from tools import docgen

    assert set(docgen.HELD) <= set(docgen.PRODUCERS)
    for name, note in docgen.HELD.items():
        known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{note.through}^{{commit}}"],
                               capture_output=True, check=False).returncode == 0
        assert known and note.why, f"{name}: its note reads through {note.through!r}, not a commit here"


def test_every_generator_is_used_and_every_marker_has_one():
    from tools import docgen

    used = {m.group(1) for p in docgen.PAGES for m in docgen.MARK.finditer(p.read_text())}
    assert used == set(docgen.GENERATORS), (f"unused: {sorted(set(docgen.GENERATORS) - used)}; "
                                            f"unknown: {sorted(used - set(docgen.GENERATORS))}")


@pytest.mark.parametrize("name", ["config_error"])
def test_a_captured_command_still_prints_what_its_file_holds(name, capsys):
    from raymcn.cli import main
    from tools import docgen

    argv = docgen.CAPTURES[name]
    main(argv[1:])
    out = capsys.readouterr()
    assert f"$ {' '.join(argv)}\n{out.out}{out.err}".rstrip("\n") == docgen.txt(name), \
        f"rerun `python -m tools.docgen --capture {name}`"


def _form(text: str) -> list[str]:
    """A console text's form: table rows and the answer's wrapped lines reduced to their kind,
    numbers to 9, folders to EXP, the lists of file names dropped (they depend on the sweep)."""
    out = []
    text = re.sub(r" in\n\s+(?=[~/])", " in ", text)  # a folder wrapped onto its own line, or not, by its length
    for line in text.splitlines():
        listed = re.sub(r"\S+\.(png|csv),?", "", line).rstrip()  # where a list wraps depends on the folder's length
        if line.strip() and not listed.strip():
            continue
        line = listed
        if line.startswith("|") and not line.startswith("| schedule") and not line.startswith("|---"):
            line = "| row |"
        elif out and out[-1] == "Answer:" and line:
            continue  # the answer's wrapped lines
        elif line.startswith("Answer:"):
            line = "Answer:"
        line = re.sub(r"(~|/)\S*sweep-\S+", "EXP", line)
        line = re.sub(r"\d+(\.\d+)?", "9", line)
        if not (out and out[-1] == line == "| row |"):
            out.append(line)
    return out


def _without_origins(lines: list[str]) -> list[str]:
    """``lines`` without the lines that say what made a sweep's numbers (``origins.made_by``), each
    with its indented continuation."""
    from raymcn.results.origins import LINE_STARTS

    out, dropping = [], False
    for line in lines:
        dropping = line.startswith(LINE_STARTS) or (dropping and line.startswith("  "))
        if not dropping:
            out.append(line)
    return out


def test_the_captured_end_of_make_sweep_has_the_form_the_summary_prints(confirmed):  # noqa: F811 (the fixture)
    """README's block (bench.sweep_time's capture) against what results/summary.py prints today for a
    sweep of the embedded default's shape (test_sweep_summary's fixture). A capture from before the
    end of a sweep named what made its numbers lacks those lines (docgen's note on the measurement
    says so); the rest keeps its form."""
    from raymcn.results.origins import LINE_STARTS
    from raymcn.results.summary import sweep_summary
    from tools import docgen

    exp = confirmed
    today = _form(sweep_summary(exp).replace(str(exp), "~/raymcn_results/sweep-x"))
    captured = _form(docgen.sweep_end().strip("`\n"))
    assert any(line.startswith(LINE_STARTS) for line in today)
    if not any(line.startswith(LINE_STARTS) for line in captured):
        today = _without_origins(today)
    phases = [line for line in today if line.startswith(("search:", "confirmation:"))]
    assert captured[:len(phases)] == phases, "the phase lines changed: rerun python -m bench.sweep_time"
    assert [line for line in captured if not line.startswith(("search:", "confirmation:"))] == \
        [line for line in today if not line.startswith(("search:", "confirmation:"))], \
        "the end of a sweep prints another form than the README shows: rerun python -m bench.sweep_time"


def test_the_preflight_messages_on_the_pages_are_what_todays_code_prints():
    """memory.md's preflight message and estimates (docs/measurements/preflight.json) are computed,
    not measured: recomputed here for the paper's batch on one 24 GB and one 40 GB GPU, every
    figure of them included, so a JSON older than the estimate fails."""
    from bench.grad_cache import preflight_messages
    from tools import docgen

    assert preflight_messages() == docgen.m("preflight")["preflight"], \
        f"the preflight prints other figures today: rerun `{docgen.m('preflight')['command']}`, then python -m tools.docgen"


# --- no measured figure typed outside a marker; every cited figure and heading exists ------------------
_FIGURE = re.compile(r"(?<![\w.@/-])(\d+(?:\.\d+)?(?:[–-]\d+(?:\.\d+)?)?)\s?"
                     r"(ms|s|min|minutes|h|hours|GiB|GB|MB|KB|%|×|x|videos/s|samples/s|clips/s|TFLOP/s|TFLOPS)(?!\w)")
# A figure with a unit typed on a prose page, outside the generated spans, keyed by the word before it
# and itself: each is not a measurement, for the reason given. A measured one is generated from its
# JSON instead (tools/docgen.py).
NOT_MEASURED = {
    **dict.fromkeys(["default 120 s", "default 30 min", "default 300 s", "default 600 s", "every 30 min"],
                    "a setting's default (test_a_quoted_default_equals_the_settings_page checks it)"),
    **dict.fromkeys(["asserts 1 %", "within 1 %", "within 15 %", "least 1.5×", "or 10×", "after 15 min", "after 15 minutes",
                     "every 30 s", "to 18 s", "for 30 s", "at 60 s", "at 30 s", "at 120 s"],
                    "a tolerance, limit or interval of the code, not a measurement"),
    **dict.fromkeys(["≥ 0.8 ×", "≥ 0.9 ×", "under 1 %", "every 100 ×", "over 8 s"], "a goal or a rule (8 s: where a test leaves the fast tier)"),
    **dict.fromkeys(["** 95%", "R@10, 95 %", "and 95 %", "with 80 %", "with 95 %"], "a statistic's level"),
    **dict.fromkeys(["40 ×", "| 20 ×", "blocks/layer, 16×", "≥ 10 s", "than 30.72 s", "~ 6 min", "one 24 GB", "a 40 GB",
                     "to 2 ×"], "a shape, a size or a property of the data (the paper's, a benchmark's input)"),
}


def test_the_connection_limits_on_the_cluster_page_are_the_codes():
    """cluster.md's "silent for 30 s is named", "at 60 s the command ends", a local start "ended at
    120 s": on_ray/cluster.py's."""
    from raymcn.train.on_ray.cluster import CONNECT_LIMIT_S, CONNECT_NAMED_AFTER_S, LOCAL_START_LIMIT_S

    text = " ".join((ROOT / "docs" / "cluster.md").read_text().split()).lower()
    assert f"a gcs silent for {CONNECT_NAMED_AFTER_S:g} s is named" in text
    assert f"at {CONNECT_LIMIT_S:g} s the command ends" in text
    assert f"start is named at {CONNECT_NAMED_AFTER_S:g} s and ended at {LOCAL_START_LIMIT_S:g} s" in text


def _prose(text: str) -> str:
    """A page's prose: the generated spans, code blocks and inline code taken out, whitespace folded."""
    from tools import docgen

    text = docgen.MARK.sub(" ", text)
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"`[^`]*`", " ", text))


def typed_figures(text: str) -> list[str]:
    """Each figure with a unit typed outside the generated spans, with the word before it."""
    prose = _prose(text)
    out = []
    for m in _FIGURE.finditer(prose):
        before = prose[:m.start()].split()
        out.append(f"{before[-1].strip('(') if before else ''} {m.group(0)}".strip())
    return out


def test_a_typed_figure_is_found():
    assert typed_figures("it took 70 min on 2 cores; <!-- gen:x -->5 min<!-- /gen -->, `9 s`") == ["took 70 min"]


@pytest.mark.parametrize("page", [p for p in DOCS if p.name != "settings.md"], ids=lambda p: p.name)
def test_no_measured_figure_is_typed_outside_the_generator(page):
    typed = [f for f in typed_figures(page.read_text()) if f not in NOT_MEASURED]
    assert not typed, (f"{page.name}: figures typed by hand: {typed}; generate each from its JSON (tools/docgen.py), "
                       "or, if it is not a measurement, add it to NOT_MEASURED with why")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _sections(page: Path) -> dict[str, str]:
    """Anchor -> the section's text (to the next heading of any level); "" -> the whole page."""
    text = page.read_text()
    out, parts = {"": text}, re.split(r"^(#{1,6} .*)$", text, flags=re.M)
    for heading, body in zip(parts[1::2], parts[2::2]):
        out[slug(heading.lstrip("#"))] = body
    return out


# A figure and the parenthesised citation right after it: "0.116 s ([memory](memory.md))"; and a code
# comment's parenthesis citing a page: "(12.5-18.6 s of stall, docs/faults.md)" or "(docs/faults.md, "Stalls")".
_CITED_LINK = re.compile(r"([^()\[\]]*?)\(\[[^\]]*\]\(([\w-]+\.md)(?:#([\w-]+))?\)\)")
_CITED_FILE = re.compile(r"\(([^()]*?)docs/([\w-]+\.md)(?:, \"([^\"]+)\")?\)")
_CITED_SECTION = re.compile(r"docs/([\w-]+\.md), \"([^\"]+)\"")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w])")
CITING = [*DOCS, ROOT / "cluster.yaml", *sorted((ROOT / "raymcn").rglob("*.py")), *sorted((ROOT / "bench").glob("*.py")),
          *sorted((ROOT / "sweeps").rglob("*.yaml"))]


def citations(path: Path) -> list[tuple[str, str, str]]:
    """(figure or "", page, section anchor or "") for each citation ``path`` makes: a page's figure
    just before a link in parentheses, a comment's figures in a parenthesis naming docs/PAGE.md."""
    from tools import docgen

    text = path.read_text()
    if path.suffix == ".md":
        text = docgen.MARK.sub(lambda m: m.group(2), text)  # a cited figure may be generated
        out = []
        for m in _CITED_LINK.finditer(re.sub(r"\s+", " ", text)):
            clause = re.split(r"[;:,.] ", m.group(1))[-1]
            numbers = _NUMBER.findall(clause)
            out.append((numbers[-1] if numbers else "", m.group(2), m.group(3) or ""))
        return out
    text = re.sub(r"\s*\n\s*(#\s*)?", " ", text)  # a comment's lines as one
    return [(n, m.group(2), "") for m in _CITED_FILE.finditer(text) for n in _NUMBER.findall(m.group(1))] + \
        [("", m.group(1), slug(m.group(2))) for m in _CITED_SECTION.finditer(text)]


def test_citations_reads_a_figure_and_its_page(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("every 10 steps, 0.26 % of the step floor of 0.116 s\n([memory](memory.md)) and [x](b.md#c).")
    assert citations(page) == [("0.116", "memory.md", "")]
    code = tmp_path / "a.py"
    code.write_text('# a checkpoint (12.5-18.6 s of stall measured,\n# docs/faults.md); see (docs/faults.md, "Stalls")')
    assert citations(code) == [("12.5", "faults.md", ""), ("18.6", "faults.md", ""), ("", "faults.md", "stalls")]


def _section(sections: dict[str, str], anchor: str) -> str | None:
    """The section an anchor names; a comment may name a heading by its start ("Model defaults")."""
    if anchor in sections:
        return sections[anchor]
    return next((body for a, body in sections.items() if a and anchor and a.startswith(anchor + "-")), None)


@pytest.mark.parametrize("path", CITING, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_cited_heading_and_figure_are_on_the_cited_page(path):
    """A link's anchor, or a section a comment names, is a heading of its page, and a figure cited from
    a page (the number just before the citation) is in that page, or in that section."""
    bad = []
    for figure, page, anchor in citations(path):
        target = ROOT / "docs" / page if (ROOT / "docs" / page).exists() or path.parent.name != "docs" else path.parent / page
        if not target.exists():
            continue  # a missing file: test_every_relative_link_resolves names it
        section = _section(_sections(target), anchor)
        if section is None:
            bad.append(f"{page}#{anchor}: no such heading")
        elif figure and figure not in section:
            bad.append(f"{figure} cited from {page}{'#' + anchor if anchor else ''}, which does not have it")
    anchors = [(link.split("#")[0] or path.name, link.split("#")[1]) for link in _links(path.read_text()) if "#" in link
               and link.split("#")[0].endswith((".md", ""))] if path.suffix == ".md" else []
    for page, anchor in anchors:
        target = path.parent / page
        if target.exists() and target.suffix == ".md" and anchor not in _sections(target):
            bad.append(f"{page}#{anchor}: no such heading")
    assert not bad, f"{path.name}: " + "; ".join(bad)


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


PAGE_WORDS = 3_500  # a page over it does too much: its topics belong on pages of their own


def test_no_page_does_too_much():
    """Each prose page (README and docs/*.md but the generated settings reference, which lists every
    setting in full) under 3 500 words as `wc -w` counts, the guide (every step from the folders to
    the answer, and its practice route on a CPU machine) included. No total: a new topic takes a page
    of its own, and repetition is cut and linked, not copied."""
    words = {p.name: len(p.read_text().split()) for p in DOCS if p.name != "settings.md"}
    assert all(n <= PAGE_WORDS for n in words.values()), {k: n for k, n in words.items() if n > PAGE_WORDS}


# --- the two pages a newcomer reads: short sentences, and a set-up section without measurement detail ----
MAX_SENTENCE_WORDS = 40


def sentences(text: str) -> list[str]:
    """A page's prose sentences: tables, code blocks, headings and generated blocks left out; a
    generated inline figure, a link's text and an inline code span (as one word) kept. A list item
    and a paragraph end a sentence; so do ``.``, ``!``, ``?`` and a colon or semicolon before a new
    clause that starts with a capital, a bold word or code."""
    from tools import docgen

    text = docgen.MARK.sub(lambda m: " " if m.group(2).startswith("\n") else m.group(2), text)
    text = re.sub(r"```.*?```", "\n\n", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(("|", "#")))
    text = re.sub(r"`[^`]*`", "CODE", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    out = []
    for block in re.split(r"\n\s*\n|\n\s*(?:[-*]|\d+\.)\s+", text):
        block = re.sub(r"^\s*(?:[-*]|\d+\.)\s+", "", block)  # a list's first item
        out += [s for s in re.split(r"(?<=[.!?])\s+|(?<=[:;])\s+(?=[A-Z*(])", " ".join(block.split())) if s.strip()]
    return out


def test_sentences_are_split_where_a_reader_stops():
    text = ("Run `make test` first. It takes a while: then push.\n\n- one item\n- two: Three\n\n"
            "| a | table row that is long |\n```bash\nnot prose\n```\nSee [the guide](x.md).")
    assert sentences(text) == ["Run CODE first.", "It takes a while: then push.", "one item", "two:", "Three",
                               "See the guide."]


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.name)
def test_no_sentence_of_the_readme_or_the_guide_runs_over_40_words(page):
    """The two pages a newcomer works from read as a runbook: one action a sentence, the reason beside
    it. Tables and code blocks aside, no sentence runs over 40 words."""
    long = [f"{len(s.split())} words: {s[:90]}..." for s in sentences(page.read_text())
            if len(s.split()) > MAX_SENTENCE_WORDS]
    assert not long, f"{page.name}: sentences over {MAX_SENTENCE_WORDS} words:\n" + "\n".join(long)


def _under(text: str, heading: str) -> str:
    """The text of ``heading``'s section, to the next level-2 heading."""
    start = text.index(heading)
    nxt = re.search(r"^## ", text[start + len(heading):], flags=re.M)
    return text[start:start + len(heading) + nxt.start()] if nxt else text[start:]


def test_the_readmes_set_up_section_names_no_benchmark_command_commit_or_machine():
    """The README's set-up is two commands, what each does and how long it takes. Which benchmark
    measured that, at which commit and on which machine belongs to the measurement pages, linked."""
    section = _under((ROOT / "README.md").read_text(), "## Set-up on a fresh machine")
    commands = _bash_lines(section)
    assert commands[:2] == ["make sweep", "make test"], commands
    assert "python -m bench" not in section and "tools.docgen" not in section
    commits = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", section)
    assert not commits, f"commits named in the README's set-up section: {commits}"
    machine = re.findall(r"AMD|Intel|EPYC|Xeon|family \d+|torch \d|H200|A100", section)
    assert not machine, f"machine details in the README's set-up section: {machine}"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_file_a_page_names_exists(page):
    """A test, benchmark or module a page names as showing something exists (a test moved or merged
    into another file is named by its new file)."""
    named = set(re.findall(r"`((?:tests|bench|raymcn|tools)/[\w/]+\.py)`", page.read_text()))
    named |= {f"raymcn/{p}" for p in re.findall(r"`((?:train|data|sweep|results|losses|servers|doctor)/[\w/]+\.py)`",
                                                  page.read_text())}
    missing = sorted(p for p in named if not (ROOT / p).exists() and not any(ROOT.joinpath("raymcn").rglob(Path(p).name)))
    assert not missing, f"{page.name} names files that do not exist: {missing}"


def test_the_loader_figures_come_from_as_many_repeats_as_the_command_shown():
    """The README's and performance.md's loader command says `--repeat N`; the JSON it produced holds N
    runs of every arm (a plain `python -m bench.loader` runs one)."""
    shown = {int(n) for page in (ROOT / "README.md", ROOT / "docs" / "performance.md")
             for n in re.findall(r"python -m bench\.loader --sizes long --repeat (\d+)", page.read_text())}
    runs = {len(v) for d in json.loads((ROOT / "docs/measurements/loader.json").read_text())["results"]["long"]["dtypes"].values()
            for v in d["runs"].values()}
    assert len(shown) == 1 and runs == shown, f"the docs show --repeat {shown}; loader.json holds {runs} runs per arm"
