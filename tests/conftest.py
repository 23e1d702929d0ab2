"""The test tiers: which tests are ``slow``, decided in one place.

``python -m pytest -q`` runs everything (as CI does); ``python -m pytest -m "not slow"`` is the fast tier, the
single-process unit tests a contributor runs after each edit.

[Note: the rule that marks a test slow]
A test is ``slow`` when it starts processes or takes more than about two seconds on its own:

1. it, a fixture it uses, or a function or class of ``tests/`` that they refer to (followed transitively) refers to
   a process launcher: the rank launcher (``launch``, ``launch_nodes``, ``start``, ``run_in_own_session``), the
   zygote that forks ranks (or either of their modules), ``subprocess`` or ``multiprocessing``. The references are
   the names a function's code loads, resolved in its module's globals and compared by identity, so an alias or a
   helper in between does not hide a launch;
2. or it is named in ``SLOW_BY_NAME`` below, which no reference says: ``Trainer`` fits and engine steps measured
   at over ~2 s, and Trainers that start their ranks through Lightning's own launcher.

A test the rule misses cannot pass quietly: in every test not marked ``slow``, starting a process (``subprocess``,
``multiprocessing``, the zygote) raises. ``tests/test_tiers.py`` checks the rule and that guard.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing
import multiprocessing.process
import subprocess
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest_plugins = ("pytester",)  # tests/test_tiers.py runs small suites through the rule


# [Note: nothing of Lightning is imported when this module loads]
# Lightning's logger stops propagating to the root logger when it is imported while the root has no handler, as
# here before collection starts; ``caplog`` would then see none of its records. The package (which imports
# Lightning) is therefore imported in the functions below, once collection runs under pytest's logging handlers.
@functools.cache
def launchers() -> tuple[object, ...]:
    """The objects whose mention makes a test slow (compared by identity), modules included."""
    import torch.multiprocessing

    from lightning_zero.testing import launch, zygote

    return (
        launch,
        zygote,
        launch.launch,
        launch.launch_nodes,
        launch.start,
        launch.run_in_own_session,
        zygote.ZYGOTE,
        subprocess,
        multiprocessing,
        torch.multiprocessing,
    )


@functools.cache
def launcher_modules() -> frozenset[str]:
    """The launchers' module names: a function that imports one of them locally names it in its code."""
    return frozenset(obj.__name__ for obj in launchers() if isinstance(obj, types.ModuleType))


SLOW_BY_NAME: tuple[str, ...] = (
    "tests/test_costs.py::test_a_step_allocates_nothing_large_after_warm_up_and_copies_the_gradients_once",
    "tests/test_costs.py::test_the_host_heap_is_given_back_after_setup_and_the_first_step_only",
    "tests/test_lightning.py::test_checkpoint_resume_is_exact",
    "tests/test_lightning.py::test_checkpoint_resumes_across_stages_and_under_ddp_format",
    "tests/test_lightning.py::test_fit_validate_test_predict",
    "tests/test_lightning.py::test_spawn_launcher_returns_trained_weights",
)
"""Tests (``tests/test_x.py::test_name``, parameters left out) that are slow though they name no launcher."""


def _code_names(code: types.CodeType) -> Iterator[str]:
    """The global and attribute names ``code`` loads, nested functions, lambdas and comprehensions included."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _functions_of(obj: object) -> Iterator[Callable[..., Any]]:
    """The plain functions behind ``obj``: itself, its wrapped original, or a class's methods."""
    if inspect.isclass(obj):
        for member in vars(obj).values():
            yield from _functions_of(getattr(member, "__func__", member))
        return
    func = inspect.unwrap(getattr(obj, "__func__", obj)) if callable(obj) else obj
    if inspect.isfunction(func):
        yield func


def _in_tests(obj: object) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "tests"


def launches(obj: object, seen: set[int] | None = None) -> bool:
    """Whether ``obj`` (a test, fixture, helper or class of ``tests/``) refers to a launcher, directly or through
    other functions and classes of ``tests/``."""
    seen = set() if seen is None else seen
    for func in _functions_of(obj):
        if id(func) in seen:
            continue
        seen.add(id(func))
        for name in _code_names(func.__code__):
            if name in launcher_modules():
                return True
            target = func.__globals__.get(name)
            if target is None:
                continue
            if any(target is launcher for launcher in launchers()):
                return True
            if _in_tests(target) and launches(target, seen):
                return True
    return False


def _fixture_functions(item: pytest.Item) -> Iterator[Callable[..., Any]]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    for name in item.fixturenames:  # type: ignore[attr-defined]
        for fixturedef in info.name2fixturedefs.get(name, ()):
            if fixturedef.func.__module__ != __name__:  # this module's guard names the launchers it patches
                yield fixturedef.func


def is_slow(item: pytest.Item) -> bool:
    """The rule of this module's [Note]: the item refers to a launcher, or is listed in ``SLOW_BY_NAME``."""
    base = item.nodeid.split("[")[0]
    if any(base == name or base.startswith(name + "::") for name in SLOW_BY_NAME):
        return True
    function = getattr(item, "function", None)
    return any(launches(func) for func in (function, *_fixture_functions(item)) if func is not None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every slow item (see the module's [Note]); ``-m "not slow"`` then deselects them."""
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)


def _refuse_processes(nodeid: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{nodeid} starts a process but is not marked slow: mark it @pytest.mark.slow"
            " (or list it in SLOW_BY_NAME in tests/conftest.py)"
        )

    return refuse


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a test not marked ``slow``, starting a process raises, so the fast tier stays single-process."""
    if request.node.get_closest_marker("slow") is not None:
        return
    refuse = _refuse_processes(request.node.nodeid)
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    from lightning_zero.testing.zygote import Zygote

    monkeypatch.setattr(Zygote, "spawn", refuse)
