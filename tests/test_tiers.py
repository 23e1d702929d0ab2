"""The test tiers of tests/conftest.py: its rule marks what launches processes ``slow``, and a test it misses fails."""

from __future__ import annotations

import importlib

import pytest

import tests.tier_examples as examples
from tests.conftest import SLOW_BY_NAME, launches


@pytest.mark.parametrize(
    "name",
    [
        "launches_under_another_name",
        "launches_through_a_helper",
        "launches_through_a_local_import",
        "launches_in_a_comprehension",
    ],
)
def test_the_rule_sees_a_launch_however_it_is_reached(name: str) -> None:
    assert launches(getattr(examples, name))


def test_the_rule_leaves_a_function_that_starts_nothing_fast() -> None:
    assert not launches(examples.stays_in_this_process)


def test_every_test_named_slow_exists() -> None:
    for name in SLOW_BY_NAME:
        path, function = name.split("::")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert callable(getattr(module, function, None)), f"{name} is listed in SLOW_BY_NAME but is no test"


EXAMPLE_SUITE = """
import subprocess

def test_runs_a_process():
    subprocess.run(["true"], check=True)

def test_runs_a_process_the_rule_cannot_see():
    __import__("subprocess").run(["true"], check=True)

def test_runs_none():
    assert sum([1, 2]) == 3
"""


def test_the_fast_tier_deselects_launching_tests_and_fails_those_the_rule_misses(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # installed plugins may run git to configure
    pytester.makepyfile(test_example=EXAMPLE_SUITE)
    result = pytester.runpytest_inprocess("-p", "tests.conftest", "-m", "not slow", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1, deselected=1)
    result.stdout.fnmatch_lines(["*test_runs_a_process_the_rule_cannot_see starts a process but is not marked slow*"])
