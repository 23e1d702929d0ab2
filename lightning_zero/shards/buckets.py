"""Constant-size gradient buckets, reduce-scattered into this rank's gradient shard as each one fills.

[Note: constant memory]
A bucket needs a buffer only from its first gradient until its reduce-scatter completes. Buffers come from a small
pool of ``bucket_buffers`` tensors of the largest bucket's size; when all are busy, the oldest reduce-scatter in
flight is waited for and its buffer reused. Peak memory is therefore ``bucket_buffers`` (or the number of buckets
filling at the same moment, if that is larger) times the bucket size, whatever the number of buckets. The pool and
the gradient shard are made on first use and kept from step to step (see [Note: the engine owns its memory] in
``stage3/pool.py``): after the first step a reduction allocates nothing (``memory/costs.py`` counts it).

[Note: lockstep]
Collectives are matched across ranks by the order in which they are issued, so every rank must launch the same
buckets in the same order. Buckets are launched strictly in the layout's launch order (a bucket that fills early
waits for its predecessors, as in DDP's reducer; see [Note: launch order] in ``layout.py``), and a round ends with a
flush that launches every remaining bucket, zeros where this rank received no gradient. Rounds end at call sites every
rank passes together: the end of each backward and, for what a backward left (stage 1 after ``no_backward_sync``), the
start of the optimizer step.

[Note: filling without extra passes]
A bucket buffer is not cleared when it is taken from the pool: each gradient is divided by the world size on its
way in (one pass, ``torch.div(..., out=)``), and only what no gradient wrote, the padding and the parts of
parameters that got no gradient this round, is zeroed at launch. The values are those of "zero, copy, divide".

[Note: averaging and accumulation]
Each bucket is divided by the world size before the reduce-scatter, so the sum is DDP's mean gradient. Under hybrid
sharding the divisor is the whole job's N (not the shard group's k), the reduce-scatter runs inside the shard group,
and each reduced chunk is then all-reduced (summed) across the replica group as soon as it is waited for, before it
is added to the shard: so every replica holds the same N-rank mean, and an accumulated shard is never all-reduced
twice (see [Note: hybrid sharding and its traffic] in ``groups.py``). With ``overlap_comm`` that all-reduce is
started when the reduce-scatter is waited for and waited for only when its buffer is needed again (or at the end of
the round): see [Note: the replica all-reduce overlaps]. The first
reduction of a bucket after the gradients were cleared writes straight into the shard; later ones (gradient
accumulation) land in a side buffer and are added, so the shard accumulates exactly as ``.grad`` does under DDP.

The pooled buffers (slots), the sink a reducer may write into instead of a shard, and the filling helpers are in
``bucket_slots.py``.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_zero.comm import collectives
from lightning_zero.comm.groups import ShardGroups
from lightning_zero.comm.quantize import Scratch, reduce_scatter_quantized
from lightning_zero.memory import costs
from lightning_zero.memory.account import MemoryLedger
from lightning_zero.memory.heap_pin import HeapPin
from lightning_zero.process.faults import fault_point
from lightning_zero.shards.bucket_slots import BucketSlot, GradSink, bucket_gaps, scaled_copy
from lightning_zero.shards.layout import Bucket, FlatLayout


class GradientReducer:
    """Copies gradients into buckets and reduce-scatters every full bucket into ``grad_shard`` (or, with ``sink``,
    into a scratch chunk handed to the sink: see [Note: a sink instead of a device shard] in
    ``bucket_slots.py``)."""

    def __init__(
        self,
        layout: FlatLayout,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        max_buffers: int,
        overlap: bool,
        groups: Optional[ShardGroups] = None,
        unit_names: Sequence[str] = (),
        sink: Optional[GradSink] = None,
        quantize_block: Optional[int] = None,
        heap_pin: Optional[HeapPin] = None,
    ) -> None:
        self.layout = layout
        self.unit_names = unit_names
        """Stage 3: the name of each unit, for error messages."""
        self.rank = rank
        self.dtype = dtype
        self.device = device
        self.max_buffers = max_buffers
        self.overlap = overlap
        self.groups = groups if groups is not None else ShardGroups()
        self.group = self.groups.shard
        self._divisor = layout.world_size * self.groups.replicas  # N: see [Note: averaging and accumulation]
        self.sink = sink
        self.before_launch: Optional[Callable[[], None]] = None
        """Called before each reduce-scatter is launched (stage 3 waits for its lockstep check there)."""
        self.quantize_block = quantize_block
        self._quantize_scratch = Scratch()  # qgZ's codes, scales and sums, reused from bucket to bucket
        """qgZ: reduce each bucket as blockwise int8 by all-to-all, synchronously (see [Note: qgZ, the quantized
        reduce-scatter of gradients] in ``quantize.py``); ``None``: the exact reduce-scatter."""
        self.heap_pin = heap_pin
        """Taken at the first gradient of each backward (see [Note: the heap pin] in ``heap_pin.py``); ``None``:
        none."""
        self.ledger: Optional[MemoryLedger] = None
        """The engine's memory readings, one at the first gradient of each backward (see [Note: the account of a
        rank's memory] in ``memory/account.py``)."""
        self.grad_shard: Optional[torch.Tensor] = None
        """This rank's reduced gradients (``None`` until the first reduction, after ``clear``, and always with a
        ``sink``)."""
        self._written = [False] * len(layout.buckets)  # shard slice holds gradients since the last clear
        self._expected = [sum(length for _, _, length, _ in layout.bucket_pieces(b)) for b in layout.buckets]
        self._received = [0] * len(layout.buckets)
        self._order = layout.reduce_order  # launch order (see [Note: launch order] in layout.py)
        self._next = 0  # position in that order of the next bucket to launch in this round
        self._pending = False  # gradients arrived since the last flush
        self._open: dict[int, BucketSlot] = {}
        self._in_flight: deque[tuple[Bucket, Any, BucketSlot, bool]] = deque()
        # hybrid sharding: replica all-reduces in flight, with the slot whose side output they reduce (None: the shard)
        self._replicating: deque[tuple[Bucket, Any, Optional[BucketSlot], bool]] = deque()
        self._free: list[BucketSlot] = []
        self.buffers_allocated = 0
        """How many bucket buffers were ever made (the pool's high-water mark, see [Note: constant memory])."""
        self.peak_buffer_bytes = 0
        """The most bytes bucket buffers ever held at once (they are freed before each optimizer step)."""
        self._param_parts: list[list[tuple[Bucket, int, int, int]]] = [[] for _ in layout.numels]
        for bucket in layout.buckets:
            for p, start, length, offset in layout.bucket_pieces(bucket):
                self._param_parts[p].append((bucket, start, length, offset))
        self._got: list[set[int]] = [set() for _ in layout.buckets]  # params written into each open bucket
        self._gaps = [bucket_gaps(layout, b) for b in layout.buckets]

    # ------------------------------------------------------------------ filling
    def add_grad(self, param_index: int, grad: torch.Tensor) -> None:
        """Copy the gradient of one parameter into its bucket(s); launch the buckets that are full, in order."""
        flat = grad.detach().reshape(-1)
        if not self._pending:  # the first gradient of a backward: the heap at its highest
            if self.heap_pin is not None:
                self.heap_pin.take()
            if self.ledger is not None:
                self.ledger.note("the first gradient of a backward")
        self._pending = True
        costs.count_copy(flat)
        for bucket, start, length, offset in self._param_parts[param_index]:
            view = self._slot_for(bucket).input(bucket, self.layout.world_size)
            scaled_copy(view[offset : offset + length], flat[start : start + length], self._divisor)
            self._got[bucket.index].add(param_index)
            self._received[bucket.index] += length
            # launch before filling the next part: a parameter spanning many buckets needs no more buffers
            while self._next < len(self._order) and self._complete(self._order[self._next]):
                self._launch(self.layout.buckets[self._order[self._next]])

    def flush(self, force: bool = True) -> None:
        """End the round: launch every bucket not launched yet, in order, parts that got no gradient as zeros.

        See [Note: lockstep]. ``force=False`` only flushes if this rank received gradients since the last flush.
        """
        if force or self._pending:
            for index in self._order[self._next :]:
                bucket = self.layout.buckets[index]
                self._slot_for(bucket)
                self._launch(bucket)
        self._next = 0
        self._pending = False

    def wait(self) -> None:
        """Wait for every reduce-scatter (and replica all-reduce) in flight and accumulate its result."""
        while self._in_flight:
            self._finish_oldest()
        while self._replicating:
            self._finish_replica()

    def finalize(self, force: bool) -> torch.Tensor:
        """Flush, wait, and zero the shard slices no gradient reached; returns the complete gradient shard (the
        sink's, with a sink)."""
        self.flush(force)
        self.wait()
        for bucket in self.layout.buckets:
            if not self._written[bucket.index]:
                self._zero(bucket.shard_offset, bucket.shard_offset + bucket.chunk_size)
                self._written[bucket.index] = True
        return self.sink.shard() if self.sink is not None else self._shard()

    def clear(self, keep_shard: bool = True) -> None:
        """Forget accumulated gradients without communicating: the next reduction of each bucket overwrites its slice
        of the shard, which is kept unless ``keep_shard`` is false (see [Note: the gradient shard is kept] in
        ``store.py``)."""
        self.wait()
        if not keep_shard:
            self.grad_shard = None
        self._free.extend(self._open.values())
        self._open.clear()
        self._got = [set() for _ in self.layout.buckets]
        self._received = [0] * len(self.layout.buckets)
        self._next, self._pending = 0, False
        self._written = [False] * len(self.layout.buckets)
        if self.sink is not None:
            self.sink.clear()

    def clear_params(self, params: Sequence[int]) -> None:
        """Zero the gradients of some parameters only, without communicating (``zero_grad`` of another optimizer
        that holds them). Their parts of reduced buckets are zeroed in the shard, so a later reduction adds to zero;
        their parts of an open bucket count as a zero gradient received."""
        self.wait()
        for j in params:
            for bucket, _, length, offset in self._param_parts[j]:
                slot = self._open.get(bucket.index)
                if slot is not None:
                    slot.input(bucket, self.layout.world_size)[offset : offset + length].zero_()
                if self._written[bucket.index] and (self.grad_shard is not None or self.sink is not None):
                    for pc in self.layout.pieces(bucket, self.rank):
                        if pc.param == j:
                            at = bucket.shard_offset + pc.chunk_offset
                            self._zero(at, at + pc.length)

    def release_unwritten_shard(self) -> None:
        """Free the gradient shard if no reduction wrote into it since the last ``clear`` (it is made again on
        the next reduction)."""
        if not any(self._written) and not self._in_flight:
            self.grad_shard = None

    def release_buffers(self) -> None:
        """Free the pooled bucket buffers and the gradient shard (teardown; they are made again on demand)."""
        self.wait()
        self._free.clear()
        self.buffers_allocated = len(self._open)
        self.grad_shard = None
        if self.heap_pin is not None:
            self.heap_pin.release()

    @property
    def buffer_bytes(self) -> int:
        """Bytes held by bucket buffers right now."""
        slots = (
            list(self._open.values())
            + self._free
            + [s for _, _, s, _ in self._in_flight]
            + [s for _, _, s, _ in self._replicating if s is not None]
        )
        return sum(t.numel() * t.element_size() for s in slots for t in (s.bucket, s.out) if t is not None)

    # ------------------------------------------------------------------ internals
    def _shard(self) -> torch.Tensor:
        # [Note: the shard is not zeroed when made] Every slice is written before anything reads it: a bucket's
        # first reduction overwrites its slice, and ``finalize`` zeros the slices no reduction reached. Left
        # unwritten, a large CPU allocation costs no resident memory until its pages are written, so the shard
        # grows bucket by bucket through backward (as activations are freed) instead of all at the first bucket.
        if self.grad_shard is None:
            self.grad_shard = costs.empty(self.layout.shard_size, self.dtype, self.device)
        return self.grad_shard

    def _slot_for(self, bucket: Bucket) -> BucketSlot:
        slot = self._open.get(bucket.index)
        if slot is None:
            slot = self._acquire()  # not cleared: see [Note: filling without extra passes]
            self._open[bucket.index] = slot
        return slot

    def _acquire(self) -> BucketSlot:
        while not self._free and self._busy() >= self.max_buffers and (self._in_flight or self._holding()):
            if self._holding():  # a buffer whose reduce-scatter was waited for first
                self._finish_replica()
            else:
                self._finish_oldest()
        if self._free:
            return self._free.pop()
        self.buffers_allocated += 1
        slot = BucketSlot(costs.empty(self.layout.max_bucket_elements, self.dtype, self.device))
        self._in_flight_peak(slot)
        return slot

    def _in_flight_peak(self, extra: Optional[BucketSlot] = None) -> None:
        mine = (extra.bucket, extra.out) if extra is not None else ()
        held = self.buffer_bytes + sum(t.numel() * t.element_size() for t in mine if t is not None)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, held)

    def _busy(self) -> int:
        return len(self._open) + len(self._in_flight) + self._holding()

    def _holding(self) -> int:
        """Replica all-reduces in flight that hold a buffer (their chunk is its side output)."""
        return sum(slot is not None for _, _, slot, _ in self._replicating)

    def _complete(self, index: int) -> bool:
        return self._received[index] == self._expected[index]

    def _launch(self, bucket: Bucket) -> None:
        if self.before_launch is not None:
            self.before_launch()
        slot = self._open.pop(bucket.index)
        self._next += 1
        data = slot.input(bucket, self.layout.world_size)
        self._zero_unwritten(bucket, data)
        accumulate = self._written[bucket.index]
        scratch = accumulate or self.sink is not None
        target = slot.output(bucket, self.layout.world_size) if scratch else self._shard_slice(bucket)
        if scratch:
            slot.wait_fence(self.device)  # the sink's last read of it comes first
            self._in_flight_peak(slot)  # the side output may just have been made
        fault_point("collective.reduce_scatter")
        with collectives.profiler_label("reduce_scatter", f"bucket {bucket.index}{self._unit_label(bucket)}"):
            if self.quantize_block is not None:
                work = reduce_scatter_quantized(
                    target, data, self.quantize_block, group=self.group, scratch=self._quantize_scratch
                )
            else:
                work = collectives.reduce_scatter(target, data, group=self.group, async_op=self.overlap)
        self._written[bucket.index] = True
        self._received[bucket.index] = 0
        self._in_flight.append((bucket, work, slot, accumulate))
        if not self.overlap:
            self._finish_oldest()

    def _zero_unwritten(self, bucket: Bucket, data: torch.Tensor) -> None:
        """Zero the padding and the parts of parameters that wrote nothing into ``bucket`` this round."""
        got = self._got[bucket.index]
        for begin, end in self._gaps[bucket.index]:
            data[begin:end].zero_()
        if not self._complete(bucket.index):
            for p, _, length, offset in self.layout.bucket_pieces(bucket):
                if p not in got:
                    data[offset : offset + length].zero_()
        got.clear()

    def _finish_oldest(self) -> None:
        """Wait for the oldest reduce-scatter; deliver its chunk, or under hybrid sharding start its replica
        all-reduce first (see [Note: the replica all-reduce overlaps])."""
        bucket, work, slot, accumulate = self._in_flight.popleft()
        label = f"bucket {bucket.index}{self._unit_label(bucket)}"
        with collectives.profiler_label("wait_for_reduce_scatter", label):
            collectives.wait(work, f"reduce-scatter gradient {label}")
        if self.groups.replicate is None:
            self._deliver(bucket, slot, accumulate)
            return
        reduced = self._reduced(bucket, slot, accumulate)  # hybrid sharding: sum the N/k replicas' chunks
        work = collectives.all_reduce_async(reduced, group=self.groups.replicate)
        scratch = accumulate or self.sink is not None
        if not scratch:  # the chunk is in the shard: the input buffer is free for the next bucket now
            self._free.append(slot)
        self._replicating.append((bucket, work, slot if scratch else None, accumulate))
        if not self.overlap:
            self._finish_replica()

    def _finish_replica(self) -> None:
        """Wait for the oldest replica all-reduce (hybrid sharding) and deliver its chunk.

        [Note: the replica all-reduce overlaps]
        Under hybrid sharding a reduced chunk is all-reduced across the replica group before it is delivered. It is
        started as soon as its reduce-scatter is waited for and waited for only when its buffer is needed again or
        the round ends (``wait``), so it runs while backward goes on and the next buckets are reduce-scattered
        (another process group: its own queue of work). Every rank starts these all-reduces in the same order, that
        of the reduce-scatters (first in, first out), so the replica group's collectives match ([Note: lockstep]).
        A chunk reduced straight into the shard holds no buffer meanwhile (its slot went back to the pool when the
        reduce-scatter was waited for), so the all-reduce runs on while backward fills the next buckets; a chunk in
        a slot's side output (accumulation, a sink) keeps its slot until it is delivered here. Nothing reads a chunk
        before delivery: the shard is read only after ``wait``.
        """
        bucket, work, slot, accumulate = self._replicating.popleft()
        collectives.wait(work, f"all-reduce gradient bucket {bucket.index}{self._unit_label(bucket)} across replicas")
        if slot is not None:
            self._deliver(bucket, slot, accumulate)

    def _reduced(self, bucket: Bucket, slot: BucketSlot, accumulate: bool) -> torch.Tensor:
        """Where ``bucket``'s reduce-scatter wrote this rank's chunk: the slot's side output or the shard slice."""
        scratch = accumulate or self.sink is not None
        return slot.output(bucket, self.layout.world_size) if scratch else self._shard_slice(bucket)

    def _deliver(self, bucket: Bucket, slot: BucketSlot, accumulate: bool) -> None:
        """Hand the fully reduced chunk to the sink, or add it to the shard (accumulation); free the slot."""
        reduced = self._reduced(bucket, slot, accumulate)
        if self.sink is not None:
            slot.fence = self.sink.write(bucket, reduced, accumulate)
        elif accumulate:
            self._shard_slice(bucket).add_(reduced)
        self._free.append(slot)

    def _zero(self, start: int, end: int) -> None:
        """Zero positions ``[start, end)`` of the gradient shard (the sink's, with a sink)."""
        if self.sink is not None:
            self.sink.zero(start, end)
        else:
            self._shard()[start:end].zero_()

    def _unit_label(self, bucket: Bucket) -> str:
        if not self.unit_names:
            return ""
        return f" of stage 3 unit '{self.unit_names[bucket.unit]}'"

    def _shard_slice(self, bucket: Bucket) -> torch.Tensor:
        return self._shard()[bucket.shard_offset : bucket.shard_offset + bucket.chunk_size]
