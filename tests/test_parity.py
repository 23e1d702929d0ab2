"""DDP is the oracle: zero1, zero2 and zero3 must reproduce its losses and weights step for step.

One launch per world size runs every scenario under ddp, zero1 and zero2 in the same processes (so fresh Trainers
after earlier ones are exercised too); the tests below only compare what it saved. World size 3 is odd on purpose:
the flat buffers and buckets must pad. Stages 1 and 2 cut each model into about 12 buckets, so parameters span
buckets and several reduce-scatters are in flight.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import pytest
import torch

from lightning_zero import load_full_checkpoint
from lightning_zero.testing.launch import launch
from tests.compare import FP16_ROUNDOFF, assert_losses_close, assert_params_close, mixed_precision_rtol

FP32_SCENARIOS = ["adamw", "gpt", "gpt_checkpointing", "sgd_value_clip", "adafactor", "gan_manual"]
STAGES = ["zero1", "zero2", "zero3"]
CHECKPOINTS = ["checkpoint_adamw", "checkpoint_adafactor"]
ALL = FP32_SCENARIOS + ["bf16_mixed", "fp16_overflow", "fp16_overflow_whole"] + CHECKPOINTS
# fp32: the only difference to DDP is the order of the gradient sums (reduce-scatter of pre-divided buckets versus
# DDP's all-reduce), i.e. rounding; the bound is 1e-5 relative. Weights are compared per tensor in norm: Adam divides
# by sqrt(v), so an element whose gradient is a near-cancelling sum can move by a few ulps of lr under any two
# reduction orders (DDP against itself with other buckets too); the norm of the difference is what rounding bounds.
RTOL = 1e-5
BF16_STEPS = 6  # the optimizer steps of the bf16_mixed scenario (tests/workers/parity.py)


# World size 2 runs every scenario; the odd world size 3 (padding everywhere) runs a subset, to keep the suite quick.
AT_WORLD_SIZE = {2: ALL, 3: ["adamw", "gpt", "adafactor", "bf16_mixed", "checkpoint_adamw"]}


def cases(scenarios: list[str], *more: list[str]) -> list[Any]:
    """``(world size, scenario, *one of each of more)`` for every world size that runs the scenario, as pytest params
    for ``results`` (indirect) and the test's own arguments: a case that could only be skipped is not generated."""
    return [pytest.param(world_size, scenario, *rest, id="-".join([f"ws{world_size}", scenario, *rest]))
            for world_size, names in AT_WORLD_SIZE.items() for scenario in scenarios if scenario in names
            for rest in itertools.product(*more)]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Callable[[int], list[dict]]:
    """``launches(world_size)``: what every rank saved, from one launch per world size made when a test first needs it.

    [Note: one launch per world size] The cases of each test carry their world size as the indirect parameter of
    ``results``; pytest does not group such cases across tests, so the launches are cached here (a failed launch too:
    its error is raised again by every case that needs it, without launching again).
    """
    saved: dict[int, Any] = {}

    def get(world_size: int) -> list[dict]:
        if world_size not in saved:
            out = tmp_path_factory.mktemp(f"parity{world_size}")
            names = AT_WORLD_SIZE[world_size]
            try:
                saved[world_size] = launch("parity.py", world_size, out, (",".join(names), "ddp," + ",".join(STAGES)),
                                           timeout=900)
            except AssertionError as error:
                saved[world_size] = error
        if isinstance(saved[world_size], AssertionError):
            raise saved[world_size]
        return saved[world_size]

    return get


@pytest.fixture
def results(request, launches) -> list[dict]:
    """The ranks' results at the world size of this case (see :func:`cases`)."""
    return launches(request.param)


@pytest.mark.parametrize(("results", "scenario", "stage"), cases(FP32_SCENARIOS, STAGES), indirect=["results"])
def test_fp32_matches_ddp_step_for_step(results, scenario, stage):
    for rank_result in results:
        ddp, zero = rank_result[scenario]["ddp"], rank_result[scenario][stage]
        assert_losses_close(zero["losses"], ddp["losses"], RTOL)
        assert_params_close(zero["params"], ddp["params"], RTOL)


@pytest.mark.parametrize(("results", "scenario"), cases(["adamw"]), indirect=["results"])
def test_lr_schedule_and_param_groups_kept(results, scenario):
    for rank_result in results:
        runs = rank_result[scenario]
        assert runs["zero1"]["lr"] == runs["zero2"]["lr"] == runs["zero3"]["lr"] == runs["ddp"]["lr"]
        assert runs["ddp"]["lr"][1] == pytest.approx(2 * runs["ddp"]["lr"][0])  # two groups, two learning rates


@pytest.mark.parametrize(("results", "scenario"), cases(ALL[:-len(CHECKPOINTS)]), indirect=["results"])
def test_every_rank_ends_with_the_same_weights(results, scenario):
    for stage in STAGES:
        first = results[0][scenario][stage]["params"]
        for other in results[1:]:
            for name, value in other[scenario][stage]["params"].items():
                assert torch.equal(value, first[name]), f"{scenario}/{stage}: {name} differs between ranks"


@pytest.mark.parametrize(("results", "scenario"), cases(["bf16_mixed"]), indirect=["results"])
def test_bf16_mixed_close_to_ddp_amp(results, scenario):
    # DDP's bf16-mixed keeps fp32 weights and autocasts; ZeRO computes with bf16 working weights (the paper's 2Ψ)
    # and steps fp32 masters. bf16 has an 8-bit mantissa (relative rounding 2**-9 ~ 2e-3 per value); through a few
    # layers the loss moves by a few of those, so 1e-2 relative is the honest bound. Stages 1 and 2 use the same
    # buckets, so they do the same arithmetic in the same order and must agree to fp32 rounding; stage 3 buckets by
    # unit, so its bf16 sums are rounded differently and it is held to the DDP bound.
    for rank_result in results:
        runs = rank_result[scenario]
        for stage in STAGES:
            assert_losses_close(runs[stage]["losses"], runs["ddp"]["losses"], 1e-2)
            assert all(v.dtype == torch.float32 for v in runs[stage]["params"].values())  # fp32 back after fit
            # see [Note: the mixed-precision bound on parameters] in compare.py
            assert_params_close(runs[stage]["params"], runs["ddp"]["params"], mixed_precision_rtol(BF16_STEPS))
        assert_losses_close(runs["zero2"]["losses"], runs["zero1"]["losses"], 1e-6)
        assert_params_close(runs["zero2"]["params"], runs["zero1"]["params"], 1e-6)


@pytest.mark.parametrize(("results", "scenario"), cases(["fp16_overflow"]), indirect=["results"])
def test_fp16_overflow_skips_the_step_on_every_rank(results, scenario):
    for stage in STAGES:
        scalers = [r[scenario][stage]["scaler"] for r in results]
        # rank 1 alone overflowed at step 2; all ranks skipped it and backed off, then grew again after 3 good steps
        assert all(s["skipped_steps"] == 1 for s in scalers), scalers
        assert all(s["scale"] == 1024.0 and s["good_steps"] == 3 for s in scalers), scalers
        losses = results[0][scenario][stage]["losses"]
        assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize(("results", "scenario", "stage"), cases(["fp16_overflow_whole"], STAGES), indirect=["results"])
def test_fp16_overflow_skips_a_step_made_in_one_call(results, scenario, stage):
    # Adafactor is stepped in one call on whole tensors: the loss scaler must still unscale and check for inf before
    # that call, and skip it (rank 1's inf loss at step 2). DDP with a GradScaler of the same settings is the oracle.
    for rank_result in results:
        run, ddp = rank_result[scenario][stage], rank_result[scenario]["ddp"]
        assert run["scaler"]["skipped_steps"] == 1 and run["scaler"]["good_steps"] == 3, run["scaler"]
        assert run["scaler"]["scale"] == ddp["scaler"]["scale"] == 1024.0  # halved once, grown back once
        assert all(torch.isfinite(v).all() for v in run["params"].values()), "non-finite weights after the overflow"
        assert_losses_close(run["losses"], ddp["losses"], 1e-3)
        # see [Note: the mixed-precision bound on parameters] in compare.py; 6 steps, one of them skipped by both
        assert_params_close(run["params"], ddp["params"], mixed_precision_rtol(6, FP16_ROUNDOFF))


@pytest.mark.parametrize(("results", "scenario", "stage"), cases(CHECKPOINTS, STAGES), indirect=["results"])
def test_checkpoint_resumes_under_another_stage(results, scenario, stage):
    for rank_result in results:
        run = rank_result[scenario][stage]
        assert_losses_close(run["resumed"], run["straight"], RTOL)


@pytest.mark.parametrize(("results", "scenario", "stage"), cases(CHECKPOINTS, STAGES), indirect=["results"])
def test_checkpoint_has_the_content_of_a_ddp_checkpoint(results, scenario, stage):
    ddp = torch.load(results[0][scenario]["ddp"]["ckpt"], weights_only=False)
    zero = load_full_checkpoint(results[0][scenario][stage]["ckpt"])  # the sharded directory, assembled
    assert_params_close(zero["state_dict"], ddp["state_dict"], RTOL)
    ddp_opt, zero_opt = ddp["optimizer_states"][0], zero["optimizer_states"][0]
    assert [g["params"] for g in zero_opt["param_groups"]] == [g["params"] for g in ddp_opt["param_groups"]]
    assert zero_opt["state"].keys() == ddp_opt["state"].keys()
    for index, expected in ddp_opt["state"].items():
        assert zero_opt["state"][index].keys() == expected.keys()
        assert_params_close(zero_opt["state"][index], expected, RTOL)
