"""Direct tests of the core's collectives under hybrid sharding, on 4 gloo ranks in shard groups of 2 (one launch of
``tests/workers/reducer_groups.py``): the :class:`GradientReducer`'s cross-group all-reduce after the reduce-scatter,
with a device shard and with a sink (``offload.HostGrads``), and :class:`ShardedParams`'s all-gather over a shard group.

The expected shards are computed here from every rank's gradients (``grad``) with torch's own sum, and cut by
``tests.compare.shard_of``; nothing of the reducer's bookkeeping is reused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.compare import shard_of
from lightning_zero.testing.launch import launch
from tests.workers.reducer_groups import (NUMELS, ROUNDS, SKIPPED, UNITS, flat_values, grad, params_layout,
                                          reducer_layout)

WORLD = 4
PATHS = ["device", "sink"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return launch("reducer_groups.py", WORLD, tmp_path_factory.mktemp("reducer_groups"), timeout=120)


def _mean_shard(shard_rank: int, backwards: list[int], skip: int = -1) -> torch.Tensor:
    """``shard_rank``'s shard of the world's mean gradient summed over ``backwards`` (``skip``: no gradient)."""
    layout = reducer_layout()
    flat = torch.zeros(layout.total, dtype=torch.float64)
    for j, n in enumerate(NUMELS):
        if j != skip:
            total = sum(grad(r, j, b).double() for r in range(WORLD) for b in backwards)
            flat[layout.offsets[j] : layout.offsets[j] + n] = total / WORLD
    return shard_of(layout, flat, shard_rank).float()


def test_the_groups_are_pairs_replicated_twice(ranks):
    assert [(r["rank"], r["shard_rank"], r["replicas"]) for r in ranks] == [(0, 0, 2), (1, 1, 2), (2, 0, 2), (3, 1, 2)]


@pytest.mark.parametrize("path", PATHS)
def test_accumulated_shard_is_the_world_mean(ranks, path):
    for r in ranks:
        expected = _mean_shard(r["shard_rank"], list(range(ROUNDS)))
        torch.testing.assert_close(r[path]["accumulated"], expected, msg=lambda m: f"rank {r['rank']}: {m}")


@pytest.mark.parametrize("path", PATHS)
def test_after_clear_only_the_new_gradients_and_zeros_where_none_came(ranks, path):
    for r in ranks:
        expected = _mean_shard(r["shard_rank"], [ROUNDS], skip=SKIPPED)
        torch.testing.assert_close(r[path]["after_clear"], expected, msg=lambda m: f"rank {r['rank']}: {m}")


def test_replicas_hold_identical_shards_and_the_sink_agrees_with_the_device_shard(ranks):
    for r in ranks:
        replica = ranks[(r["rank"] + 2) % WORLD]
        for key in ("accumulated", "after_clear"):
            assert torch.equal(r["device"][key], replica["device"][key]), (r["rank"], key)
            assert torch.equal(r["sink"][key], r["device"][key]), (r["rank"], key)
        assert r["device"]["device_shard"] and not r["sink"]["device_shard"]  # a sink keeps no device shard


@pytest.mark.parametrize("path", PATHS)
def test_each_backward_reduce_scatters_in_the_pair_and_all_reduces_the_chunks_once(ranks, path):
    layout = reducer_layout()
    for r in ranks:
        scopes = r[path]["traffic"]
        assert scopes["shard"] == {"reduce_scatter": ROUNDS * layout.total}, (r["rank"], scopes)
        assert scopes["replicate"] == {"all_reduce": ROUNDS * layout.shard_size}, (r["rank"], scopes)


def test_each_set_of_shard_groups_counts_its_own_traffic_over_process_groups_made_once(ranks):
    """Two ``ShardGroups`` of one size share the job's process groups (made once) but not their counters: the
    second counted nothing while the first reduced (see [Note: counted groups] in comm/traffic.py)."""
    for r in ranks:
        assert r["other"] == {"traffic": {}, "same_process_groups": True}, r["other"]


def test_sharded_params_gather_the_whole_values_over_the_shard_group(ranks):
    layout = params_layout()
    full = flat_values(layout)
    for r in ranks:
        assert sorted(r["params"]) == list(range(len(UNITS)))
        for j, value in r["params"].items():
            assert torch.equal(value, full[layout.offsets[j] : layout.offsets[j] + NUMELS[j]]), (r["rank"], j)
