"""Stages 1 and 2: every rank keeps the full working parameters in one flat buffer (see [Note: two storages, one
step] in ``store.py``).

[Note: working parameters are views of one flat buffer]
The managed parameters become views of one flat buffer in the working dtype (16-bit under mixed precision), in the
order of ``lightning_zero.shards.layout``. The ``nn.Parameter`` objects stay the same, so the module, tied weights
and user references keep working. After the step, each rank writes its updated chunk into the buffer and one
all-gather per bucket refreshes everybody's copy in place. When the master dtype equals the working dtype
(``32-true``, ``bf16-true``) and the optimizer is not offloaded, the master shard *is* this rank's chunk of the
buffer: no second copy.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives
from lightning_zero.shards import offload
from lightning_zero.shards.layout import Bucket, MasterSlot
from lightning_zero.shards.store import ShardedStorage


class FlatStorage(ShardedStorage):
    """Stages 1 and 2: a full flat working buffer, the master shard, an all-gather after each step."""

    def _make_storage(self, working_dtype: torch.dtype, master_dtype: torch.dtype) -> None:
        tiers = self.store_policy.offload
        self.flat = torch.zeros(self.layout.total, dtype=working_dtype, device=self.device)
        """The full working parameters; every managed parameter is a view of it."""
        self._refreshing: dict[int, Any] = {}  # bucket index -> its all-gather, started by a step in pieces
        aliased = working_dtype == master_dtype and not tiers.offload_optimizer
        if not aliased:
            self.master_storage = offload.allocate_master(
                self.layout.shard_size, master_dtype, self.device, tiers.offload_optimizer, tiers.offload_path
            )
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

    def master_view(self, slot: MasterSlot) -> Tensor:
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
        """Each rank writes its updated chunk into the buffer; one all-gather per bucket refreshes everybody's copy
        (those a step in pieces started already are only waited for)."""
        started, self._refreshing = self._refreshing, {}
        works = [started.get(b.index) or self._refresh_bucket(b) for b in self.layout.buckets]
        for work in works:
            collectives.wait(work, "all-gather the updated parameters")

    def _refresh_bucket(self, bucket: Bucket) -> Any:
        """Upload this rank's updated chunk of ``bucket`` (``offload_optimizer``) and start its all-gather."""
        c0, c1 = self.layout.chunk_range(bucket, self.rank)
        with torch.no_grad():
            if self.master_storage is not None:  # an upload under offload_optimizer: see offload.py
                end = bucket.shard_offset + bucket.chunk_size
                offload.copy_to_device(self.flat[c0:c1], self.master_storage[bucket.shard_offset : end])
            b0, b1 = self.layout.bucket_range(bucket)
            return collectives.all_gather(self.flat[b0:b1], self.flat[c0:c1], group=self.group, async_op=True)

    def refresh_as_stepped(self) -> Optional[Callable[[list[Tensor]], None]]:
        """[Note: the refresh follows the step piece by piece]
        When the step runs in pieces (see [Note: the step in constant-size pieces] in ``optimizer_support.py``),
        each piece's buckets are uploaded and all-gathered as soon as the piece is stepped, so the all-gathers run
        while the next pieces step (the host step of ``offload_optimizer`` included) instead of all after it.
        Pieces are runs of whole master tensors, one per bucket chunk, of the same sizes on every rank, so every rank
        starts the same all-gathers in the same order ([Note: lockstep] in ``buckets.py``); ``refresh_working``
        then waits for them and starts the rest in the layout's order. A piece's all-gather writes only its buckets'
        ranges of the flat buffer, which no later piece reads or writes. Only for an optimizer that lends and borrows
        nothing (its storage is its only source, checked by the optimizer): a borrowed tensor's bucket is its
        owner's, refreshed by the owner after the step."""
        if self.layout.whole_params:
            return None
        by_offset = {b.shard_offset: b for b in self.layout.buckets if b.chunk_size}
        bucket_of = {id(m): by_offset[s.start] for m, s in zip(self.masters, self.slots)}

        def start_refresh(stepped: list[Tensor]) -> None:
            for tensor in stepped:
                bucket = bucket_of.get(id(tensor))
                if bucket is not None and bucket.index not in self._refreshing:
                    self._refreshing[bucket.index] = self._refresh_bucket(bucket)

        return start_refresh

    def gather_full_master(self) -> Tensor:
        return self.flat if self.master_storage is None else super().gather_full_master()

    def _hand_back(self, gather: bool) -> None:
        if gather:  # the fp32 values (the flat buffer itself where it is the master)
            self._full_values_back()
