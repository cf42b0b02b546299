"""The lane check of tests/conftest.py: a file whose tests lack a lane marker, or carry two, or are slow in the
unit lane, is a collection error naming each such test (``-m unit`` too: the check comes before the
selection), and the run stops before running anything; tests in one lane each run, and ``-m unit``
picks the unit lane."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.unit

CONFTEST = Path(__file__).with_name("conftest.py")
MARKED = """
import pytest


@pytest.mark.unit
def test_pure():
    assert 1 + 1 == 2


@pytest.mark.integration
@pytest.mark.slow
def test_runs_a_trainer():
    pass
"""


def _session(pytester, files: dict[str, str], *args):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makefile(".py", **files)
    # the inner run executes in this process, without xdist (and without hypothesis: seconds to import)
    return pytester.runpytest_inprocess(
        "-p", "no:xdist", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", *args
    )


def test_a_test_without_one_lane_stops_the_session(pytester):
    wrong = """
import pytest


def test_no_lane():
    pass


@pytest.mark.unit
@pytest.mark.integration
def test_two_lanes():
    pass


@pytest.mark.unit
@pytest.mark.slow
def test_slow_unit():
    pass
"""
    for selection in ([], ["-m", "unit"]):
        result = _session(pytester, {"test_wrong": wrong}, *selection)
        assert result.ret == pytest.ExitCode.INTERRUPTED
        out = result.stdout.str()
        assert "ERROR collecting test_wrong.py" in out
        assert "each test needs exactly one lane marker of unit, integration, distributed" in out
        assert "test_wrong.py::test_no_lane: no lane" in out
        assert "test_wrong.py::test_two_lanes: lanes unit and integration" in out
        assert "test_wrong.py::test_slow_unit: marked slow in the unit lane" in out
        result.assert_outcomes(errors=1)  # nothing ran


def test_one_lane_each_runs_and_the_unit_lane_is_selectable(pytester):
    result = _session(pytester, {"test_marked": MARKED})
    result.assert_outcomes(passed=2)
    result = _session(pytester, {"test_marked": MARKED}, "-m", "unit")
    result.assert_outcomes(passed=1, deselected=1)
