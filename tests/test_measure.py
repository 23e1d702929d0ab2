"""Traffic and model-state bytes per rank, measured on live runs, against the table in docs/stages.md.

Ψ is the number of trainable parameters. Stages 1 and 2 must move Ψ elements by reduce-scatter and Ψ by all-gather
per optimizer step (2Ψ, as DDP's all-reduce), stage 3 one more Ψ of all-gather (forward and backward: 3Ψ), and no
stage all-reduces gradients; the only all-reduce is the one-element global gradient norm for clipping. Model states
per rank must match the table within 5% (stage 3: measured after backward, when no unit is gathered; stage 1, whose
figure is what it holds inside ``no_backward_sync``, holds stage 2's after the backward a step follows).
"""

from __future__ import annotations

import pytest

from lightning_zero import expected_model_state_bytes
from lightning_zero.testing.launch import launch

WIDTH = 96


@pytest.fixture(scope="module", params=[(2, "32-true"), (3, "bf16-mixed")], ids=["ws2-fp32", "ws3-bf16"])
def measured(request, tmp_path_factory):
    world_size, precision = request.param
    out = tmp_path_factory.mktemp(f"measure{world_size}")
    ranks = launch("measure.py", world_size, out, (str(WIDTH), precision, "ddp,zero1,zero2,zero3"), timeout=400)
    return world_size, precision, ranks


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_traffic_per_step_matches_the_table(measured, stage):
    world_size, _, ranks = measured
    # stage 3 gathers every unit for forward and again for backward, but the last one, which forward leaves gathered
    gathers = 2 if stage == "zero3" else 1
    for rank in ranks:
        run = rank[stage]
        psi = run["numel"]
        kept = run["units"]["last"] if stage == "zero3" else 0
        assert (kept > 0) == (stage == "zero3")
        # each bucket pads to a multiple of the world size; stage 3 cuts buckets at unit and group boundaries too
        buckets = psi // (run["bucket_elements"] - run["bucket_elements"] % world_size) + 20
        padding = world_size * buckets
        for step in run["traffic"][1:]:
            elements = step["elements"]
            assert set(elements) <= {"reduce_scatter", "all_gather", "all_reduce", "control"}, elements
            assert elements.get("control", 0) <= 3  # one agreement on signals per step: 3 int32 flags
            assert psi <= elements["reduce_scatter"] <= psi + padding
            assert gathers * psi - kept <= elements["all_gather"] <= gathers * (psi + padding) - kept
            assert elements.get("all_reduce", 0) <= 1  # the clipping norm; gradients are never all-reduced


@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero2", "zero3"])
def test_model_state_bytes_match_the_table(measured, stage):
    world_size, precision, ranks = measured
    number = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[stage]
    for rank in ranks:
        run = rank[stage]
        bound = expected_model_state_bytes(run["numel"], world_size, number, precision)
        # stage 1 holds full gradients only inside no_backward_sync (the table's figure); after the backward a step
        # follows its gradients are reduced into the shard already, as stage 2's are
        expected = expected_model_state_bytes(run["numel"], world_size, 2, precision) if number == 1 else bound
        measured_bytes = run["states"]["model_states"]
        assert abs(measured_bytes - expected) <= 0.05 * expected, (stage, measured_bytes, expected, run["states"])
        assert measured_bytes <= 1.05 * bound


def test_zero_saves_memory_in_the_order_of_the_stages(measured):
    _, _, ranks = measured
    for rank in ranks:
        sizes = [rank[s]["states"]["model_states"] for s in ("ddp", "zero1", "zero2", "zero3")]
        assert sizes[0] > sizes[1] >= sizes[2] > sizes[3]  # stage 1's sharded masters are stage 2's after backward


def test_bucket_buffers_are_bounded_by_the_bucket_size(measured):
    world_size, precision, ranks = measured
    element_size = 4 if precision == "32-true" else 2
    for rank in ranks:
        for stage in ("zero1", "zero2", "zero3"):
            run = rank[stage]
            # two pooled buffers (config default), each a bucket plus its reduce-scatter output
            bound = 2 * (run["bucket_elements"] + world_size) * (1 + 1 / world_size) * element_size
            assert 0 < run["states"]["comm_buffers"] <= bound
