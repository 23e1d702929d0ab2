"""A pytest plugin that runs Lightning's own Fabric tests with their DDP-family strategy replaced by ours.

Load it with ``-p tests.lightning_suite.force_strategy`` and choose the strategy with ``LIGHTNING_ZERO_FORCE``
(``zero1``, ``zero2``, ``zero3``, or ``ddp`` for the oracle run); see ``README.md`` in this folder for the command.
Every ``Fabric(strategy=...)`` that asks for the default (``"auto"``), ``"ddp"``, ``"ddp_spawn"`` or ``"ddp_fork"``
gets the forced strategy with the same launcher (``"ddp_spawn"`` becomes ``"zero2_spawn"``...). A strategy object,
or any other name (``"fsdp"``, ``"deepspeed"``, ``"dp"``...), is left as the test wrote it: those tests check another
strategy's class. The terminal summary says how many tests built a forced ``Fabric``, so a run that forced nothing
cannot pass as a check.

[Note: forcing at Fabric.__init__]
The name is swapped before ``Fabric.__init__`` runs, so the connector, the launcher and the precision plugin are
chosen for the forced strategy exactly as a user's ``Fabric(strategy="zero2")`` would choose them. Tests that build
``_Connector`` directly or mock ``fabric._strategy`` are not forced: they test the connector or Fabric's plumbing,
not a strategy.

[Note: a test that asked for the default]
A test written for ``"auto"`` on one device never calls ``fabric.launch()``: a single-device strategy does not need
it, and every parallel strategy (``ddp`` as well as ours) refuses ``setup`` before it. A user who moves such a script
to a parallel strategy adds ``fabric.launch()`` or runs it with ``fabric run``; the plugin does what ``fabric run``
does in that one process (sets up the environment, marks the Fabric launched), for the oracle ``ddp`` run and ours
alike, so the two runs differ only in the strategy.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import pytest
from lightning.fabric import Fabric
from lightning.fabric.strategies.launchers import _MultiProcessingLauncher

import lightning_zero  # noqa: F401  (registers the zero1/zero2/zero3 names with Fabric)

#: The environment variable that selects the forced strategy.
FORCE_VARIABLE = "LIGHTNING_ZERO_FORCE"
#: The strategies a run may be forced to.
FORCEABLE = ("ddp", "zero1", "zero2", "zero3")
#: The names a test may ask for that the forced strategy replaces, with the launcher suffix each keeps.
REPLACED = {"auto": "", "ddp": "", "ddp_spawn": "_spawn", "ddp_fork": "_fork"}

_FORCED_KEY = pytest.StashKey[str]()
_forced_tests: set[str] = set()
_current_test: Optional[str] = None


def forced_name(requested: Any, forced: str) -> Any:
    """The strategy ``Fabric`` gets when a test asks for ``requested`` in a run forced to ``forced``."""
    if not isinstance(requested, str) or requested not in REPLACED:
        return requested
    return forced + REPLACED[requested]


def _single_process(fabric: Fabric) -> bool:
    strategy = fabric.strategy
    processes = getattr(strategy, "num_processes", 1) * getattr(strategy, "num_nodes", 1)
    return processes == 1 and not isinstance(strategy.launcher, _MultiProcessingLauncher)


def _launch_in_place(fabric: Fabric) -> None:
    """What ``fabric run`` does for a one-process script: the process group is set up in this process, and the
    script's ``fabric.launch()`` is no longer needed (see [Note: a test that asked for the default])."""
    fabric.strategy.setup_environment()
    fabric._launched = True


def _forcing_init(original: Callable[..., None], forced: str) -> Callable[..., None]:
    def __init__(self: Fabric, *args: Any, strategy: Any = "auto", **kwargs: Any) -> None:
        replacement = forced_name(strategy, forced)
        if isinstance(strategy, str) and strategy in REPLACED and _current_test is not None:
            _forced_tests.add(_current_test)
        original(self, *args, strategy=replacement, **kwargs)
        if strategy == "auto" and _single_process(self):
            _launch_in_place(self)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__


def pytest_configure(config: pytest.Config) -> None:
    """Install the forcing wrapper when ``LIGHTNING_ZERO_FORCE`` names a strategy."""
    forced = os.environ.get(FORCE_VARIABLE)
    if forced is None:
        raise pytest.UsageError(f"Set {FORCE_VARIABLE} to one of {', '.join(FORCEABLE)} to run with this plugin.")
    if forced not in FORCEABLE:
        raise pytest.UsageError(f"{FORCE_VARIABLE}={forced!r} is not one of {', '.join(FORCEABLE)}: pick one of them.")
    if not hasattr(Fabric.__init__, "__wrapped__"):
        Fabric.__init__ = _forcing_init(Fabric.__init__, forced)  # type: ignore[method-assign]
    config.stash[_FORCED_KEY] = forced


def pytest_report_header(config: pytest.Config) -> str:
    """Say which strategy the run is forced to."""
    return f"lightning-zero: Fabric's 'auto'/'ddp'/'ddp_spawn'/'ddp_fork' forced to {config.stash[_FORCED_KEY]!r}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Any:
    """Remember which test is running, to count the tests that built a forced ``Fabric``."""
    global _current_test
    _current_test = item.nodeid
    try:
        return (yield)
    finally:
        _current_test = None


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Print how many tests built a forced ``Fabric``."""
    terminalreporter.write_line(
        f"lightning-zero: {len(_forced_tests)} test(s) built a Fabric forced to {config.stash[_FORCED_KEY]!r}"
    )
