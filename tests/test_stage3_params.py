"""Unit tests of stage 3's parameter storage (``stage3/params.py``, :class:`ShardedParams`) in one process.

A world of one rank: the working shard is the whole flat buffer and the all-gather a copy, so what is tested is the
storage's own bookkeeping (which buffer holds memory when, which parameters view it, the guard, the counters, the
upload of an offloaded shard). The all-gather across ranks is tested in ``test_reducer_groups.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives
from lightning_zero.shards.layout import FlatLayout, plan_layout
from lightning_zero.stage3 import guard
from lightning_zero.stage3.params import ShardedParams
from tests.compare import shard_of

SHAPES = [(3, 4), (5,), (2, 3), (7,), (4, 2)]
UNITS = [0, 0, 2, 2, 3]  # unit 1 has no parameter of this optimizer


def _flat_values(layout: FlatLayout, seed: int) -> Tensor:
    """Distinct values for every position of the flat buffer."""
    return torch.randn(layout.total, generator=torch.Generator().manual_seed(seed))


def _expected(layout: FlatLayout, flat: Tensor, j: int) -> Tensor:
    """Parameter ``j``'s values in the flat buffer ``flat``."""
    return flat[layout.offsets[j] : layout.offsets[j] + layout.numels[j]].view(SHAPES[j])


def _storage(offloaded: bool = False) -> tuple[ShardedParams, FlatLayout, Tensor]:
    """A :class:`ShardedParams` over :data:`SHAPES` in :data:`UNITS` (buckets of 8 elements), and its flat values."""
    numels = [torch.Size(s).numel() for s in SHAPES]
    layout = plan_layout(numels, [0] * len(numels), 1, 8, units=UNITS)
    params = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    flat = _flat_values(layout, 0)
    return ShardedParams(layout, params, 0, shard_of(layout, flat, 0), offloaded=offloaded), layout, flat


def _gather(storage: ShardedParams, unit: int) -> None:
    """Gather ``unit`` and wait for it."""
    for work in storage.unshard(unit):
        collectives.wait(work, f"gather unit {unit}")


def _unit_params(unit: int) -> list[int]:
    """Indices of the parameters of ``unit``."""
    return [j for j, u in enumerate(UNITS) if u == unit]


def test_buffers_hold_no_memory_until_gathered():
    storage, layout, _ = _storage()
    assert sorted(storage.buffers) == [0, 2, 3] and storage.unit_numel(1) == 0
    assert all(b.untyped_storage().nbytes() == 0 for b in storage.buffers.values())
    assert storage.gathered_bytes == 0
    for unit in (0, 2, 3):
        start, end = layout.unit_range(unit)
        assert storage.unit_numel(unit) == end - start >= sum(layout.numels[j] for j in _unit_params(unit))


def test_gather_gives_each_parameter_its_values_in_its_units_buffer():
    storage, layout, flat = _storage()
    for unit in (0, 2, 3):
        storage.attach_views(unit)
        _gather(storage, unit)
        buffer = storage.buffers[unit]
        for j in _unit_params(unit):
            p = storage.params[j]
            assert p.shape == SHAPES[j] and torch.equal(p.detach(), _expected(layout, flat, j)), j
            assert p.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view, no copy
    assert storage.gathered_bytes == 4 * sum(storage.unit_numel(u) for u in (0, 2, 3))
    assert storage.unshard(1) == [] and storage.gathered_bytes == 4 * sum(storage.unit_numel(u) for u in (0, 2, 3))


def test_release_frees_the_memory_and_guards_the_parameters():
    storage, layout, flat = _storage()
    for unit in (0, 2):
        storage.attach_views(unit)
        _gather(storage, unit)
    storage.reshard(0)
    assert storage.gathered_bytes == 4 * storage.unit_numel(2)
    assert storage.buffers[0].untyped_storage().nbytes() == 0
    released = storage.params[_unit_params(0)[0]]
    assert guard.is_released(released) and released.shape == SHAPES[0]  # metadata stays readable
    with pytest.raises(guard.ParameterNotGatheredError):
        released.sum()
    assert not guard.is_released(storage.params[_unit_params(2)[0]])  # the other unit is untouched
    storage.reshard(0)  # releasing a released unit changes nothing
    storage.reshard(1)  # nor does a unit without parameters here
    assert storage.gathered_bytes == 4 * storage.unit_numel(2)


def test_a_second_gather_reads_the_shard_as_it_is_now():
    storage, layout, _ = _storage()
    storage.attach_views(2)
    _gather(storage, 2)
    storage.reshard(2)
    updated = _flat_values(layout, 1)  # an optimizer step wrote the shard in place
    storage.working_shard.copy_(shard_of(layout, updated, 0))
    _gather(storage, 2)
    for j in _unit_params(2):
        assert not guard.is_released(storage.params[j])
        assert torch.equal(storage.params[j].detach(), _expected(layout, updated, j)), j
    assert storage.gathered_bytes == 4 * storage.unit_numel(2)


def test_an_offloaded_shard_is_uploaded_at_each_gather():
    storage, layout, flat = _storage(offloaded=True)
    assert storage.offloaded and not storage.asynchronous  # CPU: the uploads are plain copies
    unit_bytes = 4 * sum(b.chunk_size for b in layout.unit_buckets(3))  # this rank's chunks of the unit
    storage.attach_views(3)  # once, at setup: the views outlive each release
    for gathers in (1, 2):
        _gather(storage, 3)
        storage.settle()
        assert storage.uploaded_bytes == gathers * unit_bytes
        j = _unit_params(3)[0]
        assert torch.equal(storage.params[j].detach(), _expected(layout, flat, j))
        assert storage.working_shard.data_ptr() != storage.buffers[3].data_ptr()
        storage.reshard(3)
    assert storage.gathered_bytes == 0
