"""The suite's tiers and what they rest on: ``--tier`` picks the tests (tests/conftest.py,
the one place the marker expressions live), a test that starts Ray is marked as one, a multinode,
launcher or soak test is slow, and the durations file CI writes adds the tiers up."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression
from conftest import ALWAYS_SLOW, TIERS, pytest_collection_modifyitems, ray_sessions_under

from tools import test_durations

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''
import os

import pytest


def _start_ray_as_ray_does():  # Ray makes its session folder under RAY_TMPDIR/ray at its start
    os.makedirs(os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray", "session_2026-01-01_00-00-00_1_1"),
                exist_ok=True)


@pytest.mark.slow
def test_slow():
    pass


def test_starts_ray_unmarked():
    _start_ray_as_ray_does()


@pytest.mark.ray
def test_starts_ray_marked(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # a marked test may start Ray; here not in /tmp/ray
    _start_ray_as_ray_does()


def test_plain():
    pass
'''


def test_the_fast_tier_leaves_slow_tests_out_and_an_unmarked_test_that_starts_ray_fails(tmp_path):
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tier", "fast", "--each-test-time",
                           "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert "3 passed, 1 deselected, 1 error" in out, out  # the unmarked one passes, then fails at its teardown
    assert "test_probe.py::test_starts_ray_unmarked started Ray (session_2026-01-01_00-00-00_1_1)" in out, out
    assert "mark it `ray`" in out
    # --each-test-time (CI's slow tier): a line as each test ends, its outcome a failed teardown's too
    assert re.search(r"\] \d+ s test_probe.py::test_plain passed\n", out) and " s test_probe.py::test_slow " not in out
    assert re.search(r"\] \d+ s test_probe.py::test_starts_ray_unmarked error\n", out), out


def test_a_multinode_or_launcher_test_that_is_not_slow_stops_the_collection():
    def item(*marks):
        return types.SimpleNamespace(nodeid=f"t::{'_'.join(marks)}",
                                     get_closest_marker=lambda name: name if name in marks else None)

    pytest_collection_modifyitems(None, [item("multinode", "slow"), item("launcher", "slow"), item("ray")])
    for marker in ALWAYS_SLOW:
        with pytest.raises(pytest.UsageError, match=f"t::{marker}"):
            pytest_collection_modifyitems(None, [item(marker)])


def test_ray_sessions_are_read_where_ray_makes_them(tmp_path):
    assert ray_sessions_under(str(tmp_path)) == []
    (tmp_path / "ray" / "session_2026-11-27_16-33-33_282447_3075").mkdir(parents=True)
    (tmp_path / "ray" / "session_latest").symlink_to(tmp_path / "ray" / "session_2026-11-27_16-33-33_282447_3075")
    assert ray_sessions_under(str(tmp_path)) == ["session_2026-11-27_16-33-33_282447_3075"]


JUNIT = {"test": '''<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="1" skipped="1" tests="4" time="61.5"><properties><property name="python" value="3.11.7"/>
<property name="torch" value="2.13.0+cpu"/><property name="other" value="x"/></properties>
<testcase classname="tests.test_tiers" name="test_a" time="1.25"/>
<testcase classname="tests.test_tiers" name="test_b[x-1]" time="2.0"><failure message="no"/></testcase>
<testcase classname="tests.test_tiers.TestGroup" name="test_c" time="0.5"/>
<testcase classname="tests.test_tiers" name="test_gpu" time="0.0"><skipped message="needs CUDA"/></testcase>
</testsuite></testsuites>''',
         "test-slow": '''<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="0" skipped="0" tests="1" time="600.25"><testcase classname="tests.test_tiers" name="test_slow"
time="599.0"/></testsuite></testsuites>''',
         "test-soak": '''<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="0" skipped="0" tests="2" time="1200.0"><testcase classname="tests.test_tiers" name="test_soak"
time="1000.0"/><testcase classname="tests.test_tiers" name="test_bench" time="199.5"/></testsuite></testsuites>''',
         "test-compat": '''<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="0" skipped="0" tests="1" time="70.0"><testcase classname="tests.test_tiers" name="test_a" time="1.5"/>
</testsuite></testsuites>''',
         "test-top": '''<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="0" skipped="0" tests="1" time="80.0"><properties><property name="python" value="3.13.0"/>
<property name="torch" value="2.15.0+cu132"/></properties><testcase classname="tests.test_tiers" name="test_a"
time="1.75"/></testsuite></testsuites>'''}
CI = ("test", "test-slow", "test-compat", "test-top")  # the files .ci/run writes


def test_the_durations_file_adds_the_tiers_up_and_names_every_test(tmp_path):
    for name, text in JUNIT.items():
        (tmp_path / f"{name}.xml").write_text(text)
    out = tmp_path / "durations.json"
    assert test_durations.main([str(tmp_path / f"{name}.xml") for name in CI] + ["--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["tiers"] == {"fast": {"seconds": 61.5, "tests": 3, "skipped": 1, "failed": 1, "python": "3.11.7",
                                         "torch": "2.13.0+cpu"},
                                "slow": {"seconds": 600.2, "tests": 1, "skipped": 0, "failed": 0},
                                "compat": {"seconds": 70.0, "tests": 1, "skipped": 0, "failed": 0},
                                "top": {"seconds": 80.0, "tests": 1, "skipped": 0, "failed": 0, "python": "3.13.0",
                                        "torch": "2.15.0+cu132"},
                                "ci": {"seconds": 811.7, "tests": 6, "skipped": 1, "failed": 1}}  # CI's run: no soak
    assert figures["tests"] == {"fast": {"tests/test_tiers.py::test_b[x-1]": 2.0, "tests/test_tiers.py::test_a": 1.25,
                                         "tests/test_tiers.py::TestGroup::test_c": 0.5},
                                "slow": {"tests/test_tiers.py::test_slow": 599.0},
                                "compat": {"tests/test_tiers.py::test_a": 1.5},
                                "top": {"tests/test_tiers.py::test_a": 1.75}}
    assert list(figures["tests"]["fast"])[0] == "tests/test_tiers.py::test_b[x-1]"  # the slowest first
    assert figures["command"] == "CI=true bash .ci/run" and figures["machine"] and figures["commit"]
    # with the soak tier's file (make test-soak, by hand) the full suite too
    every = test_durations.summary([tmp_path / f"{name}.xml" for name in JUNIT])
    assert every["tiers"]["full"] == {"seconds": 1861.7, "tests": 6, "skipped": 1, "failed": 1}
    assert every["tiers"]["ci"] == figures["tiers"]["ci"]
    assert list(every["tests"]["soak"]) == ["tests/test_tiers.py::test_soak", "tests/test_tiers.py::test_bench"]


def test_a_junit_file_not_named_after_its_target_is_refused(tmp_path):
    (tmp_path / "fast.xml").write_text(JUNIT["test"])
    with pytest.raises(ValueError, match="name the file after its make target"):
        test_durations.summary([tmp_path / "fast.xml"])


def test_a_run_without_its_slow_tiers_file_records_no_full_tier_and_the_docs_say_so(tmp_path, monkeypatch):
    """A run stopped before the slow tier ended wrote no file for it: the fast tier is recorded,
    the full tier is not made up from it, and the pages say that no complete run is recorded."""
    from tools import docgen

    (tmp_path / "test.xml").write_text(JUNIT["test"])
    figures = test_durations.summary([tmp_path / "test.xml"])
    assert set(figures["tiers"]) == {"fast"} and set(figures["tests"]) == {"fast"}
    monkeypatch.setattr(docgen, "m", lambda name: figures)
    assert docgen.tier("fast") == "1 min 2 s, 3 tests" and docgen.tier("ci") == docgen.tier("full") == docgen.UNRECORDED
    assert f"| `make test-slow` | {docgen.UNRECORDED} |" in docgen.tiers()
    assert docgen.minsec(779.6) == "13 min 0 s" and docgen.minsec(59.4) == "0 min 59 s"  # never "12 min 60 s"


def test_each_test_runs_in_exactly_one_of_the_three_tiers_and_full_runs_every_one():
    def tiers_of(*marks: str) -> set[str]:
        return {t for t, expr in TIERS.items() if not expr or Expression.compile(expr).evaluate(lambda m: m in marks)}

    assert tiers_of() == tiers_of("ray") == tiers_of("dist") == {"fast", "full"}
    assert tiers_of("slow") == tiers_of("slow", "multinode") == {"slow", "full"}  # what CI runs after the fast tier
    assert tiers_of("slow", "soak") == tiers_of("slow", "multinode", "soak") == {"soak", "full"}  # by hand only
