"""The documentation a user reads is checked against the code: the settings page is the generated
reference, every relative link resolves, and every ``raymcn ...`` command shown parses with the
real command-line parser (a subcommand or a flag that does not exist fails here)."""

from __future__ import annotations

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


def _commands(text: str) -> list[str]:
    """Every `raymcn ...` command line of the page's code blocks and inline code (continuations joined)."""
    found = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("raymcn "):
                found.append(line)
    found += [c for c in re.findall(r"`(raymcn [^`]+)`", text) if "\n" not in c]
    return found


def _subcommands() -> dict[str, set[str]]:
    """subcommand -> the option strings it accepts (from the real parser)."""
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}


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
