"""hpZ (ZeRO++'s secondary partition, ``secondary_shard_group_size``): see [Note: hpZ, the secondary partition] in
``lightning_zero/stage3/secondary.py``.

One 4-rank launch (s=2, tests/workers/hpz.py) runs ddp, zero3 and zero3 with hpZ (with and without activation
checkpointing) on the same seed and data, with clipping by norm, gradient accumulation and validation. The rest are
the option's errors.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.config import resolve_secondary_group_size
from lightning_zero.testing.launch import launch
from tests.compare import relative, traffic_per_step

WORLD, S = 4, 2
MICRO = 2  # micro-batches per optimizer step (accumulate_grad_batches in the worker)
RTOL = 1e-5  # fp32 against DDP: only the order of the gradient sums differs (see tests/test_parity.py)
HPZ = ["hpz", "hpz_checkpointed"]


# ---------------------------------------------------------------------- the option's errors
@pytest.mark.parametrize(("options", "match"), [
    (dict(stage=2), "stage 2 keeps full parameters"),
    (dict(stage=1), "stage 1 keeps full parameters"),
    (dict(stage=3, shard_group_size=2), "hybrid sharding already keeps"),
    (dict(stage=3, tensor_parallel_size=2), "not supported with `tensor_parallel_size > 1`"),
    (dict(stage=3, offload_params=True), "offload_params=True"),
])
def test_refused_where_it_cannot_act(options, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig(secondary_shard_group_size=2, **options)


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError)])
def test_a_bad_size_fails_at_construction(value, error):
    with pytest.raises(error, match="secondary_shard_group_size"):
        ZeroStrategy(stage=3, secondary_shard_group_size=value)


def test_the_default_is_off():
    assert ZeroConfig(stage=3).secondary_shard_group_size is None
    assert resolve_secondary_group_size(None, 4, 4) is None


def test_a_size_that_does_not_divide_the_world_or_hybrid_sharding_is_refused():
    assert resolve_secondary_group_size(2, 4, 4) == 2
    with pytest.raises(ValueError, match=r"does not divide the world size 4.*Pick one of \[1, 2, 4\]"):
        resolve_secondary_group_size(3, 4, 4)
    with pytest.raises(ValueError, match="shards over groups of 2"):  # e.g. the default on two nodes
        resolve_secondary_group_size(2, 4, 2)


# ---------------------------------------------------------------------- the 4-rank launch
@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch("hpz.py", WORLD, tmp_path_factory.mktemp("hpz"), timeout=300)


@pytest.mark.parametrize("run", ["zero3", *HPZ])
def test_matches_ddp_step_for_step(ranks, run):
    for rank in ranks:
        ddp, zero = rank["ddp"], rank[run]
        assert len(zero["losses"]) == len(ddp["losses"]) == 3 * MICRO
        for step, (a, e) in enumerate(zip(zero["losses"], ddp["losses"])):
            assert abs(a - e) <= RTOL * abs(e), f"step {step}: loss {a} vs DDP {e}"
        for name, expected in ddp["params"].items():
            assert relative(zero["params"][name], expected) <= RTOL, name
        assert abs(zero["val_loss"] - ddp["val_loss"]) <= RTOL * abs(ddp["val_loss"])


@pytest.mark.parametrize("run", HPZ)
def test_backward_regathers_the_very_values_forward_gathered(ranks, run):
    """The secondary copy holds the elements forward gathered, so hpZ changes no bit of zero3's run."""
    for rank in ranks:
        assert rank[run]["losses"] == rank["zero3"]["losses"]
        for name, value in rank["zero3"]["params"].items():
            assert torch.equal(rank[run]["params"][name], value), name


@pytest.mark.parametrize("run", HPZ)
def test_backward_gathers_inside_the_secondary_group(ranks, run):
    """Per optimizer step and rank, T the padded flat size and U = T minus the root unit: zero3 all-gathers 2T per
    micro-batch over the world (forward and backward); with hpZ backward's U moves to the ``"secondary"`` scope (a
    group of s ranks) and the world keeps forward's T plus the root's re-gathers. Reduce-scatter is unchanged."""
    for rank in ranks:
        plain, hpz = rank["zero3"], rank[run]
        padded, root = hpz["padded"], hpz["root"]
        assert hpz["secondary_ranks"] == S and plain["secondary_ranks"] is None
        assert padded == plain["padded"] and padded > root
        for before, after in zip(traffic_per_step(plain["traffic"], MICRO), traffic_per_step(hpz["traffic"], MICRO)):
            assert "secondary" not in before and before["world"]["all_gather"] == 2 * MICRO * padded, before
            assert after["secondary"] == {"all_gather": MICRO * (padded - root)}, after
            assert after["world"]["all_gather"] == 2 * MICRO * padded - MICRO * (padded - root), after
            assert after["world"]["reduce_scatter"] == before["world"]["reduce_scatter"] == MICRO * padded
            # on a ring: (s-1)/s of backward's payload over the node's links instead of (N-1)/N over the world's
            assert after["secondary"]["all_gather"] * (S - 1) / S < before["world"]["all_gather"] / 2 * (WORLD - 1) / WORLD
