"""Unit tests of stage 3's unit group (``stage3/unit.py``, :class:`UnitGroup`) and of one unit's buffer in one storage
(``stage3/buffer.py``, :class:`UnitBuffer`), in one process.

The storage is a stand-in that lends its buffer memory at an unshard and takes it back at a reshard, as
:class:`~lightning_zero.stage3.partitioned.PartitionedStorage` does, with no collective: what is tested is the group's
and the buffer's own bookkeeping (memory from the pool, the guard, gradient counting, gathers in flight).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_zero.stage3 import guard
from lightning_zero.stage3.buffer import UnitBuffer
from lightning_zero.stage3.guard import ParameterNotGatheredError
from lightning_zero.stage3.pool import BlockPool
from lightning_zero.stage3.unit import UnitGroup, UnitState
from tests.fake_work import LoggedWork

SHAPES = [(3, 4), (5,)]


class _Storage:
    """A storage with one unit's buffer: an unshard lends it memory (one work handle), a reshard takes it back."""

    def __init__(self, unit: int, pool: BlockPool) -> None:
        self.unit = unit
        self.log: list[str] = []
        self.params = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
        numel = sum(p.numel() for p in self.params)
        self.buffer = UnitBuffer(unit, torch.empty(numel + 1), self.params, pool)  # one element of padding
        self.buffer.attach_views([0, SHAPES[0][0] * SHAPES[0][1]])
        self.buffer.take_back()

    def unit_buffer(self, unit: int) -> UnitBuffer | None:
        return self.buffer if unit == self.unit else None

    def unshard_unit(self, unit: int) -> list[LoggedWork]:
        self.log.append(f"gather {unit}")
        self.buffer.lend()
        return [LoggedWork(self.log)]

    def reshard_unit(self, unit: int) -> None:
        self.log.append(f"release {unit}")
        self.buffer.take_back()


def _values(params: list[Tensor]) -> float:
    with torch.no_grad():
        return float(sum(p.sum() for p in params))


def test_a_unit_buffer_borrows_one_block_from_the_pool_and_gives_it_back():
    pool = BlockPool(torch.device("cpu"))
    params = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    buffer = UnitBuffer(1, torch.empty(18), params, pool)
    assert buffer.numel == 18 and buffer.held_bytes == 0
    assert buffer.attach_views([0, 12]) == 18 * 4 and buffer.held_bytes == 18 * 4
    assert params[1].data_ptr() == buffer.tensor.data_ptr() + 12 * 4  # a view at its offset
    assert not any(guard.is_released(p) for p in params)
    assert buffer.take_back() == 18 * 4 and buffer.held_bytes == 0
    assert all(guard.is_released(p) for p in params)
    with pytest.raises(ParameterNotGatheredError):
        _values(params)
    for _ in range(3):  # gathered and released again: the same block each time, nothing new allocated
        assert buffer.lend() == 18 * 4 and buffer.lend() == 0  # a second lend while held lends nothing
        buffer.tensor.fill_(1.0)
        assert _values(params) == 17.0  # the parameters read the block the buffer holds now
        buffer.take_back()
    assert pool.blocks == 1
    buffer.guard(False)
    assert not any(guard.is_released(p) for p in params)
    buffer.guard(True)
    assert all(guard.is_released(p) for p in params)


def test_a_group_counts_its_buffers_and_guards_them_while_a_gather_is_in_flight():
    pool = BlockPool(torch.device("cpu"))
    storages = [_Storage(2, pool), _Storage(2, pool), _Storage(3, pool)]  # the last holds no parameter of unit 2
    group = UnitGroup(2, "blocks.1", storages)
    assert group.buffers == [storages[0].buffer, storages[1].buffer]
    assert group.numel == 2 * 18 and group.gathered_bytes == 0
    group.unshard(guarded=True)
    assert group.gathered_bytes == 2 * 18 * 4
    assert all(guard.is_released(p) for s in storages[:2] for p in s.params)  # held, not yet readable
    group.wait_for_unshard()
    assert not any(guard.is_released(p) for s in storages[:2] for p in s.params)
    group.reshard()
    assert group.state is UnitState.SHARDED and group.gathered_bytes == 0


def test_reshard_waits_for_a_gather_in_flight_first_and_does_nothing_when_sharded():
    storage = _Storage(1, BlockPool(torch.device("cpu")))
    group = UnitGroup(1, "blocks.0", [storage])
    group.reshard()
    assert storage.log == []
    assert group.unshard() and group.state is UnitState.GATHERING
    assert not group.unshard()  # already in flight: no second gather
    group.reshard()
    assert group.state is UnitState.SHARDED and storage.log == ["gather 1", "wait", "release 1"]


def test_the_last_gradient_of_a_backward_frees_the_group_and_the_count_starts_again():
    group = UnitGroup(1, "blocks.0", [])
    for _ in range(3):
        group.expect_grad()
    assert [group.grad_arrived() for _ in range(3)] == [False, False, True]
    assert [group.grad_arrived() for _ in range(3)] == [False, False, True]
    group.grad_arrived()
    group.reset_grads()  # a backward that ended early: the next one counts from zero
    assert [group.grad_arrived() for _ in range(3)] == [False, False, True]
