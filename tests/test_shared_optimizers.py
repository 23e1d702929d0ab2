"""Several optimizers over the same parameters (issue 13): zero1-3 must do what ddp does, step for step.

One launch on 2 gloo ranks runs every scenario under ddp, zero1, zero2 and zero3 (``tests/workers/shared_optimizers.py``,
model ``tests.models.SharedOptimizers``): SGD and Adam over all parameters plus a third optimizer over an overlapping
subset, stepped by manual optimization with closures, clipping, one backward for three steps, and a ``zero_grad``
of the subset between two backwards; per-optimizer LR schedulers and logging. The third optimizer is AdamW (flat
slices) or Adafactor (whole tensors for every optimizer sharing with it).
"""

from __future__ import annotations

import pytest
import torch

from lightning_zero import load_full_checkpoint
from lightning_zero.testing.launch import launch
from tests.compare import assert_losses_close, assert_params_close
from tests.test_parity import RTOL

STAGES = ["zero1", "zero2", "zero3"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch("shared_optimizers.py", 2, tmp_path_factory.mktemp("shared"), timeout=600)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("scenario", ["manual", "manual_whole"])
def test_shared_parameters_match_ddp_step_for_step(ranks, scenario, stage):
    for rank in ranks:
        ddp, zero = rank[scenario]["ddp"], rank[scenario][stage]
        assert len(ddp["losses"]) == 16
        assert_losses_close(zero["losses"], ddp["losses"], RTOL)
        assert_params_close(zero["params"], ddp["params"], RTOL)


@pytest.mark.parametrize("stage", STAGES)
def test_calls_schedulers_steps_and_logs_match_ddp(ranks, stage):
    for rank in ranks:
        ddp, zero = rank["manual"]["ddp"], rank["manual"][stage]
        assert zero["calls"] == ddp["calls"] and ddp["calls"][0] == {"step": 8, "zero_grad": 8}
        assert zero["lr"] == ddp["lr"]  # each optimizer's own scheduler, stepped at its own frequency
        assert zero["global_step"] == ddp["global_step"] == 24  # manual optimization counts every step
        assert zero["metrics"].keys() == ddp["metrics"].keys() == {f"loss_phase{i}" for i in range(4)}
        for key, value in ddp["metrics"].items():
            assert zero["metrics"][key] == pytest.approx(value, rel=RTOL)


def test_automatic_optimization_raises_what_ddp_raises(ranks):
    for rank in ranks:
        errors = rank["automatic"]
        assert errors["ddp"]["error"][0] == "RuntimeError"
        assert "only supported with manual optimization" in errors["ddp"]["error"][1]
        for stage in STAGES:
            assert errors[stage]["error"] == errors["ddp"]["error"]


@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_round_trip_with_shared_parameters(ranks, stage):
    for rank in ranks:
        run = rank["checkpoint"][stage]  # saved under `stage`, resumed under the next stage
        assert len(run["resumed"]) == len(run["straight"]) == 8
        assert_losses_close(run["resumed"], run["straight"], RTOL)
        assert_params_close(run["resumed_params"], run["straight_params"], RTOL)
        assert_losses_close(run["from_ddp"], rank["checkpoint"]["ddp"]["straight"], RTOL)  # ddp's file, resumed
    ddp = torch.load(ranks[0]["checkpoint"]["ddp"]["ckpt"], weights_only=False)
    zero = load_full_checkpoint(ranks[0]["checkpoint"][stage]["ckpt"])
    assert_params_close(zero["state_dict"], ddp["state_dict"], RTOL)
    assert len(zero["optimizer_states"]) == len(ddp["optimizer_states"]) == 3
    for ddp_opt, zero_opt in zip(ddp["optimizer_states"], zero["optimizer_states"]):  # each optimizer its own state
        assert [g["params"] for g in zero_opt["param_groups"]] == [g["params"] for g in ddp_opt["param_groups"]]
        assert zero_opt["state"].keys() == ddp_opt["state"].keys() and ddp_opt["state"]
        for index, expected in ddp_opt["state"].items():
            assert zero_opt["state"][index].keys() == expected.keys()
            assert_params_close(zero_opt["state"][index], expected, RTOL)
