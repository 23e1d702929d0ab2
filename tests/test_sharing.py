"""Unit tests of parameters shared by several optimizers (``shards/sharing.py``): which members an optimizer owns and
borrows (:func:`split_members`), and the master tensors it borrows from their owners (:func:`borrowed_slots`).

The owners are stand-ins with only what the two functions read of a ``ShardedStorage``: its parameters, its layout
and its own master slots; what is expected is computed from the flat layout's definition (offsets, bucket starts and
chunk sizes), not from the slots the functions read.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
from torch import Tensor

from lightning_zero.shards.layout import FlatLayout, MasterSlot, plan_layout, plan_master_slots
from lightning_zero.shards.sharing import borrowed_slots, split_members


@dataclass
class Owner:
    """What :func:`split_members` and :func:`borrowed_slots` read of the storage owning ``params`` on ``rank``."""

    params: list[Tensor]
    layout: FlatLayout
    rank: int = 0

    def own_masters(self) -> list[tuple[MasterSlot, Optional[Tensor]]]:
        """The master slots of this rank's shard (their tensors are not read)."""
        return [(slot, None) for slot in plan_master_slots(self.layout, self.rank, [p.shape for p in self.params])]


def _owner(numels: list[int], world_size: int = 1, bucket_size: int = 100, rank: int = 0, whole: bool = False,
           groups: Optional[list[int]] = None) -> Owner:
    """An owner of fresh trainable parameters of ``numels`` elements."""
    params = [torch.zeros(n, requires_grad=True) for n in numels]
    layout = plan_layout(numels, groups or [0] * len(numels), world_size, bucket_size, whole_params=whole)
    return Owner(params, layout, rank)


def _elements_at(owner: Owner) -> dict[int, tuple[int, int]]:
    """Position in ``owner``'s shard -> ``(id(param), element)``, from the flat layout's definition alone."""
    layout, at = owner.layout, {}
    for bucket in layout.buckets:
        for k in range(bucket.chunk_size):
            flat = bucket.start + owner.rank * bucket.chunk_size + k
            for j, p in enumerate(owner.params):
                if layout.offsets[j] <= flat < layout.offsets[j] + p.numel():
                    at[bucket.shard_offset + k] = (id(p), flat - layout.offsets[j])
    return at


def _covered(slots: list[tuple[Any, MasterSlot]], members: list[Tensor]) -> dict[tuple[int, int], tuple[int, int]]:
    """``(id(owner), shard position)`` -> ``(id(param), element)`` as the borrowed slots' pieces say."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for owner, slot in slots:
        for m, p_start, length, offset in slot.pieces:
            for e in range(length):
                key = (id(owner), slot.start + offset + e)
                assert key not in out, f"shard position {key[1]} borrowed twice"
                out[key] = (id(members[m]), p_start + e)
    return out


def test_split_members_owns_what_no_engine_holds_and_borrows_the_rest():
    first, second = _owner([4, 3]), _owner([5])
    shared_a, shared_b, mine = first.params[1], second.params[0], torch.zeros(2, requires_grad=True)
    frozen = torch.zeros(6, requires_grad=False)
    canonical = [shared_b, frozen, mine, first.params[0], shared_a, torch.zeros(1, requires_grad=True)]
    members = split_members(canonical, [first, second])
    assert members.managed == [2, 5, 0, 3, 4]  # owned (canonical order), then borrowed; the frozen one in neither
    assert members.owned == 2
    assert members.owners == [second, first]  # in order of first use
    assert members.borrowed == {id(second): [0], id(first): [0, 1]}


def test_split_members_without_owners_owns_every_trainable_parameter():
    canonical = [torch.zeros(2, requires_grad=True), torch.zeros(2), torch.zeros(3, requires_grad=True)]
    members = split_members(canonical, [])
    assert (members.managed, members.owned, members.owners, members.borrowed) == ([0, 2], 2, [], {})


def test_adjacent_borrowed_pieces_of_one_group_are_one_tensor():
    # the owner's flat buffer (one bucket, world 1) holds c at 0..5, b at 5..8, a at 8..12 (reverse order)
    owner = _owner([4, 3, 5])
    a, b, c = owner.params
    own = torch.zeros(2, requires_grad=True)
    members = [own, c, b]
    slots = borrowed_slots(members, 1, {id(own): 0, id(c): 0, id(b): 0}, [owner])
    assert [slot for _, slot in slots] == [MasterSlot(0, 0, 8, (8,), ((1, 0, 5, 0), (2, 0, 3, 5)))]
    # the same pieces in two param groups of the borrower: two tensors, each in its group
    slots = borrowed_slots(members, 1, {id(own): 0, id(c): 0, id(b): 1}, [owner])
    assert [slot for _, slot in slots] == [MasterSlot(0, 0, 5, (5,), ((1, 0, 5, 0),)),
                                           MasterSlot(1, 5, 3, (3,), ((2, 0, 3, 0),))]
    # c and a are not adjacent (b, not borrowed, lies between): two tensors
    members = [own, a, c]
    slots = borrowed_slots(members, 1, {id(own): 0, id(a): 0, id(c): 0}, [owner])
    assert [(slot.start, slot.length, slot.pieces) for _, slot in slots] == [(0, 5, ((2, 0, 5, 0),)),
                                                                            (8, 4, ((1, 0, 4, 0),))]
    assert all(source is owner for source, _ in slots)


def test_a_whole_parameter_is_borrowed_whole_in_its_shape():
    owner = Owner([torch.zeros(2, 3, requires_grad=True), torch.zeros(4, requires_grad=True)],
                  plan_layout([6, 4], [0, 0], 1, 100, whole_params=True))
    matrix = owner.params[0]
    slots = borrowed_slots([matrix], 0, {id(matrix): 3}, [owner])
    assert [slot for _, slot in slots] == [MasterSlot(3, 4, 6, (2, 3), ((0, 0, 6, 0),))]


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_borrowed_slots_cover_exactly_this_ranks_elements_of_the_borrowed_parameters(world_size, whole):
    rng = random.Random(world_size * 10 + whole)
    rank = world_size - 1  # the last rank: its chunks start past the others'
    owners = [_owner([rng.choice([1, 4, 9, 17]) for _ in range(7)], world_size, 8, rank, whole,
                     [rng.choice([0, 1]) for _ in range(7)]) for _ in range(2)]
    borrowed = [p for owner in owners for p in owner.params if rng.random() < 0.6]
    own = [torch.zeros(3, requires_grad=True)]
    members = own + borrowed
    group_of = {id(p): rng.choice([0, 1, 2]) for p in members}
    slots = borrowed_slots(members, len(own), group_of, owners)
    wanted = {id(p) for p in borrowed}
    expected = {(id(owner), pos): at for owner in owners for pos, at in _elements_at(owner).items() if at[0] in wanted}
    assert _covered(slots, members) == expected
    for owner, slot in slots:
        groups = {group_of[id(members[m])] for m, *_ in slot.pieces}
        assert groups == {slot.group}, "a borrowed tensor spans two param groups of the borrower"
        assert slot.length == sum(piece[2] for piece in slot.pieces)
        if whole:
            assert len(slot.pieces) == 1 and slot.shape == tuple(members[slot.pieces[0][0]].shape)
        else:
            assert slot.shape == (slot.length,)
            assert [piece[3] for piece in slot.pieces] == [sum(p[2] for p in slot.pieces[:i])
                                                           for i in range(len(slot.pieces))]  # side by side
    _assert_runs_are_maximal(slots, group_of, members, whole)


def _assert_runs_are_maximal(slots: list[tuple[Any, MasterSlot]], group_of: dict[int, int], members: list[Tensor],
                             whole: bool) -> None:
    """Flat borrowed tensors that touch inside one bucket of one owner are in different param groups (else they
    would have been merged)."""
    if whole:
        return
    for (owner, slot), (next_owner, following) in zip(slots, slots[1:]):
        same_bucket = any(b.shard_offset <= slot.start and following.start + following.length
                          <= b.shard_offset + b.chunk_size for b in owner.layout.buckets)
        if owner is next_owner and same_bucket and slot.start + slot.length == following.start:
            assert slot.group != following.group, (slot, following)
