"""Fabric and the plain-loop engine against DDP through Fabric: the Trainer's parity scenarios, step for step.

One launch per world size runs every scenario under Fabric's ``ddp`` (the oracle), ``zero1/2/3`` through Fabric and
``engine1/2/3`` (a plain PyTorch loop over ``ZeroEngine``); each of 3 steps accumulates two micro-batches, clips by
norm and steps a per-step LR schedule. The odd world size 3 (padding everywhere) runs AdamW under every stage. The launches also write the checkpoints of the cross-API round trip: Fabric and the
Trainer each save at 2 ranks, and at 3 ranks each resumes the other's checkpoint.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_zero import load_full_checkpoint
from lightning_zero.testing.launch import launch
from tests.compare import assert_losses_close, assert_model_close, assert_params_close, mixed_precision_rtol
from tests.test_parity import RTOL

ZERO = ["zero1", "zero2", "zero3", "engine1", "engine2", "engine3"]
AT_WORLD_SIZE = {
    2: (["adamw", "adamw_separate", "gpt", "adafactor", "bf16_mixed"], ["ddp", *ZERO]),
    3: (["adamw"], ["ddp", "zero1", "zero2", "zero3", "engine3"]),
}
FP32 = ["adamw", "adamw_separate", "gpt", "adafactor"]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Any:
    """``launches(world_size)``: (what every rank saved, the output directory); world size 2 runs first (world size
    3 resumes its checkpoints)."""
    out = tmp_path_factory.mktemp("fabric")
    saved: dict[int, Any] = {}

    def get(world_size: int) -> tuple[list[dict], Any]:
        for ws in sorted(AT_WORLD_SIZE):
            if ws <= world_size and ws not in saved:
                names, runners = AT_WORLD_SIZE[ws]
                saved[ws] = launch("fabric_parity.py", ws, out, (",".join(names), ",".join(runners)), timeout=600)
        return saved[world_size], out

    return get


def cases(scenarios: list[str]) -> list[Any]:
    return [pytest.param(ws, scenario, runner, id=f"ws{ws}-{scenario}-{runner}")
            for ws, (names, runners) in AT_WORLD_SIZE.items() for scenario in scenarios if scenario in names
            for runner in runners if runner != "ddp" and not (scenario == "adamw_separate" and "engine" in runner)]


@pytest.mark.parametrize(("world_size", "scenario", "runner"), cases(FP32))
def test_fp32_matches_fabric_ddp_step_for_step(launches, world_size, scenario, runner):
    results, _ = launches(world_size)
    for rank_result in results:
        ddp, zero = rank_result[scenario]["ddp"], rank_result[scenario][runner]
        assert_losses_close(zero["losses"], ddp["losses"], RTOL)
        assert_params_close(zero["params"], ddp["params"], RTOL)
        assert zero["lr"] == ddp["lr"]  # the schedule and the param groups stay the user's


@pytest.mark.parametrize(("world_size", "scenario", "runner"), cases(["bf16_mixed"]))
def test_bf16_mixed_close_to_fabric_ddp_amp(launches, world_size, scenario, runner):
    # the bound of tests/test_parity.py::test_bf16_mixed_close_to_ddp_amp (bf16 working weights vs fp32 + autocast)
    results, _ = launches(world_size)
    for rank_result in results:
        assert_losses_close(rank_result[scenario][runner]["losses"], rank_result[scenario]["ddp"]["losses"], 1e-2)
        # 3 steps, all weights together: see [Note: the mixed-precision bound on parameters] in compare.py
        assert_model_close(rank_result[scenario][runner]["params"], rank_result[scenario]["ddp"]["params"],
                            mixed_precision_rtol(3))
        # per tensor, with the allowance of [Note: the mixed-precision bound on parameters] for Adam's small tensors
        # (up to 2.5x the model; 3x here): measured 2.4e-2 at most on healthy runs against 3.5e-2, and 8.1e-2 with
        # the working copy missing the update of step 2 (one of step 3 leaves the masters of 3 steps untouched)
        assert_params_close(rank_result[scenario][runner]["params"], rank_result[scenario]["ddp"]["params"],
                            3 * mixed_precision_rtol(3))


def _assert_same_checkpoint_content(actual_path: Any, expected_path: Any) -> None:
    actual, expected = load_full_checkpoint(actual_path), load_full_checkpoint(expected_path)
    assert actual["state_dict"].keys() == expected["state_dict"].keys()
    for key, value in expected["state_dict"].items():
        assert torch.equal(actual["state_dict"][key], value), key
    (a_opt,), (e_opt,) = actual["optimizer_states"], expected["optimizer_states"]
    assert a_opt["state"].keys() == e_opt["state"].keys()
    for index, entry in e_opt["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(a_opt["state"][index][name]), torch.as_tensor(value)), (index, name)
    assert [g["lr"] for g in a_opt["param_groups"]] == [g["lr"] for g in e_opt["param_groups"]]


def test_fabric_checkpoint_resumes_under_the_trainer_at_another_world_size(launches):
    _, out = launches(3)
    # Fabric zero2 at 2 ranks wrote it; the Trainer zero3 at 3 ranks restored it and saved what it restored
    _assert_same_checkpoint_content(out / "trainer-from-fabric", out / "fabric-ws2")


def test_trainer_checkpoint_loads_under_fabric_at_another_world_size(launches):
    results, out = launches(3)
    # the Trainer zero3 at 2 ranks wrote it; Fabric zero1 at 3 ranks loaded it and saved what it loaded
    _assert_same_checkpoint_content(out / "fabric-from-trainer", out / "trainer-ws2")
    loaded = results[0]["fabric_from_trainer"]
    assert loaded["global_step"] == 2 and "loops" in loaded["keys"]  # the Trainer's own entries come back


def test_load_raw_takes_a_plain_state_dict_file(launches):
    _, out = launches(3)
    # the Trainer's weights as one torch.save'd state dict, loaded by fabric.load_raw into a fresh zero3 model at 3 ranks
    actual = load_full_checkpoint(out / "fabric-raw", weights_only=True)["state_dict"]
    expected = torch.load(out / "raw_model.pt", weights_only=True)
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def test_a_model_not_set_up_saves_and_loads_as_under_ddp(launches):
    _, out = launches(3)
    # zero3 at 3 ranks: saved before setup (plain file), loaded into a set-up model, saved sharded, loaded unset-up
    before = torch.load(out / "plain-before.pt", weights_only=True)
    assert before["step"] == 3 and set(before) == {"model", "step"}
    sharded = load_full_checkpoint(out / "plain-loaded", weights_only=True)["state_dict"]
    reloaded = torch.load(out / "plain-reloaded.pt", weights_only=True)
    assert sharded.keys() == before["model"].keys() == reloaded.keys()
    for key, value in before["model"].items():
        assert torch.equal(sharded[key], value), key
        assert torch.equal(reloaded[key], value), key
