"""The suite's measured time, per tier and per test, from the JUnit XML files pytest wrote.

``.ci/run`` runs the fast tier (``make test``), the slow one (``make test-slow``), the compat
tier (``make test-compat``) and the top tier (``make test-top``), each with ``--junitxml``, and then
this script, which writes one JSON: the machine, the commit, the command, each tier's pytest time,
test counts, Python and torch, CI's four tiers as their sum (only when all four files are given: a
run stopped before a tier ended wrote no file for it), the full suite where the soak
tier's file (``make test-soak``, run by hand) is given too, the Ubuntu 26.04 tier where its file
(``sudo tools/os_tier``, by hand) is, and every test's seconds (setup, call
and teardown) by tier, the slowest first. A copy of a CI run's file saved as
``docs/measurements/test_durations.json`` is what the README's and docs/development.md's suite
figures are generated from (``tools/docgen.py``), and what the next cut between the tiers reads::

    python -m tools.test_durations .cache/tests/test.xml .cache/tests/test-slow.xml \
        .cache/tests/test-compat.xml .cache/tests/test-top.xml --out FILE
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the make target each file is named after; compat and top: the fast tier on the range's oldest, and on
# its newest, Python and torch
TIER_OF_FILE = {"test": "fast", "test-slow": "slow", "test-soak": "soak", "test-compat": "compat", "test-top": "top",
                "test-os": "os"}  # os: the fast tier on Ubuntu 26.04's own python3 (tools/os_tier, by hand)
SUMS = {"ci": ("fast", "slow", "compat", "top"), "full": ("fast", "slow", "soak")}  # CI's run (.ci/run); every test
VERSIONS = ("python", "torch")  # what each tier ran on: properties tests/conftest.py writes into its file
COMMAND = "CI=true bash .ci/run"  # what writes the XML files this script reads


def node_id(case: ET.Element, root: Path = ROOT) -> str:
    """pytest's id of a JUnit test case: ``tests.test_x`` + ``test_y[p]`` -> ``tests/test_x.py::test_y[p]``
    (a class's tests: ``tests.test_x.TestZ`` -> ``tests/test_x.py::TestZ::test_y``)."""
    parts = case.get("classname", "").split(".")
    cut = next((i for i in range(len(parts), 0, -1) if (root / Path(*parts[:i])).with_suffix(".py").is_file()),
               len(parts))
    return "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], case.get("name", "")])


def read_tier(path: Path) -> tuple[dict, dict[str, float]]:
    """(the tier's totals and the Python and torch it ran on, its tests' seconds) from one JUnit XML file."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        raise ValueError(f"{path}: no <testsuite> element: not a pytest --junitxml file")
    cases = suite.findall("testcase")
    skipped = sum(c.find("skipped") is not None for c in cases)
    failed = sum(c.find("failure") is not None or c.find("error") is not None for c in cases)
    totals = {"seconds": round(float(suite.get("time", 0.0)), 1), "tests": len(cases) - skipped,
              "skipped": skipped, "failed": failed}
    totals.update({p.get("name"): p.get("value") for p in suite.iter("property") if p.get("name") in VERSIONS})
    return totals, {node_id(c): round(float(c.get("time", 0.0)), 2) for c in cases if c.find("skipped") is None}


def summary(files: list[Path]) -> dict:
    """The JSON of the module doc for the XML files of ``.ci/run`` (named after their make targets)."""
    from bench.harness import git_commit, machine_line

    tiers: dict[str, dict] = {}
    tests: dict[str, dict[str, float]] = {}
    for path in files:
        tier = TIER_OF_FILE.get(path.stem)
        if tier is None:
            raise ValueError(f"{path}: name the file after its make target ({', '.join(TIER_OF_FILE)})")
        tiers[tier], seconds = read_tier(path)
        tests[tier] = dict(sorted(seconds.items(), key=lambda kv: -kv[1]))  # the slowest first
    for name, parts in SUMS.items():  # a sum only from a run of each of its tiers
        if set(parts) <= set(tiers):
            tiers[name] = {k: round(sum(tiers[p][k] for p in parts), 1 if k == "seconds" else None)
                           for k in ("seconds", "tests", "skipped", "failed")}
    commit, note = git_commit()
    return {"machine": machine_line(), "commit": commit, **({"commit_note": note} if note else {}),
            "command": COMMAND, "tiers": tiers, "tests": tests}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("xml", nargs="+", type=Path, help="pytest --junitxml files, named test.xml, test-slow.xml "
                        "(and test-soak.xml)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    figures = summary(args.xml)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
    for tier, t in figures["tiers"].items():
        print(f"{tier}: {t['seconds'] / 60:.1f} min, {t['tests']} tests ({t['skipped']} skipped, {t['failed']} failed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
