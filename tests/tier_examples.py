"""Functions that the slow-test rule of tests/conftest.py reads (never runs): tests/test_tiers.py asks it about each.

They sit outside the test module so that the test asking about them does not itself refer to a launcher.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_zero.testing.launch import launch as run_ranks


def launches_under_another_name(out_dir: Path) -> list[Any]:
    """Calls the rank launcher through an alias."""
    return run_ranks("parity.py", 2, out_dir)


def launches_through_a_helper(out_dir: Path) -> list[Any]:
    """Calls a function of tests/ that calls the launcher."""
    return launches_under_another_name(out_dir)


def launches_through_a_local_import(out_dir: Path) -> None:
    """Imports the launcher's module inside the function."""
    from lightning_zero.testing.launch import start

    start("parity.py", 2, out_dir)


def launches_in_a_comprehension(commands: list[list[str]]) -> list[int]:
    """Starts processes inside a comprehension (a nested code object)."""
    import subprocess

    return [subprocess.run(cmd, check=False).returncode for cmd in commands]


def stays_in_this_process(values: list[int]) -> int:
    """Starts nothing."""
    return sum(values)
