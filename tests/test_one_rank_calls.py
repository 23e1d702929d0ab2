"""A collective a user calls on one rank only (``state_dict()`` under zero3, ``save_checkpoint``) fails within
seconds with a message that says what to do (see [Note: a collective called on one rank] in
``lightning_zero/process/user_calls.py``), instead of waiting for the process group's 30-minute timeout.
"""

from __future__ import annotations

import pytest

from lightning_zero.testing.launch import _tail, start, wait_all

SAFETY_NET = 240  # seconds; the worker's check waits 3 s for a rank that deterministically never comes


@pytest.mark.timeout(SAFETY_NET + 60)
@pytest.mark.parametrize("call", ["state_dict", "save"])
def test_a_collective_called_on_rank_zero_only_fails_within_seconds(tmp_path, call):
    codes = wait_all(start("one_rank_call.py", 2, tmp_path, (call,)), SAFETY_NET)
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert all(code != 0 for code in codes), f"exit codes {codes}\n{_tail(tmp_path)}"
    # the rank that made the call says what to do; the other one ends as soon as its process is gone
    assert "OneRankCallError" in logs[0] and "was called on rank 0 and not on every rank within 3 s" in logs[0], \
        _tail(tmp_path)
    assert "outside `if trainer.is_global_zero:`" in logs[0], _tail(tmp_path)
    assert not (tmp_path / "model.pt").exists() and not (tmp_path / "model.ckpt").exists()
