"""Hybrid sharding (``shard_group_size=k``): sharded over groups of k ranks, replicated across the N/k groups.

One 4-rank launch (k=2, tests/workers/hybrid.py) runs ddp and zero1-3 on the same seed and data, with SGD and
gradient accumulation, and a chain of checkpoints across layouts (zero3 k=2 -> plain zero1 k=4 -> zero2 k=2, next to
ddp resuming its own). The rest are pure unit tests: group arithmetic, options and their errors.

[Note: the gradient's scale]
Hybrid sharding averages the gradients over the world in two hops (reduce-scatter in the shard group, all-reduce
across replicas); averaging over the shard group only would leave them N/k times too large. Clipping by norm (which
rescales whatever comes in to the same norm) and Adam (whose update m/sqrt(v) does not change when the gradients are
scaled) both hide such a constant factor, so the runs here use plain SGD without clipping, where the weights move by
lr times the gradient, and compare the weights and every step's total gradient norm (ZeRO's from its shards, over
the shard group) with DDP's.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.cli import LightningCLI

from lightning_zero import ZeroConfig, ZeroStrategy, load_full_checkpoint
from lightning_zero.comm.traffic import Traffic
from lightning_zero.comm.groups import ShardGroups
from lightning_zero.comm.groups import resolve_shard_group_size
from lightning_zero.comm.groups import hybrid_rank_lists
from tests.compare import backwards_keeping_the_last_unit, relative, traffic_per_step
from lightning_zero.testing.launch import launch, launch_nodes
from tests.models import TinyGPT

WORLD, K = 4, 2
R = WORLD // K  # replicas
MICRO = 2  # micro-batches per optimizer step (accumulate_grad_batches in the worker)
RTOL = 1e-5  # fp32 against DDP: only the order of the gradient sums differs (see tests/test_parity.py)
STAGES = ["zero1", "zero2", "zero3"]


# ---------------------------------------------------------------------- unit tests
@pytest.mark.parametrize(("world", "k", "shards", "replicas"), [
    (4, 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    (6, 3, [[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]]),
    (4, 4, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    (3, 1, [[0], [1], [2]], [[0, 1, 2]]),
])
def test_groups_are_consecutive_ranks_and_their_positions(world, k, shards, replicas):
    assert hybrid_rank_lists(world, k) == (shards, replicas)


@pytest.mark.parametrize(("configured", "world", "per_node", "nodes", "expected"), [
    (None, 8, 4, 2, 8),  # several nodes: every rank, the paper's N
    (None, 4, 4, 1, 4),  # one node: the whole world
    ("node", 8, 4, 2, 4),  # hybrid: one node's devices
    ("node", 4, 4, 1, 4),
    (2, 4, 4, 1, 2),
    (4, 8, 4, 2, 4),
])
def test_the_default_group_is_every_rank(configured, world, per_node, nodes, expected):
    assert resolve_shard_group_size(configured, world, per_node, nodes) == expected


def test_node_with_tensor_parallelism_is_a_node_of_data_parallel_rows():
    assert resolve_shard_group_size("node", 16, 8, 2, tensor_parallel_size=2) == 4
    assert resolve_shard_group_size(None, 16, 8, 2, tensor_parallel_size=2) == 8
    with pytest.raises(ValueError, match="whole tensor groups inside a node"):
        resolve_shard_group_size("node", 12, 3, 4, tensor_parallel_size=2)


def test_group_sizes_are_resolved_once_for_the_engine_and_the_strategies():
    # see [Note: the group sizes are resolved in one place] in comm/groups.py: the engine (one node of every rank)
    # and the strategies (their nodes and devices) get their sizes from the same function
    from lightning_zero.comm.groups import GroupSizes
    from lightning_zero.engine.policies import group_sizes

    assert group_sizes(ZeroConfig(), 8, 4, 2) == GroupSizes(world=8, shard=8, tensor=1, secondary=None)
    assert group_sizes(ZeroConfig(shard_group_size="node"), 8, 4, 2).shard == 4
    assert group_sizes(ZeroConfig(shard_group_size="node"), 8, 8, 1).shard == 8  # the engine's view of a job
    assert group_sizes(ZeroConfig(shard_group_size="node", tensor_parallel_size=2), 16, 8, 2).shard == 4
    assert group_sizes(ZeroConfig(stage=3, secondary_shard_group_size=2), 4, 4, 1).secondary == 2
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        group_sizes(ZeroConfig(stage=3, secondary_shard_group_size=4), 6, 6, 1)
    strategy = ZeroStrategy(stage=3, secondary_shard_group_size=2)
    strategy.parallel_devices = [torch.device("cpu")] * 4
    assert strategy.group_sizes == group_sizes(strategy.config, 4, 4, 1)
    assert (strategy.shard_group_size, strategy.secondary_shard_group_size) == (4, 2)


def test_a_group_size_that_does_not_divide_the_world_fails_before_launch():
    with pytest.raises(ValueError, match=r"`shard_group_size=3` does not divide the world size 4.*\[1, 2, 4\]"):
        resolve_shard_group_size(3, 4, 4, 1)
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        L.Trainer(strategy=ZeroStrategy(shard_group_size=3), accelerator="cpu", devices=4, logger=False)
    with pytest.raises(ValueError, match="divide"):
        hybrid_rank_lists(4, 3)


@pytest.mark.parametrize(("value", "error", "match"), [("nodes", TypeError, "number of ranks or 'node'"),
                                                       (0, ValueError, "positive number of ranks"),
                                                       (-2, ValueError, "positive number of ranks"),
                                                       ("2", TypeError, "number of ranks or 'node'"),
                                                       (True, TypeError, "positive int")])
def test_a_bad_group_size_fails_at_construction(value, error, match):
    with pytest.raises(error, match=f"shard_group_size.*{match}"):
        ZeroConfig(shard_group_size=value)
    with pytest.raises(error, match=match):
        ZeroStrategy(shard_group_size=value)


def test_plain_zero_has_one_group_and_counts_the_world():
    groups = ShardGroups()
    assert (groups.shard.process_group, groups.replicate, groups.replicas, groups.first_replica) == (None, None, 1, True)
    assert groups.shard.scope == "world" and groups.shard.traffic is groups.traffic
    traffic = Traffic()
    traffic.add("all_reduce", torch.zeros(3))
    assert traffic.snapshot()["scopes"] == {"world": {"all_reduce": 3}}


@pytest.mark.parametrize(("value", "expected"), [("2", 2), ("node", 4)])
def test_yaml_sets_the_group_size(tmp_path, value, expected):
    config = tmp_path / "hybrid.yaml"
    config.write_text("trainer:\n  accelerator: cpu\n  devices: 4\n  num_nodes: 2\n  strategy:\n"
                      "    class_path: lightning_zero.ZeroStrategy\n    init_args:\n      stage: 3\n"
                      f"      shard_group_size: {value}\n")
    cli = LightningCLI(TinyGPT, args=["--config", str(config)], run=False, save_config_callback=None)
    assert cli.trainer.strategy.config.shard_group_size == (2 if value == "2" else "node")
    assert cli.trainer.strategy.shard_group_size == expected


# ---------------------------------------------------------------------- the 4-rank launch
@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch("hybrid.py", WORLD, tmp_path_factory.mktemp("hybrid"), timeout=240)


@pytest.mark.parametrize("stage", STAGES)
def test_matches_ddp_step_for_step(ranks, stage):
    for rank in ranks:
        ddp, zero = rank["ddp"], rank[stage]
        assert len(zero["losses"]) == len(ddp["losses"]) == 3 * MICRO
        for step, (a, e) in enumerate(zip(zero["losses"], ddp["losses"])):
            assert abs(a - e) <= RTOL * abs(e), f"step {step}: loss {a} vs DDP {e}"
        for name, expected in ddp["params"].items():
            assert relative(zero["params"][name], expected) <= RTOL, name
        # see [Note: the gradient's scale]
        assert len(zero["grad_norms"]) == len(ddp["grad_norms"]) == 3
        for a, e in zip(zero["grad_norms"], ddp["grad_norms"]):
            assert abs(a - e) <= RTOL * abs(e), (zero["grad_norms"], ddp["grad_norms"])


@pytest.mark.parametrize("stage", STAGES)
def test_replicas_end_bitwise_identical(ranks, stage):
    for rank in ranks[1:]:
        for name, value in rank[stage]["params"].items():
            assert torch.equal(value, ranks[0][stage]["params"][name]), name


@pytest.mark.parametrize("stage", STAGES)
def test_traffic_inside_and_across_groups(ranks, stage):
    """Per optimizer step and rank (see [Note: hybrid sharding and its traffic] in comm/groups.py), T the padded
    flat size (Ψ rounded up per bucket to a multiple of k): inside the shard group, reduce-scatters of T per
    reduction (stage 1 reduces once per step, stages 2-3 once per micro-batch) and all-gathers of T (stage 3: T for
    forward and T for backward per micro-batch, less the unit forward ran last, which backward finds gathered);
    across groups one all-reduce of the T/k shard per reduction, i.e. 2(T/k)(R-1)/R elements on a ring's wire. The
    gradient norms the worker logs (one element per parameter) stay inside; only the signal agreement (3 int32 flags)
    spans the world."""
    reductions = 1 if stage == "zero1" else MICRO
    gathers = 2 * MICRO if stage == "zero3" else 1
    for rank in ranks:
        run = rank[stage]
        padded, shard = run["padded"], run["shard"]
        assert padded == K * shard and 0 <= padded - sum(p.numel() for p in run["params"].values()) < 12 * K
        assert (run["last"] > 0) == (stage == "zero3")
        for step, scopes in enumerate(traffic_per_step(run["traffic"], MICRO)):
            kept = backwards_keeping_the_last_unit(step, MICRO) * run["last"]
            assert scopes["shard"] == {"reduce_scatter": reductions * padded, "all_gather": gathers * padded - kept,
                                       "all_reduce": len(run["params"])}, scopes
            assert scopes["replicate"] == {"all_reduce": reductions * shard}, scopes
            assert scopes["world"] == {"control": 3 * MICRO}, scopes
            wire_across = 2 * scopes["replicate"]["all_reduce"] * (R - 1) / R
            assert math.isclose(wire_across, reductions * 2 * (padded / K) * (R - 1) / R)


@pytest.mark.parametrize("stage", STAGES)
def test_hybrid_checkpoint_loads_in_one_process(ranks, stage):
    """The directory written by 4 ranks in groups of 2 loads at world size 1 (the in-process loader): exactly the
    weights the run ended with, and DDP's checkpoint content within fp32 rounding."""
    run, ddp = ranks[0][stage], torch.load(ranks[0]["ddp"]["ckpt"], weights_only=False)
    full = load_full_checkpoint(run["ckpt"])
    for name, value in run["params"].items():
        assert torch.equal(full["state_dict"][name], value), name
        assert relative(full["state_dict"][name], ddp["state_dict"][name]) <= RTOL, name
    ddp_state, zero_state = ddp["optimizer_states"][0]["state"], full["optimizer_states"][0]["state"]
    assert zero_state.keys() == ddp_state.keys()
    for index, expected in ddp_state.items():
        for key, value in expected.items():
            assert relative(zero_state[index][key], value) <= RTOL, (index, key)


def test_checkpoints_cross_layouts_both_ways(ranks):
    """zero3 k=2 -> plain zero1 (k=4, one step) -> zero2 k=2 (one more step): each resume starts from exactly the
    saved weights, and the two resumed steps follow DDP resuming its own checkpoints the same way."""
    for rank in ranks:
        plain, hybrid = rank["plain_from_hybrid"], rank["hybrid_from_plain"]
        for name, value in rank["zero3"]["params"].items():
            assert torch.equal(plain["start"][name], value), name
        for name, value in plain["params"].items():
            assert torch.equal(hybrid["start"][name], value), name
        chained = plain["losses"] + hybrid["losses"]
        ddp = rank["ddp_resumed"]["losses"] + rank["ddp_resumed_again"]["losses"]
        assert len(chained) == len(ddp) == 2 * MICRO
        for a, e in zip(chained, ddp):
            assert abs(a - e) <= RTOL * abs(e), (chained, ddp)


# ---------------------------------------------------------------------- two nodes, as Lightning launches them
@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> list[dict]:
    return launch_nodes("nodes.py", 2, tmp_path_factory.mktemp("nodes"), timeout=300)


@pytest.mark.timeout(360)
def test_two_nodes_shard_over_every_rank_unless_told(nodes):
    """2 nodes x 2 ranks (tests/workers/nodes.py): zero3 shards over all 4 ranks by default and over each node's 2
    with ``shard_group_size="node"``; the summary names the layout; both follow DDP step for step."""
    assert [(r["ddp"]["global_rank"], r["ddp"]["node_rank"], r["ddp"]["world_size"]) for r in nodes] == [
        (0, 0, 4), (1, 0, 4), (2, 1, 4), (3, 1, 4)]
    for rank in nodes:
        default, node = rank["default"], rank["node"]
        assert (default["shard_group_size"], default["replicas"]) == (4, 1)
        assert (node["shard_group_size"], node["replicas"]) == (2, 2)
        assert default["padded"] == 4 * default["shard"] and node["padded"] == 2 * node["shard"]
        assert "ZeRO stage 3 on 4 ranks (sharded over all 4)" in default["summary"], default["summary"]
        assert "(hybrid: sharded over groups of 2, replicated 2x)" in node["summary"], node["summary"]
        for run in (default, node):
            assert len(run["losses"]) == len(rank["ddp"]["losses"]) == 3
            for a, e in zip(run["losses"], rank["ddp"]["losses"]):
                assert abs(a - e) <= RTOL * abs(e), (run["losses"], rank["ddp"]["losses"])
            for name, expected in rank["ddp"]["params"].items():
                assert relative(run["params"][name], expected) <= RTOL, name
