"""Pure arithmetic: where every parameter lives in a flat buffer, and which slice of it each rank owns.

[Note: the flat layout]
The parameters managed by one optimizer are laid end to end in one flat buffer, each parameter in one contiguous
range (so a parameter can be a view of the buffer). The buffer is cut into buckets of at most ``bucket_size``
elements; a bucket never spans two param groups (the optimizer sees one tensor per bucket, in that bucket's group).
Every bucket is split into ``world_size`` equal chunks (the bucket is padded to a multiple of ``world_size``), and
rank ``r`` owns chunk ``r`` of every bucket. A rank's *shard* is the concatenation of its chunks, so a
reduce-scatter of one bucket lands in one contiguous slice of every rank's shard.

With ``whole_params=True`` (optimizers whose update is not elementwise) a chunk holds whole parameters only: the
parameters of a bucket are dealt to the chunks largest first (longest-processing-time rule) and the chunk size is the
largest load, so some padding is the price of never splitting a tensor.

[Note: launch order]
Buckets are reduce-scattered in one order every rank derives from the layout alone (lockstep), each bucket by when it
is expected complete: the latest of its parameters in the order below. That is not always buffer order: a parameter
spanning two buckets forces them to be adjacent in the buffer, so with flat buckets a whole param group is one run
of buckets, and two groups (decay / no-decay) would otherwise make every bucket of one group wait, open, for the
other group's last bucket; peak bucket memory would grow with the model instead of staying ``bucket_buffers`` buckets.

Within a param group, parameters are laid out in the order backward is expected to produce their gradients: the
reverse of the module's registration order (not of the optimizer's list, which users often sort by kind). In the
buffer, runs of buckets linked by a parameter that spans them stay adjacent and are sorted by when they should be
complete; ``launch_order`` then orders the buckets themselves that way (see [Note: launch order]), so they fill and
launch one after the other even when groups interleave (decay / no-decay groups, layer-wise learning rates).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Optional, Sequence


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls in one rank's chunk of one bucket."""

    param: int
    """Index of the parameter in the layout's parameter list."""
    param_start: int
    """First element (in the flattened parameter) of the piece."""
    length: int
    """Number of elements."""
    chunk_offset: int
    """Where the piece starts inside the chunk."""


@dataclass(frozen=True)
class Bucket:
    """A contiguous range of the flat buffer that is reduced and gathered as one collective."""

    index: int
    group: int
    """The param group all parameters of this bucket belong to."""
    start: int
    """Offset of the bucket in the flat buffer."""
    chunk_size: int
    """Elements each rank owns in this bucket; the bucket has ``chunk_size * world_size`` elements."""
    shard_offset: int
    """Where this bucket's chunk starts inside a rank's shard (the same on every rank)."""
    params: tuple[int, ...]
    """Indices of the parameters that overlap this bucket."""
    unit: int = 0
    """Stage 3: the unit (gathered together) this bucket belongs to."""


@dataclass(frozen=True)
class FlatLayout:
    """The placement of a list of parameters in a flat, padded, sharded buffer. See [Note: the flat layout]."""

    world_size: int
    numels: tuple[int, ...]
    groups: tuple[int, ...]
    """The param group of each parameter."""
    offsets: tuple[int, ...]
    """Offset of each parameter in the flat buffer."""
    buckets: tuple[Bucket, ...]
    whole_params: bool
    param_units: tuple[int, ...] = ()
    """Stage 3: the unit of each parameter."""
    launch_order: tuple[int, ...] = ()
    """Bucket indices in the order their gradients are expected complete in backward (see [Note: launch order]);
    empty means index order."""

    @property
    def reduce_order(self) -> tuple[int, ...]:
        """The order in which the buckets are reduce-scattered, the same on every rank."""
        return self.launch_order or tuple(range(len(self.buckets)))

    @property
    def total(self) -> int:
        """Elements in the flat buffer, padding included."""
        return sum(b.chunk_size for b in self.buckets) * self.world_size

    @property
    def shard_size(self) -> int:
        """Elements each rank owns."""
        return sum(b.chunk_size for b in self.buckets)

    @property
    def max_bucket_elements(self) -> int:
        """The largest bucket: the size of one constant bucket buffer."""
        return max((b.chunk_size * self.world_size for b in self.buckets), default=0)

    def bucket_range(self, bucket: Bucket) -> tuple[int, int]:
        """The ``[start, end)`` range of ``bucket`` in the flat buffer."""
        return bucket.start, bucket.start + bucket.chunk_size * self.world_size

    def unit_buckets(self, unit: int) -> list[Bucket]:
        """The (adjacent) buckets of one stage-3 unit."""
        return [b for b in self.buckets if b.unit == unit]

    def unit_range(self, unit: int) -> tuple[int, int]:
        """The ``[start, end)`` range of one stage-3 unit in the flat buffer."""
        buckets = self.unit_buckets(unit)
        return (buckets[0].start, self.bucket_range(buckets[-1])[1]) if buckets else (0, 0)

    def chunk_range(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        """The ``[start, end)`` range of ``rank``'s chunk of ``bucket`` in the flat buffer."""
        start = bucket.start + rank * bucket.chunk_size
        return start, start + bucket.chunk_size

    def pieces(self, bucket: Bucket, rank: int) -> list[Piece]:
        """The parts of parameters that fall in ``rank``'s chunk of ``bucket``, in flat order."""
        return self._pieces_of(rank)[bucket.index]

    def bucket_pieces(self, bucket: Bucket) -> list[tuple[int, int, int, int]]:
        """``(param, param_start, length, bucket_offset)`` for every parameter part inside ``bucket``."""
        out = []
        for p in bucket.params:
            lo, hi = (
                max(self.offsets[p], bucket.start),
                min(self.offsets[p] + self.numels[p], self.bucket_range(bucket)[1]),
            )
            out.append((p, lo - self.offsets[p], hi - lo, lo - bucket.start))
        return out

    def _pieces_of(self, rank: int) -> list[list[Piece]]:
        """``rank``'s pieces of every bucket, computed once per rank asked for.

        [Note: pieces are planned for the ranks that ask]
        A rank asks for its own pieces (its optimizer's slots, its gradient shard), so the table is kept per rank
        asked: O(buckets) objects, not O(buckets x N). Planned for every rank at once it held one list per bucket and
        rank, about 2 million Python objects and 0.5 GB at N = 1024 for a 7.5B model.
        """
        cache: dict[int, list[list[Piece]]] = self.__dict__.setdefault("_pieces_by_rank", {})
        if rank not in cache:
            cache[rank] = [self._rank_pieces(bucket, rank) for bucket in self.buckets]
        return cache[rank]

    def _rank_pieces(self, bucket: Bucket, rank: int) -> list[Piece]:
        c0, c1 = self.chunk_range(bucket, rank)
        pieces = []
        for p in bucket.params:
            lo, hi = max(self.offsets[p], c0), min(self.offsets[p] + self.numels[p], c1)
            if lo < hi:
                pieces.append(Piece(param=p, param_start=lo - self.offsets[p], length=hi - lo, chunk_offset=lo - c0))
        return pieces


def plan_layout(
    numels: Sequence[int],
    groups: Sequence[int],
    world_size: int,
    bucket_size: int,
    whole_params: bool = False,
    ready_order: Optional[Sequence[int]] = None,
    units: Optional[Sequence[int]] = None,
) -> FlatLayout:
    """Place parameters of the given sizes (``groups[i]`` is the param group of parameter ``i``) in a flat buffer.

    ``ready_order[i]`` says when backward is expected to produce parameter ``i``'s gradient (smaller is earlier);
    by default the reverse of the list order. ``units[i]`` (stage 3) is the unit of parameter ``i``: a bucket never
    spans two units and the buckets of a unit are adjacent, so a unit is gathered as one range. See
    [Note: the flat layout].
    """
    if len(numels) != len(groups):
        raise ValueError("`numels` and `groups` must have the same length.")
    if world_size < 1 or bucket_size < 1:
        raise ValueError(f"world_size and bucket_size must be positive, got {world_size} and {bucket_size}.")
    ready = list(ready_order) if ready_order is not None else [len(numels) - 1 - i for i in range(len(numels))]
    plan = _plan_whole if whole_params else _plan_flat
    unit_of = list(units) if units is not None else [0] * len(numels)
    chains: list[list[tuple[int, int, _BucketPlan]]] = []
    for unit in sorted(set(unit_of)):
        unit_start = len(chains)
        for group in sorted(set(groups)):
            members = sorted(
                (i for i in range(len(numels)) if groups[i] == group and unit_of[i] == unit), key=lambda i: ready[i]
            )
            for bucket_plan in plan(members, numels, world_size, bucket_size):
                previous = chains[-1][-1] if len(chains) > unit_start else None
                same_unit = units is not None and previous is not None
                spans = (
                    previous is not None and previous[1] == group and bool(set(previous[2][0]) & set(bucket_plan[0]))
                )
                if same_unit or spans:
                    chains[-1].append((unit, group, bucket_plan))  # same unit, or a parameter spans both
                else:
                    chains.append([(unit, group, bucket_plan)])
    # Buffer order: chains sorted by when they are expected to be complete in backward, i.e. by the latest of their
    # parameters in reverse registration order (see [Note: the flat layout]).
    chains.sort(key=lambda chain: max((ready[p] for _, _, (params, _, _) in chain for p in params), default=0))
    offsets = [0] * len(numels)
    buckets: list[Bucket] = []
    cursor = shard_cursor = 0
    for unit, group, (params, chunk_size, begins) in (item for chain in chains for item in chain):
        for p, off in begins.items():
            offsets[p] = cursor + off
        ordered = tuple(sorted(params, key=lambda p: offsets[p]))
        buckets.append(Bucket(len(buckets), group, cursor, chunk_size, shard_cursor, ordered, unit))
        cursor += chunk_size * world_size
        shard_cursor += chunk_size
    complete = [max((ready[p] for p in b.params), default=0) for b in buckets]
    launch = tuple(sorted(range(len(buckets)), key=lambda b: (complete[b], b)))
    return FlatLayout(
        world_size, tuple(numels), tuple(groups), tuple(offsets), tuple(buckets), whole_params, tuple(unit_of), launch
    )


# (parameters overlapping the bucket, chunk size, {parameter: offset from the bucket start} for those starting in it)
_BucketPlan = tuple[list[int], int, dict[int, int]]


def _plan_flat(members: list[int], numels: Sequence[int], world_size: int, bucket_size: int) -> list[_BucketPlan]:
    """Elementwise optimizers: parameters end to end, cut every ``bucket_size`` elements (a param may span buckets)."""
    capacity = max(world_size, bucket_size - bucket_size % world_size)
    starts = list(accumulate((numels[p] for p in members), initial=0))
    total = starts[-1]
    plans: list[_BucketPlan] = []
    lo = 0
    while lo < total:
        size = min(capacity, total - lo)
        size += (-size) % world_size
        hi = lo + size
        inside = [p for p, s in zip(members, starts) if s < hi and s + numels[p] > lo]
        begins = {p: s - lo for p, s in zip(members, starts) if lo <= s < hi}
        plans.append((inside, size // world_size, begins))
        lo = hi
    return plans


def _plan_whole(members: list[int], numels: Sequence[int], world_size: int, bucket_size: int) -> list[_BucketPlan]:
    """Non-elementwise optimizers: every parameter lies inside one rank's chunk."""
    plans: list[_BucketPlan] = []
    current: list[int] = []
    filled = 0
    for p in members:
        current.append(p)
        filled += numels[p]
        if filled >= bucket_size:
            plans.append(_deal(current, numels, world_size))
            current, filled = [], 0
    if current:
        plans.append(_deal(current, numels, world_size))
    return plans


def _deal(params: list[int], numels: Sequence[int], world_size: int) -> _BucketPlan:
    """Deal whole parameters to ``world_size`` chunks, largest first to the least loaded chunk."""
    loads = [0] * world_size
    owner: dict[int, int] = {}
    for p in sorted(params, key=lambda p: -numels[p]):  # stable: ties keep layout order
        rank = loads.index(min(loads))
        owner[p] = rank
        loads[rank] += numels[p]
    chunk = max(1, max(loads))
    cursor = [0] * world_size
    begins = {}
    for p in params:
        r = owner[p]
        begins[p] = r * chunk + cursor[r]
        cursor[r] += numels[p]
    return [p for p in params if numels[p] > 0], chunk, begins


@dataclass(frozen=True)
class MasterSlot:
    """One tensor the user's optimizer steps on: a range of this rank's shard (see [Note: what the user's optimizer
    sees] in ``optimizer.py``)."""

    group: int
    start: int
    """Offset in the shard (of the storage owning the parameters: see ``ShardedOptimizer.slot_sources``)."""
    length: int
    shape: tuple[int, ...]
    pieces: tuple[tuple[int, int, int, int], ...]
    """``(member index, param_start, length, offset in this slot)`` of every parameter part inside."""


def plan_master_slots(layout: FlatLayout, rank: int, shapes: Sequence[tuple[int, ...]]) -> list[MasterSlot]:
    """The tensors ``rank``'s optimizer steps on: one flat slot per bucket, or one per whole parameter (shaped as
    ``shapes[param]``) when the layout keeps parameters whole."""
    slots = []
    for bucket in layout.buckets:
        pieces = layout.pieces(bucket, rank)
        if layout.whole_params:
            for pc in pieces:
                slots.append(
                    MasterSlot(
                        bucket.group,
                        bucket.shard_offset + pc.chunk_offset,
                        pc.length,
                        tuple(shapes[pc.param]),
                        ((pc.param, 0, pc.length, 0),),
                    )
                )
        elif bucket.chunk_size:
            parts = tuple((pc.param, pc.param_start, pc.length, pc.chunk_offset) for pc in pieces)
            slots.append(MasterSlot(bucket.group, bucket.shard_offset, bucket.chunk_size, (bucket.chunk_size,), parts))
    return slots
