"""Stage 3 parameter storage: this rank keeps a shard of the working parameters; units are gathered on demand.

[Note: stage 3 storage]
Each unit of ``lightning_zero.stage3.plan`` has one flat buffer per storage of the engine's parameter store (see
``shards/store.py``), in the working dtype, covering the unit's adjacent buckets of the layout. Its parameters are
views of that buffer from setup on; between uses the buffer's storage holds zero bytes, so the parameters keep their
shapes but hold no memory. An unshard lends the storage a block of the pool and a reshard takes it back (see [Note:
the engine owns its memory] in ``pool.py``): no allocation per gather. The only persistent copy of the values is the
working shard (this rank's chunk of every bucket, 2Ψ/N under mixed precision), which aliases the master shard when
the working and master dtypes are the same.

[Note: offloaded parameter shards]
With ``offload_params=True`` the working shard lives in host memory (pinned on CUDA, see ``offload.py``) and the
device keeps no persistent copy of it: only the gathered units in flight. Gathering a unit first uploads this rank's
chunk of each of its buckets from the host shard straight into that chunk's place in the unit's (device) buffer, then
all-gathers in place, so no device staging buffer exists. The uploads are issued on the current stream before the
all-gather (asynchronous from pinned memory, ordered before the collective that reads them) and run in the prefetch
order of ``lightning_zero.stage3.units``, so a prefetched unit's upload overlaps the current unit's compute. Before
the host shard is written (the optimizer step on an aliased host master, the copy of an updated master, a load),
``ShardedParams.settle`` waits for uploads still reading it. On a CPU-only machine the host shard is still a
storage of its own and every upload still happens, so CPU tests exercise this path.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives
from lightning_zero.comm.quantize import Scratch, all_gather_quantized
from lightning_zero.memory import costs
from lightning_zero.shards.layout import FlatLayout
from lightning_zero.shards.offload import copy_to_device, pins
from lightning_zero.stage3.buffer import UnitBuffer
from lightning_zero.stage3.pool import BlockPool


class ShardedParams:
    """The working shard and the per-unit gather buffers of one storage's parameters (see [Note: stage 3 storage])."""

    def __init__(
        self,
        layout: FlatLayout,
        params: list[Tensor],
        rank: int,
        working_shard: Tensor,
        group: Optional[Any] = None,
        device: Optional[torch.device] = None,
        offloaded: bool = False,
    ) -> None:
        self.layout = layout
        self.params = params
        self.rank = rank
        self.group = group
        self.working_shard = working_shard
        self.offloaded = offloaded
        """Whether ``working_shard`` is in host memory (see [Note: offloaded parameter shards])."""
        self.device = device if device is not None else working_shard.device
        self.asynchronous = offloaded and pins(self.device)
        self._uploads_pending = False
        self.uploaded_bytes = 0
        """Bytes copied from the host shard to the device since setup (0 unless ``offloaded``)."""
        self._live_bytes = 0
        self.pool = BlockPool(self.device)
        """The memory the unit buffers hold while gathered (see [Note: the engine owns its memory] in ``pool.py``)."""
        self.scratch = Scratch()
        """qwZ's codes and scales in flight, reused from gather to gather."""
        self.units: dict[int, UnitBuffer] = {}
        """Each unit's buffer in this storage (units with a bucket here only)."""
        members: dict[int, list[int]] = {}
        for j in range(len(params)):
            members.setdefault(layout.param_units[j], []).append(j)
        for unit in sorted({b.unit for b in layout.buckets}):
            start, end = layout.unit_range(unit)
            tensor = torch.empty(end - start, dtype=working_shard.dtype, device=self.device)
            self.units[unit] = UnitBuffer(unit, tensor, [params[j] for j in members.get(unit, [])], self.pool)

    @property
    def buffers(self) -> dict[int, Tensor]:
        """Each unit's flat buffer (the tensors of ``units``)."""
        return {unit: buffer.tensor for unit, buffer in self.units.items()}

    def unit_numel(self, unit: int) -> int:
        """Elements of ``unit`` gathered by this optimizer (0 if it has no parameter there)."""
        buffer = self.units.get(unit)
        return buffer.numel if buffer is not None else 0

    def attach_views(self, unit: int) -> None:
        """Make ``unit``'s parameters views of its buffer (their values must already be in the shards)."""
        start, _ = self.layout.unit_range(unit)
        offsets = [self.layout.offsets[j] - start for j, u in enumerate(self.layout.param_units) if u == unit]
        self._live_bytes += self.units[unit].attach_views(offsets)

    def unshard(self, unit: int, quantize_block: Optional[int] = None, verified: bool = False) -> list[Any]:
        """Give ``unit``'s buffer its memory back and start the all-gathers of the shards into it (see [Note: one
        vocabulary for stage 3] in ``unit.py``); returns the work handles. With
        ``quantize_block``, as blockwise int8 (qwZ: see [Note: qwZ, the quantized all-gather of weights] in
        ``comm/quantize.py``). ``verified``: the lockstep check matched this gather on every rank (see
        ``all_gather``)."""
        if unit not in self.units:
            return []
        buffer = self._allocate(unit)
        start, _ = self.layout.unit_range(unit)
        works = []
        for bucket in self.layout.unit_buckets(unit):
            b0, b1 = self.layout.bucket_range(bucket)
            source = self.working_shard[bucket.shard_offset : bucket.shard_offset + bucket.chunk_size]
            if self.offloaded:  # upload into this rank's chunk of the buffer, then gather in place
                source = self._upload(source, buffer, self.layout.chunk_range(bucket, self.rank)[0] - start)
            output = buffer[b0 - start : b1 - start]
            if quantize_block is not None:
                works.append(
                    all_gather_quantized(output, source, quantize_block, group=self.group, scratch=self.scratch)
                )
                continue
            works.append(collectives.all_gather(output, source, group=self.group, async_op=True, verified=verified))
        return works

    def allocate(self, unit: int) -> Tensor:
        """``unit``'s buffer, given its memory back if it had none (the caller fills it: hpZ's secondary gather)."""
        return self._allocate(unit)

    def _upload(self, source: Tensor, buffer: Tensor, at: int) -> Tensor:
        """Copy a host chunk to ``buffer[at:]`` on the device; returns the device chunk."""
        chunk = buffer[at : at + source.numel()]
        copy_to_device(chunk, source)  # asynchronous from pinned memory; a disk shard's pages evicted after
        costs.count_copy(chunk)
        self._uploads_pending = self._uploads_pending or self.asynchronous
        self.uploaded_bytes += chunk.numel() * chunk.element_size()
        return chunk

    def settle(self) -> None:
        """Wait for the uploads still reading the host shard, before it is written (no-op unless pinned on CUDA)."""
        if self._uploads_pending:
            torch.cuda.synchronize(self.device)
            self._uploads_pending = False

    def reshard(self, unit: int) -> None:
        """Free ``unit``'s gathered memory (back to the pool)."""
        if unit in self.units:
            self._live_bytes -= self.units[unit].take_back()

    def _allocate(self, unit: int) -> Tensor:
        buffer = self.units[unit]
        self._live_bytes += buffer.lend()
        return buffer.tensor

    @property
    def gathered_bytes(self) -> int:
        """Bytes of unit buffers gathered right now."""
        return self._live_bytes
