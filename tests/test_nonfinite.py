"""The non-finite guard (``nonfinite=``, see [Note: the non-finite guard] in lightning_zero/engine/engine.py): a NaN
loss on one rank at a chosen step (tests/workers/nonfinite.py) raises on every rank, is skipped on every rank as a
DDP loop that skips it, or (the default) writes NaN weights as DDP does."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_zero import ZeroConfig
from lightning_zero.testing.launch import _tail, launch, start, wait_all

RUN_TIMEOUT = 240  # a safety net (a run takes ~15 s)


def test_the_option_is_checked():
    assert ZeroConfig().nonfinite is None and ZeroConfig(nonfinite="skip").nonfinite == "skip"
    with pytest.raises(ValueError, match="`nonfinite` must be 'raise', 'skip' or None"):
        ZeroConfig(nonfinite="warn")


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_raise_stops_every_rank_naming_the_step_and_the_rank(tmp_path):
    codes = wait_all(start("nonfinite.py", 2, tmp_path, ("raise",)), RUN_TIMEOUT)
    assert all(codes), f"exit codes {codes}:\n{_tail(tmp_path)}"
    for rank in range(2):
        log = (tmp_path / f"rank{rank}.log").read_text()
        assert (f"FloatingPointError: The gradients of step 2 are not finite (global norm nan; raised on rank {rank}, "
                "as on every rank)") in log, log[-3000:]


@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.parametrize("mode", ["skip", "skip-clip"])  # the guard's own norm; clipping's (gradient_clip_val)
def test_skip_leaves_the_weights_of_a_ddp_loop_that_skips_the_same_step(tmp_path, mode):
    for out in launch("nonfinite.py", 2, tmp_path, (mode,), timeout=RUN_TIMEOUT):
        assert len(out["losses"]) == 4 and all(math.isfinite(loss) for loss in out["losses"])  # before the NaN
        assert "1 optimizer step(s) skipped for non-finite gradients" in out["summary"]
        for name, value in out["weights"].items():
            assert torch.isfinite(value).all(), name
            torch.testing.assert_close(value, out["reference"][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_by_default_a_nan_step_writes_nan_weights_as_ddp_does_and_the_run_succeeds(tmp_path):
    for out in launch("nonfinite.py", 2, tmp_path, ("none",), timeout=RUN_TIMEOUT):  # every rank exits 0
        assert "skipped" not in out["summary"]
        assert any(torch.isnan(v).any() for v in out["weights"].values())
        for name, value in out["weights"].items():
            torch.testing.assert_close(value, out["reference"][name], rtol=1e-5, atol=1e-6, equal_nan=True, msg=name)
