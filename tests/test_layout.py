"""Unit tests of the pure layout arithmetic."""

import random

import pytest

from lightning_zero.shards.layout import plan_layout


def _owned_elements(layout):
    """(param, element) -> owning rank, from the per-rank pieces."""
    owner = {}
    for bucket in layout.buckets:
        for rank in range(layout.world_size):
            for pc in layout.pieces(bucket, rank):
                assert 0 <= pc.chunk_offset and pc.chunk_offset + pc.length <= bucket.chunk_size
                for e in range(pc.param_start, pc.param_start + pc.length):
                    assert (pc.param, e) not in owner, "an element is owned twice"
                    owner[(pc.param, e)] = rank
    return owner


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_size", [1, 7, 64, 10_000])
def test_every_element_owned_exactly_once(whole, world_size, bucket_size):
    rng = random.Random(world_size * 1000 + bucket_size)
    numels = [rng.choice([1, 3, 17, 40, 129]) for _ in range(23)]
    groups = [0 if i % 3 else 1 for i in range(23)]
    layout = plan_layout(numels, groups, world_size, bucket_size, whole_params=whole)
    owner = _owned_elements(layout)
    assert len(owner) == sum(numels)
    # parameters are contiguous, disjoint ranges of the flat buffer
    spans = sorted((layout.offsets[i], layout.offsets[i] + n) for i, n in enumerate(numels))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= layout.total
    # a bucket never spans two groups, and a group's shard is contiguous
    for bucket in layout.buckets:
        assert {groups[p] for p in bucket.params} == {bucket.group}
    assert layout.shard_size * world_size == layout.total
    if whole:  # never split a tensor across ranks
        assert all(len({owner[(p, e)] for e in range(n)}) == 1 for p, n in enumerate(numels))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_flat_padding_is_below_world_size_per_bucket(world_size):
    numels = [1000, 333, 77, 5]
    layout = plan_layout(numels, [0] * 4, world_size, bucket_size=256)
    assert layout.total - sum(numels) <= (world_size - 1) * len(layout.buckets)
    assert layout.max_bucket_elements <= 256 + world_size
    assert len(layout.buckets) == -(-sum(numels) // (256 - 256 % world_size))


def test_reverse_order_and_bucket_boundaries():
    layout = plan_layout([6, 4, 10, 3], [0, 0, 0, 1], world_size=3, bucket_size=9)
    # parameter 3 (group 1) is the first whose gradient backward produces: its bucket is launched first; group 0
    # follows in reverse registration order, parameter 2 (10 elements) spanning its first two buckets
    assert layout.offsets == (17, 13, 3, 0)
    assert [(b.start, b.chunk_size, b.group) for b in layout.buckets] == [(0, 1, 1), (3, 3, 0), (12, 3, 0), (21, 1, 0)]
    assert 2 in layout.buckets[1].params and 2 in layout.buckets[2].params


def test_interleaved_groups_complete_in_launch_order():
    # weight/bias pairs in alternating groups (decay / no-decay): the bias bucket holds every layer's bias, so it
    # completes with the first layer's bias, just before that layer's weight; weight buckets in backward order
    numels = [64, 4] * 4
    groups = [0, 1] * 4
    layout = plan_layout(numels, groups, world_size=2, bucket_size=64)
    assert [b.params for b in layout.buckets] == [(6,), (4,), (2,), (7, 5, 3, 1), (0,)]


def test_whole_params_balance_load():
    layout = plan_layout([100, 60, 50, 40, 10], [0] * 5, world_size=2, bucket_size=10_000, whole_params=True)
    (bucket,) = layout.buckets
    loads = [sum(pc.length for pc in layout.pieces(bucket, r)) for r in range(2)]
    assert sorted(loads) == [120, 140]
    assert bucket.chunk_size == 140


def test_bad_arguments():
    with pytest.raises(ValueError, match="same length"):
        plan_layout([1, 2], [0], 2, 10)
    with pytest.raises(ValueError, match="positive"):
        plan_layout([1], [0], 0, 10)


def test_units_are_contiguous_and_never_share_a_bucket():
    numels = [50, 7, 50, 7, 50, 7, 30]
    groups = [0, 1, 0, 1, 0, 1, 0]
    units = [1, 1, 2, 2, 3, 3, 0]
    layout = plan_layout(numels, groups, world_size=3, bucket_size=40, units=units)
    _owned_elements(layout)
    seen = []
    for bucket in layout.buckets:
        assert {units[p] for p in bucket.params} == {bucket.unit}
        if not seen or seen[-1] != bucket.unit:
            assert bucket.unit not in seen, "a unit's buckets must be adjacent"
            seen.append(bucket.unit)
    for unit in set(units):
        start, end = layout.unit_range(unit)
        assert all(start <= layout.offsets[i] and layout.offsets[i] + numels[i] <= end
                   for i in range(len(numels)) if units[i] == unit)
    assert seen[0] == 0 and seen[1:] == [3, 2, 1]  # backward order: the last registered unit first


def test_a_rank_plans_its_own_pieces_not_every_ranks():
    """At N = 4096 a rank's pieces are O(buckets) objects: planning every rank's would make millions (the layout
    of a large world is sized for the model, not the world)."""
    import sys

    layout = plan_layout([100_000] * 50, [0] * 50, world_size=4096, bucket_size=8192 * 4096 // 100)
    assert len(layout.buckets) >= 10
    before = sys.getallocatedblocks()
    mine = [layout.pieces(bucket, 7) for bucket in layout.buckets]
    assert sys.getallocatedblocks() - before < 50 * len(layout.buckets)
    assert sum(pc.length for pieces in mine for pc in pieces) <= layout.shard_size
