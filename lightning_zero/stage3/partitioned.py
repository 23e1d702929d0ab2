"""Stage 3: the parameters are partitioned too; each rank keeps a working shard and gathers units around their use
(see [Note: two storages, one step] in ``store.py`` and [Note: stage 3 storage] in ``params.py``)."""

from __future__ import annotations

import bisect
from typing import Any, ClassVar, Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives
from lightning_zero.memory.host_memory import give_back_free_heap
from lightning_zero.shards import offload
from lightning_zero.shards.layout import MasterSlot
from lightning_zero.shards.store import ShardedStorage
from lightning_zero.stage3 import guard
from lightning_zero.stage3.buffer import UnitBuffer
from lightning_zero.stage3.params import ShardedParams
from lightning_zero.stage3.secondary import SecondaryShards


class PartitionedStorage(ShardedStorage):
    """Stage 3: a master shard, a working shard (the same tensor where dtype and place agree) and unit buffers."""

    by_units: ClassVar[bool] = True

    def _make_storage(self, working_dtype: torch.dtype, master_dtype: torch.dtype) -> None:
        tiers = self.store_policy.offload
        offload_optimizer = tiers.offload_optimizer
        params_moved = tiers.offload_params  # see [Note: offloaded parameter shards] in params.py
        size = self.layout.shard_size
        self.master_storage = offload.allocate_master(
            size, master_dtype, self.device, offload_optimizer, tiers.offload_path
        )
        # the working shard doubles as the master where both have one dtype and live on the same side
        aliased = working_dtype == master_dtype and offload_optimizer == params_moved
        working = (
            self.master_storage
            if aliased
            else offload.allocate_master(size, working_dtype, self.device, params_moved, tiers.offload_path)
        )
        self.sharded = ShardedParams(
            self.layout, self.params, self.rank, working, self.group, self.device, bool(params_moved)
        )
        """The working shard and the per-unit gather buffers; setup fills them unit by unit."""
        self.secondary = (
            SecondaryShards(self.layout, self.groups, self.sharded.units) if self.groups.secondary is not None else None
        )
        """hpZ's secondary copies of the units (see [Note: hpZ, the secondary partition] in ``secondary.py``)."""
        self.weight_block = self.store_policy.weight_block
        """qwZ: the block size of the int8 all-gathers for compute (``None``: exact gathers)."""
        self.gathers_verified = False
        """Whether every unit gather follows from lockstep checks that all ranks have seen agree, or from a call that
        all ranks make between steps (the runtime sets it when the check is on): gloo may then gather by pairwise
        exchange (see [Note: reduce-scatter and all-gather on gloo] in ``comm/collectives.py``)."""

    @property
    def working_shard(self) -> Optional[Tensor]:
        return self.sharded.working_shard

    @property
    def params_offloaded(self) -> bool:
        return self.sharded.offloaded

    @property
    def gathered_bytes(self) -> int:
        """Bytes of unit buffers gathered right now."""
        return self.sharded.gathered_bytes

    def master_view(self, slot: MasterSlot) -> Tensor:
        assert self.master_storage is not None
        return self.master_storage[slot.start : slot.start + slot.length].view(slot.shape)

    def settle(self) -> None:
        self.sharded.settle()

    def refresh_working(self) -> None:
        """Cast the updated master shard into the working shard (the runtime gathers again what is gathered)."""
        self.sharded.settle()
        assert self.master_storage is not None
        if self.sharded.working_shard is not self.master_storage:  # an upload under offload_optimizer
            offload.copy_to_device(self.sharded.working_shard, self.master_storage)

    # ------------------------------------------------------------------ units
    def has_unit(self, unit: int) -> bool:
        """Whether this storage holds parameters of ``unit``."""
        return unit in self.sharded.units

    def unit_buffer(self, unit: int) -> Optional[UnitBuffer]:
        """``unit``'s buffer in this storage (``None`` if it has no parameter here): what its group holds."""
        return self.sharded.units.get(unit)

    def fill_unit(self, unit: int) -> None:
        """Shard ``unit``'s materialized (or gathered) parameters into the master and working shards, then make
        them views of the unit's buffer and free it."""
        assert self.master_storage is not None
        buckets = self.layout.unit_buckets(unit)
        self._copy_pieces(buckets, self.master_storage)
        if self.sharded.working_shard is not self.master_storage:
            self._copy_pieces(buckets, self.sharded.working_shard)
        self.sharded.attach_views(unit)
        self.sharded.reshard(unit)

    def gather_master_unit(self, unit: int) -> Tensor:
        """``unit``'s master values, all-gathered whole into a new tensor on the device (a collective; every rank
        calls it for the same units). Used by ``move_units``, which must carry the master precision."""
        assert self.master_storage is not None
        self.settle()  # a host master may be the host parameter shard an upload still reads
        start, end = self.layout.unit_range(unit)
        full = torch.empty(end - start, dtype=self.master_storage.dtype, device=self.device)
        works = []
        for bucket in self.layout.unit_buckets(unit):
            b0, b1 = self.layout.bucket_range(bucket)
            c0, _ = self.layout.chunk_range(bucket, self.rank)
            chunk = full[c0 - start : c0 - start + bucket.chunk_size]
            with torch.no_grad():  # this rank's chunk in its place (an upload from a host master), then in place
                chunk.copy_(self.master_storage[bucket.shard_offset : bucket.shard_offset + bucket.chunk_size])
            works.append(
                collectives.all_gather(
                    full[b0 - start : b1 - start], chunk, group=self.group, async_op=True, verified=False
                )
            )
        for work in works:
            collectives.wait(work, "gather a stage 3 unit's master values")
        return full

    def unshard_unit(self, unit: int, compute: bool = False, backward: bool = False) -> list[Any]:
        """Start the all-gathers of this storage's piece of ``unit`` (asynchronous work handles; see [Note: one
        vocabulary for stage 3] in ``unit.py``). For ``compute`` (a forward, or ``backward`` and its
        recomputations) ZeRO++ applies: in backward from hpZ's secondary copy inside the secondary group where one is
        kept, otherwise from the primary shards as blockwise int8 under qwZ (see ``secondary.py`` and
        ``comm/quantize.py``); otherwise exact, from the primary shards."""
        if compute and backward and self.secondary is not None and self.secondary.has(unit):
            return self.secondary.gather(unit, self.sharded.allocate(unit), self.gathers_verified)
        return self.sharded.unshard(unit, self.weight_block if compute else None, self.gathers_verified)

    def keep_secondary(self, unit: int) -> None:
        """hpZ: keep this rank's secondary piece of the gathered ``unit`` (no-op without hpZ)."""
        if self.secondary is not None and self.has_unit(unit):
            self.secondary.keep(unit, self.sharded.units[unit].tensor)

    def drop_secondary(self, unit: Optional[int] = None) -> None:
        """hpZ: forget ``unit``'s secondary copy (``None``: every unit's)."""
        if self.secondary is not None:
            self.secondary.drop_all() if unit is None else self.secondary.drop(unit)

    def reshard_unit(self, unit: int) -> None:
        """Free this storage's piece of ``unit`` (its gathered memory, back to the pool)."""
        self.sharded.reshard(unit)

    def unit_numel(self, unit: int) -> int:
        return self.sharded.unit_numel(unit)

    def _hand_back(self, gather: bool) -> None:
        """[Note: the hand-back does not stack on the step's memory]
        The full fp32 weights handed back at teardown (4 bytes per parameter on every rank) are the largest
        allocation of a stage 3 run. Everything a step used and ``fit`` no longer needs goes first: every gathered
        unit and the pool's blocks (the gradient shard and the bucket buffers are gone already, see
        ``ShardedStorage.uninstall``), hpZ's secondary copies, and the free pages of the host heap those left
        (one trim). Then the full buffer is made empty (no page touched), this rank's chunks are copied into their
        places in it, and the master shard goes: each master tensor becomes a view of its own values in the full
        buffer (the same numbers, so the optimizer's state keyed by it and a checkpoint saved after ``fit`` read what
        they read before). Only then do the all-gathers fill the other ranks' chunks, in place. The full buffer so
        takes the place of the step's memory and of the master shard instead of coming on top of them: the teardown
        holds 4 bytes per parameter plus the optimizer states, never the master shard as well. Where the masters live
        in host memory or on disk (``offload_optimizer``) they stay there and are only read.
        """
        for unit in list(self.sharded.units):
            self.sharded.reshard(unit)
        self.sharded.pool.clear()
        self.drop_secondary()
        if gather and not any(p.is_meta for p in self.params):  # meta: setup failed before materializing
            if self.device.type == "cpu":
                give_back_free_heap()
            full = self._own_chunks_in_full()
            for bucket in self.layout.buckets:
                b0, b1 = self.layout.bucket_range(bucket)
                c0, c1 = self.layout.chunk_range(bucket, self.rank)
                collectives.all_gather(full[b0:b1], full[c0:c1], group=self.group)
            for p, offset in zip(self.params, self.layout.offsets):
                p.data = full[offset : offset + p.numel()].view(p.shape)
        else:  # never leave a view of freed storage behind (reading it crashes)
            for p in self.params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        guard.restore(self.params)  # they hold storage of their own now

    def _own_chunks_in_full(self) -> Tensor:
        """A new full flat buffer (master dtype) holding this rank's chunks in place, the rest unwritten; the master
        tensors become views of it and the master and working shards are dropped, unless the masters are offloaded
        (see [Note: the hand-back does not stack on the step's memory])."""
        assert self.master_storage is not None
        self.settle()  # a host master may be the host parameter shard an upload still reads
        full = torch.empty(self.layout.total, dtype=self.master_storage.dtype, device=self.device)
        with torch.no_grad():
            for bucket in self.layout.buckets:
                c0, c1 = self.layout.chunk_range(bucket, self.rank)
                full[c0:c1].copy_(self.master_storage[bucket.shard_offset : bucket.shard_offset + bucket.chunk_size])
        if self.store_policy.offload.offload_optimizer:
            return full
        chunks = sorted((b.shard_offset, b) for b in self.layout.buckets if b.chunk_size)
        starts = [offset for offset, _ in chunks]
        for slot, master in zip(self.slots, self.masters):
            bucket = chunks[bisect.bisect_right(starts, slot.start) - 1][1]
            at = self.layout.chunk_range(bucket, self.rank)[0] + slot.start - bucket.shard_offset
            view = full[at : at + slot.length].view(slot.shape).requires_grad_(master.requires_grad)
            # a swap, not ``master.data = view``: a view keeps its base (the master shard) alive through its autograd
            # metadata, which ``.data`` does not replace; where torch refuses the swap (a tensor something else still
            # references), ``.data`` gives the same values and only keeps the shard's memory
            try:
                torch.utils.swap_tensors(master, view)
            except RuntimeError:
                master.data = view.detach()
        self.master_storage = None
        self.sharded.working_shard = full.new_empty(0)
        return full


def move_units(source: PartitionedStorage, targets: list[PartitionedStorage], unit_names: list[str]) -> None:
    """Move stage 3's weights from the evaluation storage ``source`` into the ``targets`` laid out for the optimizers,
    one unit at a time (see [Note: the store and the optimizers] in ``store.py``). Trainable parameters that no target
    holds are kept whole, as setup keeps them.

    [Note: the move carries the master values]
    Each unit's *master* values are gathered (not its working ones), the unit's parameters view them while the targets
    copy their pieces into their master and working shards, and the gathered tensor is freed: the targets' masters get
    exactly the values setup would have given them (under mixed precision the fp32 weights, not the 16-bit working
    copy), and no rank holds more than one unit in full (in the master dtype).
    """
    managed = {id(p) for target in targets for p in target.params}
    for unit in [*range(1, len(unit_names)), 0]:  # the root last, as at setup
        if not source.has_unit(unit):
            continue
        full = source.gather_master_unit(unit)
        start, _ = source.layout.unit_range(unit)
        params = [(j, p) for j, p in enumerate(source.params) if source.param_units[j] == unit]
        for j, p in params:
            offset = source.layout.offsets[j] - start
            p.data = full[offset : offset + p.numel()].view(p.shape)
        guard.restore([p for _, p in params])  # readable while the targets copy them
        with torch.no_grad():
            for _, p in params:
                if id(p) not in managed:
                    p.data = p.detach().clone()  # kept whole: values of its own, not a view of ``full``
        for target in targets:
            if target.has_unit(unit):
                target.fill_unit(unit)
        del full
