"""Parameters held by several optimizers: one storage owns each parameter, the others borrow its master pieces.

[Note: parameters shared by several optimizers]
Under ``ddp`` two optimizers over the same parameter update the same tensor from the same ``.grad``, each with its
own state (momentum, ``exp_avg``); ``zero_grad`` of either clears that ``.grad``. ZeRO keeps exactly that:

- The parameter has one *owner*: the storage of the first optimizer (in ``configure_optimizers`` order) that holds
  it (see [Note: the store and the optimizers] in ``store.py``). The owner alone lays it out, holds its working
  storage (flat buffer, stage 3 unit buffers), its master weight and its gradient reduction, so a backward reduces
  each gradient once, whatever the number of optimizers.
- Every later optimizer that holds it *borrows* it: it steps on views of the owner's master pieces on
  this rank (``borrowed_slots``), with its own optimizer state for them, and takes their gradients from the
  owner's gradient shard. Whichever optimizer steps, it updates the one master weight, and the owner's working
  parameters are refreshed from it afterwards: the next step of any optimizer starts from the value the last one
  left, as under ``ddp``.
- The reduced gradient stays in the owner's shard until the ``zero_grad`` of any optimizer holding the parameter
  (which clears just that optimizer's parameters there); a step does not consume it. Two optimizers can therefore
  step on one backward, and gradients accumulate across steps without ``zero_grad``, as under ``ddp``.
- A borrowed master is a view of the owner's shard, so the optimizers sharing parameters must agree on how it is
  cut: if any of them needs whole tensors (Adafactor, an unknown class), all of them get whole tensors
  (``whole_params_per_optimizer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, Sequence, TypeVar

from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.shards.layout import FlatLayout, MasterSlot
from lightning_zero.shards.optimizer_support import check_optimizer, is_elementwise
from lightning_zero.shards.policy import OptimizerPolicy


class Lender(Protocol):
    """What borrowing reads of a storage that owns parameters (a
    ``ShardedStorage``)."""

    params: list[Tensor]
    layout: FlatLayout

    def own_masters(self) -> list[tuple[MasterSlot, Tensor]]:
        """The slots in the storage's own shard with their master tensors."""


L = TypeVar("L", bound=Lender)


def whole_params_per_optimizer(optimizers: Sequence[Optimizer], policy: OptimizerPolicy) -> list[bool]:
    """Check every optimizer; return, per optimizer, whether ZeRO gives it whole tensors rather than flat slices.

    Optimizers linked by a shared trainable parameter (directly or through others) get whole tensors together when
    any of them needs them (see [Note: parameters shared by several optimizers]).
    """
    for optimizer in optimizers:
        check_optimizer(optimizer)
    parent = list(range(len(optimizers)))

    def root(k: int) -> int:
        while parent[k] != k:
            k = parent[k]
        return k

    first_holder: dict[int, int] = {}
    for k, optimizer in enumerate(optimizers):
        for p in (p for group in optimizer.param_groups for p in group["params"] if p.requires_grad):
            parent[root(k)] = root(first_holder.setdefault(id(p), k))
    whole = [not is_elementwise(optimizer, policy) for optimizer in optimizers]
    needs_whole = {root(k) for k, w in enumerate(whole) if w}
    return [root(k) in needs_whole for k in range(len(optimizers))]


@dataclass
class Members(Generic[L]):
    """How an optimizer's trainable parameters split between those of its own storage and borrowed ones."""

    managed: list[int]
    """Canonical index (in the optimizer's param groups) of each member: the owned ones first, then the borrowed."""
    owned: int
    """How many members its own storage holds."""
    owners: list[L]
    """The storages it borrows from, in order of first use (the same on every rank)."""
    borrowed: dict[int, list[int]]
    """``id(owner)`` to the indices in ``owner.params`` of the parameters borrowed from it."""


def split_members(canonical: Sequence[Tensor], owners: Sequence[L]) -> Members[L]:
    """Split the trainable parameters of ``canonical`` into those no storage in ``owners`` holds yet and the rest."""
    owned_by = {id(p): (owner, j) for owner in owners for j, p in enumerate(owner.params)}
    trainable = [i for i, p in enumerate(canonical) if p.requires_grad]
    own = [i for i in trainable if id(canonical[i]) not in owned_by]
    taken = [owned_by[id(canonical[i])] for i in trainable if id(canonical[i]) in owned_by]
    lenders = list({id(owner): owner for owner, _ in taken}.values())
    borrowed = {id(owner): [j for o, j in taken if o is owner] for owner in lenders}
    return Members(own + [i for i in trainable if id(canonical[i]) in owned_by], len(own), lenders, borrowed)


def borrowed_slots(
    members: Sequence[Tensor], first_borrowed: int, group_of: dict[int, int], owners: Sequence[L]
) -> list[tuple[L, MasterSlot]]:
    """The master tensors a borrowing optimizer steps on for ``members[first_borrowed:]``, with the storage owning each.

    Each is a ``MasterSlot`` whose ``start`` is an offset in the *owner's* shard and whose pieces index
    ``members``. Flat pieces that lie side by side in the owner's slot and fall in the same param group of the
    borrower are merged into one tensor; a whole-parameter slot is borrowed whole, in the parameter's shape.
    """
    member_of = {id(p): m for m, p in enumerate(members) if m >= first_borrowed}
    out: list[tuple[L, MasterSlot]] = []
    for owner in owners:
        for slot, _ in owner.own_masters():
            runs: list[list[tuple[int, int, int, int]]] = []  # (member, param start, length, offset in the slot)
            for p, p_start, length, offset in sorted(slot.pieces, key=lambda piece: piece[3]):
                m = member_of.get(id(owner.params[p]))
                if m is None:
                    runs.append([])
                    continue
                last = runs[-1][-1] if runs and runs[-1] else None
                if (
                    last is None
                    or last[3] + last[2] != offset
                    or group_of[id(members[last[0]])] != group_of[id(members[m])]
                ):
                    runs.append([])
                runs[-1].append((m, p_start, length, offset))
            out.extend(
                (owner, _slot_of(run, slot, group_of[id(members[run[0][0]])], owner.layout.whole_params))
                for run in runs
                if run
            )
    return out


def _slot_of(run: list[tuple[int, int, int, int]], slot: MasterSlot, group: int, whole: bool) -> MasterSlot:
    """A run of adjacent pieces of the owner's ``slot`` as one master tensor (a whole parameter keeps its shape)."""

    if whole:
        return MasterSlot(group, slot.start, slot.length, slot.shape, tuple(run))
    first = run[0][3]
    length = sum(piece[2] for piece in run)
    pieces = tuple((m, p_start, n, offset - first) for m, p_start, n, offset in run)
    return MasterSlot(group, slot.start + first, length, (length,), pieces)
