"""The fault-injection seam (``lightning_zero/process/faults.py``, see [Note: fault points]): the one module that keeps
fault state, armed only by ``LIGHTNING_ZERO_FAULT``, with exactly the points its Note lists marked in the package.
The faults themselves are exercised end to end by test_shutdown.py, test_checkpoint_safety.py and test_examples.py.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from lightning_zero.process.faults import POINTS, VARIABLE, fault_point

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_zero"


def _sources() -> dict[Path, str]:
    return {path: path.read_text() for path in PACKAGE.rglob("*.py")}


def test_the_package_marks_exactly_the_listed_points_and_only_faults_py_reads_the_variable():
    marked = {name for text in _sources().values() for name in re.findall(r'fault_point\("([^"]+)"\)', text)}
    marked |= {name for text in _sources().values() for name in re.findall(r'_step_boundary\("([^"]+)"\)', text)}
    assert marked == set(POINTS)
    readers = [path.name for path, text in _sources().items() if VARIABLE in text]
    assert readers == ["faults.py"], readers
    collectives = (PACKAGE / "comm" / "collectives.py").read_text()
    assert "fault_point" not in collectives and "process.faults" not in collectives  # no collective carries one


def test_a_fault_fires_at_its_occurrence_and_the_variable_re_arms_and_disarms(monkeypatch):
    monkeypatch.setenv(VARIABLE, "point=save.full,error=ENOSPC,occurrence=2")
    fault_point("save.written")  # another point: nothing
    fault_point("save.full")  # the first reach: nothing
    with pytest.raises(OSError, match="injected by LIGHTNING_ZERO_FAULT at save.full") as raised:
        fault_point("save.full")
    assert raised.value.errno == errno.ENOSPC
    fault_point("save.full")  # the third: nothing
    monkeypatch.setenv(VARIABLE, "point=save.full,error=EACCES")  # re-armed: counts from zero
    with pytest.raises(OSError) as raised:
        fault_point("save.full")
    assert raised.value.errno == errno.EACCES
    monkeypatch.setenv(VARIABLE, "point=save.full,error=EACCES,rank=1")  # another rank's fault: nothing here
    fault_point("save.full")
    monkeypatch.delenv(VARIABLE)  # disarmed
    fault_point("save.full")


def test_a_fault_that_names_no_known_point_is_refused(monkeypatch):
    monkeypatch.setenv(VARIABLE, "point=save.writen,signal=SIGINT")
    with pytest.raises(ValueError, match="names no fault point; name one of save.written"):
        fault_point("save.written")
    monkeypatch.delenv(VARIABLE)
    fault_point("save.written")
