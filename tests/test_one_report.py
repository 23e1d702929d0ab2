"""An error every rank raises is printed once, with the ranks that raised it; each rank's traceback is in a log file
(see [Note: one report for the ranks that raised] in ``lightning_zero/process/one_report.py``). The ranks raise at a
chosen step of ``training_step`` (tests/workers/raise_everywhere.py), not at a time.
"""

from __future__ import annotations

import pytest

from lightning_zero.testing.launch import _tail, start, wait_all

SAFETY_NET = 240  # seconds


@pytest.mark.timeout(SAFETY_NET + 60)
def test_the_same_error_on_every_rank_is_printed_once_with_the_ranks(tmp_path):
    codes = wait_all(start("raise_everywhere.py", 2, tmp_path, ("all",)), SAFETY_NET)
    assert codes == [1, 1], f"{codes}\n{_tail(tmp_path)}"
    out = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    error = "ValueError: the batch has the wrong shape: fix the data module"
    assert f"{error}\n[raised on ranks 0, 1 of 2; each rank's traceback: {tmp_path}/lightning_zero_errors/rank<r>.log]" \
        in out[0], _tail(tmp_path)
    assert "Traceback" not in out[0] and "Traceback" not in out[1] and error not in out[1], _tail(tmp_path)
    for rank in range(2):
        log = (tmp_path / "lightning_zero_errors" / f"rank{rank}.log").read_text()
        assert log.startswith("Traceback") and "in training_step" in log and error in log


@pytest.mark.timeout(SAFETY_NET + 60)
def test_a_rank_that_raised_another_error_prints_its_own(tmp_path):
    codes = wait_all(start("raise_everywhere.py", 2, tmp_path, ("differ",)), SAFETY_NET)
    assert codes == [1, 1], f"{codes}\n{_tail(tmp_path)}"
    out = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert "[raised on rank 0 of 2;" in out[0], _tail(tmp_path)
    assert "KeyError: \"rank one's own problem\"\n[raised on rank 1; its traceback: " in out[1], _tail(tmp_path)
