"""Stage 3: one unit's flat buffer in one storage, the memory it borrows from the pool while gathered, the
parameters that view it (see [Note: stage 3 storage] in ``params.py``) and its hpZ copy.

A ``UnitBuffer`` is the per-storage piece of a unit group (see [Note: one object per unit group] in ``unit.py``):
the group holds one per storage that has parameters of the unit, and the storage's ``ShardedParams`` fills it
(gathers, uploads) from its working shard, as its ``SecondaryShards`` fills and
reads the hpZ copy.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from lightning_zero.stage3 import guard
from lightning_zero.stage3.pool import BlockPool


class UnitBuffer:
    """One unit's buffer in one storage: memory from ``pool`` while gathered, none otherwise; ``params`` view it."""

    def __init__(self, unit: int, tensor: Tensor, params: list[Tensor], pool: BlockPool) -> None:
        self.unit = unit
        self.tensor = tensor
        """The flat buffer in the working dtype; its storage holds zero bytes while the unit is released."""
        self.params = params
        """The parameters viewing ``tensor`` (released with it: see [Note: a released parameter raises, it never
        crashes] in ``guard.py``)."""
        self.pool = pool
        self.secondary: Optional[Tensor] = None
        """hpZ: this rank's secondary pieces of the unit, made at the first keep and reused by every later one (see
        [Note: hpZ, the secondary partition] in ``secondary.py``); ``None`` without hpZ or before the first keep."""
        self.secondary_current = False
        """Whether ``secondary`` holds the unit's current values (a backward may gather from it)."""
        self.tensor.untyped_storage().resize_(0)

    @property
    def numel(self) -> int:
        """Elements of the buffer (the unit's buckets in this storage, padding included)."""
        return self.tensor.numel()

    @property
    def held_bytes(self) -> int:
        """Bytes the buffer holds now (its full size while gathered, 0 while released)."""
        return self.tensor.untyped_storage().nbytes()

    def attach_views(self, offsets: list[int]) -> int:
        """Make the parameters views of the buffer, each at its element offset in it; returns the bytes lent to the
        buffer to do so (as ``lend``)."""
        lent = self.lend()  # views can only be made of a tensor that has its storage
        for p, offset in zip(self.params, offsets):
            p.data = self.tensor[offset : offset + p.numel()].view(p.shape)
        return lent

    def lend(self) -> int:
        """Give the buffer its memory from the pool if it has none, and make the parameters readable; returns the
        bytes lent (0 if it already held them)."""
        if self.held_bytes != 0:
            return 0
        self.pool.lend(self.tensor)
        guard.restore(self.params)
        return self.numel * self.tensor.element_size()

    def take_back(self) -> int:
        """Give the buffer's memory back to the pool and make the parameters refuse reads; returns the bytes given
        back."""
        held = self.held_bytes
        self.pool.take_back(self.tensor)
        guard.release(self.params)
        return held

    def guard(self, released: bool) -> None:
        """Make the parameters refuse reads (``released``) or plain again, whatever the buffer holds (a gather in
        flight between steps: see [Note: the root is gathered ahead of the next step] in ``units.py``)."""
        guard.release(self.params) if released else guard.restore(self.params)
