"""Stages 1 and 2: every rank keeps the full working parameters in one flat buffer (see [Note: two storages, one
step] in ``optimizer.py``).

[Note: working parameters are views of one flat buffer]
The managed parameters become views of one flat buffer in the working dtype (16-bit under mixed precision), in the
order of :mod:`lightning_zero.core.layout`. The ``nn.Parameter`` objects stay the same, so the module, tied weights
and user references keep working. After the step, each rank writes its updated chunk into the buffer and one
all-gather per bucket refreshes everybody's copy in place. When the master dtype equals the working dtype
(``32-true``, ``bf16-true``) and the optimizer is not offloaded, the master shard *is* this rank's chunk of the
buffer: no second copy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.config import ZeroConfig
from lightning_zero.core import collectives, offload
from lightning_zero.core.layout import MasterSlot
from lightning_zero.core.optimizer import ShardedOptimizer


class FlatShardedOptimizer(ShardedOptimizer):
    """Stages 1 and 2: a full flat working buffer, the master shard, an all-gather after each step."""

    def _make_storage(self, working_dtype: torch.dtype, master_dtype: torch.dtype, offload_optimizer: bool,
                      config: ZeroConfig) -> None:
        self.flat = torch.zeros(self.layout.total, dtype=working_dtype, device=self.device)
        """The full working parameters; every managed parameter is a view of it."""
        aliased = working_dtype == master_dtype and not offload_optimizer
        if not aliased:
            self.master_storage = offload.allocate_master(self.layout.shard_size, master_dtype, self.device,
                                                          offload_optimizer)
        self._fill_from_params()

    def _fill_from_params(self) -> None:
        """Copy the parameters into the flat buffer and the master shard, then make them views of the buffer."""
        if self.master_storage is not None:
            self._copy_pieces(self.layout.buckets, self.master_storage)
        with torch.no_grad():
            for p, offset in zip(self.params, self.layout.offsets):
                view = self.flat[offset : offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)

    def _master_view(self, slot: MasterSlot) -> Tensor:
        if self.master_storage is not None:
            return self.master_storage[slot.start : slot.start + slot.length].view(slot.shape)
        start = self._flat_offset(slot.start)
        return self.flat[start : start + slot.length].view(slot.shape)

    def _flat_offset(self, shard_offset: int) -> int:
        """Where a position of this rank's shard lies in the flat buffer."""
        for bucket in self.layout.buckets:
            if bucket.shard_offset <= shard_offset < bucket.shard_offset + bucket.chunk_size:
                return self.layout.chunk_range(bucket, self.rank)[0] + shard_offset - bucket.shard_offset
        raise IndexError(shard_offset)

    def refresh_working(self) -> None:
        """Each rank writes its updated chunk into the buffer; one all-gather per bucket refreshes everybody's copy."""
        works = []
        with torch.no_grad():
            for bucket in self.layout.buckets:
                c0, c1 = self.layout.chunk_range(bucket, self.rank)
                if self.master_storage is not None:  # an upload under offload_optimizer: see offload.py
                    end = bucket.shard_offset + bucket.chunk_size
                    offload.copy_to_device(self.flat[c0:c1], self.master_storage[bucket.shard_offset : end])
                b0, b1 = self.layout.bucket_range(bucket)
                works.append(collectives.all_gather(self.flat[b0:b1], self.flat[c0:c1], group=self.group,
                                                    async_op=True))
            for work in works:
                collectives.wait(work, "all-gather the updated parameters")

    def gather_full_master(self) -> Tensor:
        return self.flat if self.master_storage is None else super().gather_full_master()

    def _hand_back(self, gather: bool) -> None:
        if gather:  # the fp32 values (the flat buffer itself where it is the master)
            self._full_values_back()
