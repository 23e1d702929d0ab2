"""ZeRO-R: activation checkpointing (with stages 1-3, mixed precision, frozen parameters and dropout), offload (Pa+cpu),
partitioned checkpoints (Pa) on a tensor-parallel block, constant collective buffers (CB) and contiguous buffers (MD).

Two launches of 2 gloo ranks: one runs every Lightning case in the same processes (``workers/activations.py``), the
other a plain PyTorch tensor-parallel block (``workers/tp_partition.py``). The rest runs in this process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.activations.checkpointing import checkpoint_blocks
from lightning_zero.testing.launch import launch
from tests.compare import assert_losses_close, assert_params_close
from tests.test_parity import RTOL


# ---------------------------------------------------------------------------------------------------- Lightning, 2 ranks
@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    return launch("activations.py", 2, tmp_path_factory.mktemp("activations"), timeout=400)


@pytest.mark.parametrize("case", ["zero1", "zero2", "zero3", "zero2_offload_contiguous"])
def test_checkpointed_zero_matches_ddp_with_dropout_and_frozen_params(lightning_runs, case):
    # DDP runs without checkpointing: the preserved RNG state gives dropout the same masks when recomputed
    for rank in lightning_runs:
        ddp, run = rank["ddp"], rank[case]
        assert run["blocks"] == ["blocks.0", "blocks.1", "blocks.2"]
        assert run["stats"]["packed"] == run["stats"]["unpacked"] == 3 * 6  # 3 blocks, 6 micro-batches
        assert_losses_close(run["losses"], ddp["losses"], RTOL)
        assert_params_close(run["params"], ddp["params"], RTOL)
        assert run["keys"] == ddp["keys"]  # the state-dict keys do not change
        assert not run["wrapped_after_fit"]  # teardown gave the blocks their own forward back


def test_zero3_recompute_gathers_each_unit_at_most_once_in_backward(lightning_runs):
    for rank in lightning_runs:
        for case in ("zero3", "zero3_deep"):
            run = rank[case]
            units = range(1, run["temporary"]["units"])  # every unit but the root, which stays gathered
            first, *later = run["backward_gathers"]
            assert first == {u: 1 for u in units} and later  # the first forward does not know yet which unit is last
            # later, the unit forward ran last is still gathered when its recompute starts backward
            last = run["temporary"]["last_unit"]
            assert last in units and all(g == {u: 1 for u in units if u != last} for g in later)


def test_zero3_under_the_users_own_checkpoint_gathers_what_a_run_without_recompute_gathers(lightning_runs):
    """Every block under ``torch.utils.checkpoint`` in the model's own forward (not the strategy's checkpointing): the
    forward recomputed in backward runs stage 3's hooks, and must gather no unit more than a run without any
    recomputation does: the same gathers of each unit in each step, the same bytes all-gathered (the collectives'
    counters), a gathered peak within the root, two blocks and the prefetch, and the same losses."""
    from tests.workers.activations import PREFETCH

    for rank in lightning_runs:
        plain, user = rank["zero3_plain"], rank["zero3_user"]
        units = range(1, user["temporary"]["units"])
        assert len(user["step_gathers"]) == 3 and all(user["step_gathers"]), user["step_gathers"]
        assert user["step_gathers"] == plain["step_gathers"]
        for step in user["step_gathers"][1:]:  # two micro-batches: each unit twice a step, in forward and backward
            assert all(step[u] <= 4 for u in units), step
        first, *later = user["backward_gathers"]
        last = user["temporary"]["last_unit"]
        assert first == {u: 1 for u in units} and len(later) == 5
        assert all(g == {u: 1 for u in units if u != last} for g in later), later
        assert len(user["step_gathered_bytes"]) == 3 and min(user["step_gathered_bytes"]) > 0
        assert user["step_gathered_bytes"] == plain["step_gathered_bytes"]
        root, *blocks = user["temporary"]["unit_numels"]
        assert 0 < user["temporary"]["gathered_peak"] <= 4 * (root + 2 * max(blocks) + PREFETCH), user["temporary"]
        assert user["losses"] == plain["losses"]  # the preserved RNG state gives dropout the same masks


def test_bf16_mixed_checkpointing_recomputes_the_same_values(lightning_runs):
    for rank in lightning_runs:
        plain, checkpointed = rank["zero3_bf16_plain"], rank["zero3_bf16"]
        assert checkpointed["stats"]["unpacked"] > 0 and plain["stats"] is None
        assert_losses_close(checkpointed["losses"], plain["losses"], 1e-6)  # autocast is replayed in recompute
        assert_params_close(checkpointed["params"], plain["params"], 1e-6)


def test_contiguous_checkpoints_live_in_one_buffer_after_the_first_step(lightning_runs):
    for rank in lightning_runs:
        stats = rank["zero2_offload_contiguous"]["stats"]
        assert stats["buffer_bytes"] >= stats["peak_bytes"] > 0
        assert stats["in_buffer"] == stats["packed"] - 3  # the first micro-batch sizes it, all later ones fit
        assert stats["fallbacks"] == 0 and stats["host_bytes"] == 0  # CPU: the host is the device


def test_collective_buffers_do_not_grow_when_the_model_doubles(lightning_runs):
    # zero2: twice the width (4x the parameters), same bucket size; zero3: twice the depth, same prefetch size
    for rank in lightning_runs:
        small, wide = rank["zero2"]["temporary"], rank["zero2_wide"]["temporary"]
        assert 0 < wide["bucket_bytes"] == small["bucket_bytes"] <= 4 * (600 + 300) * 4  # a few 600-element slots
        shallow, deep = rank["zero3"]["temporary"], rank["zero3_deep"]["temporary"]
        assert deep["units"] > shallow["units"]
        # at most the root, the unit running and `prefetch_size` elements ahead of it: the bound of the options, the
        # same for both depths (where within it a peak lands depends on which units' checks were waited for late)
        for run in (shallow, deep):
            root, *units = run["unit_numels"]
            assert 0 < run["gathered_peak"] <= 4 * (root + max(units) + run["prefetch_size"]), run
        root, *units = deep["unit_numels"]
        assert deep["gathered_peak"] > 4 * (root + 2 * max(units))  # two blocks at once: the prefetch did overlap
        assert deep["bucket_bytes"] == shallow["bucket_bytes"]
        deep_bytes = 4 * sum(p.numel() for p in rank["zero3_deep"]["params"].values())
        assert deep["gathered_peak"] < 0.5 * deep_bytes
        assert all(rank[c]["temporary"]["grad_shards"] == [True] for c in ("zero2", "zero3"))  # one flat shard


def test_data_parallel_ranks_cannot_be_named_as_a_partition_group(lightning_runs):
    for rank in lightning_runs:
        assert "hold different checkpointed activations" in rank["zero2_partition_refused"]["error"]


# ---------------------------------------------------------------------------------------------------- Pa, 2 ranks
@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    return launch("tp_partition.py", 2, tmp_path_factory.mktemp("tp"), timeout=200)


def test_partitioned_checkpoints_halve_the_bytes_and_keep_the_gradients(tp_runs):
    for rank in tp_runs:
        plain = rank["plain"]
        for case in ("partitioned", "partitioned_offload"):
            run = rank[case]
            assert run["loss"] == plain["loss"]
            for name, grad in plain["grads"].items():
                assert torch.equal(run["grads"][name], grad), name
            assert run["kept"] * 2 == plain["kept"] == run["full"] > 0  # each rank keeps half
            assert run["all_gathers"] == run["stats"]["gathers"] == 4  # one per block, before its recompute
        assert plain["all_gathers"] == 0


def test_partitioning_refuses_ranks_with_different_activations(tp_runs):
    assert all("hold different checkpointed activations" in rank["error"] for rank in tp_runs)


# ---------------------------------------------------------------------------------------------------- one process
class Net(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 8))
            for _ in range(depth)
        )
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _steps(model: nn.Module, batches: list[torch.Tensor]) -> list[tuple[float, list[torch.Tensor]]]:
    torch.manual_seed(3)
    out = []
    for x in batches:
        model.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        out.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    return out


@pytest.mark.parametrize("options", [{}, {"offload": True}, {"contiguous": True}, {"offload": True, "contiguous": True}])
def test_checkpointed_blocks_give_identical_gradients(options):
    torch.manual_seed(0)
    model = Net()
    batches = [torch.randn(4, 8), torch.randn(4, 8), torch.randn(6, 8)]  # the last one outgrows the buffer
    expected = _steps(copy.deepcopy(model), batches)
    ac = checkpoint_blocks(model, **options)
    for (loss, grads), (expected_loss, expected_grads) in zip(_steps(model, batches), expected):
        assert loss == expected_loss and len(grads) == len(expected_grads) > 0
        assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads))
    assert ac.stats.packed == ac.stats.unpacked > 0 and ac.stats.live_bytes == 0
    assert ac.stats.peak_bytes == 3 * 6 * 8 * 4  # the three block inputs of the largest batch, nothing else
    if options.get("contiguous"):
        assert ac.stats.in_buffer > 0 and ac.stats.fallbacks > 0 and ac.stats.buffer_bytes >= 3 * 6 * 8 * 4


def test_wrapping_keeps_the_module_and_is_undone():
    model = Net()
    keys = list(model.state_dict())
    ac = checkpoint_blocks(model)
    again = checkpoint_blocks(model)  # idempotent: no second checkpoint around the first
    assert list(model.state_dict()) == keys and type(model.blocks[0]) is nn.Sequential
    assert model.blocks[0].forward.original.__self__ is model.blocks[0]
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert ac.stats.packed == again.stats.packed == 0  # without grad the blocks run plainly
    again.remove()
    ac.remove()
    assert all("forward" not in block.__dict__ for block in model.blocks)


def test_blocks_chosen_by_class_or_name_and_a_clear_error_without_any():
    model = Net()
    assert checkpoint_blocks(model, blocks=["Linear"]).names == [f"blocks.{i}.{j}" for i in range(3) for j in (1, 4)] \
        + ["head"]
    with pytest.raises(ValueError, match="no repeated block"):
        checkpoint_blocks(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no submodule of Net is of that class"):
        checkpoint_blocks(Net(), blocks=[nn.Conv1d])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"activation_offload": True}, ValueError, "also set `activation_checkpointing=True`"),
        ({"contiguous_checkpoints": True}, ValueError, "also set"),
        ({"activation_partition_group": [0, 1]}, ValueError, "also set"),
        ({"activation_checkpointing": "Block"}, TypeError, "list of block classes"),
        ({"activation_checkpointing": True, "activation_offload": 1}, TypeError, "must be a bool"),
        ({"activation_checkpointing": True, "activation_partition_group": "0,1"}, TypeError, "list of global ranks"),
        ({"activation_checkpointing": True, "activation_partition_group": [[0, 1], [1, 2]]}, ValueError, "twice"),
        ({"activation_checkpointing": True, "activation_partition_group": [-1]}, TypeError, "list of global ranks"),
    ],
)
def test_activation_options_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        ZeroConfig(**kwargs)
    with pytest.raises(error, match=match):
        ZeroStrategy(**kwargs)


def test_activation_options_are_normalized():
    config = ZeroConfig(activation_checkpointing=["Block"], activation_partition_group=[[0, 1], [2, 3]])
    assert config.activation_checkpointing == ("Block",)
    assert config.activation_partition_group == ((0, 1), (2, 3))
    assert ZeroConfig(activation_checkpointing=True, activation_partition_group=[1, 0]).activation_partition_group \
        == (1, 0)
