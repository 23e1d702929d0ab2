"""hpZ (ZeRO++'s hierarchical partitioning): a secondary copy of each gathered unit, sharded inside a small group.

[Note: hpZ, the secondary partition]
With ``secondary_shard_group_size=s`` the N ranks also form N/s *secondary groups* of s consecutive ranks (a node's
devices). The model states stay sharded over all N ranks (the primary partition: reduce-scatter, optimizer step,
the forward all-gather and checkpoints are unchanged). After a unit's forward, before its buffer is freed, each rank
copies its secondary piece of the gathered buffer: of every bucket of the unit (b elements, a multiple of N and so
of s), the ``b/s`` elements at its position in the secondary group. Backward's re-gather of the unit is then an
all-gather of those pieces inside the secondary group, into the same buffer, instead of an all-gather of the primary
shards over the world. The values are the very elements the forward gathered, so the result is bit-for-bit the one
without hpZ (fp32 parity with DDP holds).

Lifetime: a unit's secondary piece is taken at each forward that frees the unit (a training forward: grad enabled
or the module in training mode, which covers a reentrant checkpoint's ``no_grad`` forward) and dropped when the
unit's values change or the step ends: at the end of backward, at the optimizer step's refresh, and at the end of an
evaluation step, so a re-gather never reads a stale copy. Only backward (and a recomputation inside it) gathers from
it. Memory: Ψ/s working-dtype elements per rank (every non-root unit), on top of the primary shard Ψ/N: each unit's
copy is allocated at its first keep and kept, dropping a copy only marks it stale, so a step allocates nothing here
after the first (the peak is unchanged: at the end of forward every copy is held either way).

Traffic per micro-batch and rank, with U the padded size of the non-root units: the forward all-gather U (plus the
root) counts under the world's scope as before, backward's all-gather U under ``"secondary"`` (the paper's
formula: the backward all-gather moves from the N ranks to the s in-node ranks; on a ring (s-1)/s of the payload
per rank instead of (N-1)/N, over the node's links only). Reduce-scatter is unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives
from lightning_zero.comm.groups import ShardGroups
from lightning_zero.memory import costs
from lightning_zero.shards.layout import FlatLayout
from lightning_zero.stage3.buffer import UnitBuffer


class SecondaryShards:
    """The secondary pieces of one storage's units (see [Note: hpZ, the secondary partition]); each unit's copy lives
    on its ``UnitBuffer`` (``units``), this object makes and reads them."""

    def __init__(self, layout: FlatLayout, groups: ShardGroups, units: dict[int, UnitBuffer]) -> None:
        assert groups.secondary is not None
        self.layout = layout
        self.group = groups.secondary
        self.size = collectives.world_size(self.group)
        self.position = collectives.rank(self.group)
        self.units = units
        """The storage's unit buffers, which hold the copies (current or stale)."""

    def _ranges(self, unit: int) -> list[tuple[int, int]]:
        """Each bucket of ``unit`` as (start in the unit's buffer, elements of one secondary piece)."""
        start, _ = self.layout.unit_range(unit)
        ranges = []
        for bucket in self.layout.unit_buckets(unit):
            b0, b1 = self.layout.bucket_range(bucket)
            assert (b1 - b0) % self.size == 0, "a bucket is a multiple of N, and s divides N"
            ranges.append((b0 - start, (b1 - b0) // self.size))
        return ranges

    def keep(self, unit: int, buffer: Tensor) -> None:
        """Copy this rank's secondary pieces of ``unit`` out of its gathered ``buffer``."""
        ranges = self._ranges(unit)
        owner = self.units[unit]
        if owner.secondary is None:
            owner.secondary = costs.empty(sum(n for _, n in ranges), buffer.dtype, buffer.device)
        kept, at = owner.secondary, 0
        with torch.no_grad():
            for b0, n in ranges:
                kept[at : at + n].copy_(buffer[b0 + self.position * n : b0 + (self.position + 1) * n])
                at += n
        costs.count_copy(kept)
        owner.secondary_current = True

    def has(self, unit: int) -> bool:
        """Whether ``unit`` has a secondary copy to gather from."""
        owner = self.units.get(unit)
        return owner is not None and owner.secondary_current

    def gather(self, unit: int, buffer: Tensor, verified: bool = False) -> list[Any]:
        """All-gather ``unit`` inside the secondary group into ``buffer`` (which holds memory); the work handles.
        ``verified``: as for the primary gathers (``ShardedParams.gather`` in ``params.py``)."""
        kept, works, at = self.units[unit].secondary, [], 0
        assert kept is not None and self.has(unit), "gathered only from a current copy"
        for b0, n in self._ranges(unit):
            works.append(
                collectives.all_gather(
                    buffer[b0 : b0 + n * self.size],
                    kept[at : at + n],
                    group=self.group,
                    async_op=True,
                    verified=verified,
                )
            )
            at += n
        return works

    def drop(self, unit: int) -> None:
        """Forget ``unit``'s copy (its values are about to change, or the forward did not free it)."""
        owner = self.units.get(unit)
        if owner is not None:
            owner.secondary_current = False

    def drop_all(self) -> None:
        """Forget every copy (the end of backward, a step, an evaluation step)."""
        for owner in self.units.values():
            owner.secondary_current = False

    @property
    def held_bytes(self) -> int:
        """Bytes held for secondary pieces, current or stale."""
        return sum(_bytes(b.secondary) for b in self.units.values())


def _bytes(tensor: Optional[Tensor]) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
