"""The only module that calls ``torch.distributed``; it counts what every collective moves.

[Note: what the counters count]
Each collective adds the *logical payload* it moves to its kind: the full input of a reduce-scatter, the full output
of an all-gather, the tensor of an all-reduce or broadcast. That is the unit of the ZeRO paper's traffic column: a
stage 1 or 2 step moves Ψ elements by reduce-scatter and Ψ by all-gather (2Ψ, the same as DDP's one all-reduce of
Ψ), stage 3 adds a second all-gather. Bytes on the wire depend on the algorithm (a ring moves about twice the payload
times ``(N - 1) / N``) and are not what is compared. A process group of one rank moves nothing and counts nothing.

[Note: reduce-scatter and all-gather on gloo]
gloo's ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` are much slower than its all-reduce of the same
buffer (timings: benchmarks/RESULTS.md, "Profile and fixes (part 5)", from ``benchmarks/gloo_collectives.py``), so on
gloo both are carried out as one all-reduce each. A reduce-scatter all-reduces its
input in place (the caller's bucket is scratch) and copies this rank's chunk out when the work is waited for; an
all-gather zeros the other ranks' chunks of the output and all-reduces it. ``x + 0 == x`` exactly, so the gathered
values are bit-identical (only a ``-0.0`` comes back as ``+0.0``); the reduced sums are DDP's own all-reduce. The
memory is the same (in place), the counters still count the logical payload above, and the bytes on the wire of an
all-gather double, which gloo's own algorithm costs in time anyway. Stage 3's unit gathers stay native: their order
follows the model's control flow, and two ranks out of step must fail (an all-reduce would silently sum two units
of the same size; an all-reduce of two different sizes even aborts the process inside gloo). gloo's own all-gather
allocates a second, full-size output inside gloo and copies it out (its peak is a second copy of the output; an
all-reduce of the same buffer adds next to nothing: benchmarks/RESULTS.md, "Where the overhead went"), so stage 3
gathers a unit bucket by bucket: the temporary is bounded by the bucket size (see [Note: the default bucket size] in
``config.py``), not the unit's. Bucket reduce-scatters and the after-step gathers are issued in a fixed order by
every rank. NCCL keeps its native collectives, and ``LIGHTNING_ZERO_GLOO_NATIVE=1`` keeps gloo's (for comparisons).

Which ranks form which group (shard, replicate, tensor) is ``groups.py``; each group's traffic counts under its
scope (:func:`register_scope`).
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_zero.core.faults import fault_point

# torch >= 2.12 renames the tensor collectives; older releases (the GPU machines run 2.11) only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Traffic:
    """Payload moved per collective kind since the last :meth:`reset`, in bytes and in elements."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    elements: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    scopes: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    """Elements per scope (``"world"``, ``"shard"``, ``"replicate"``, ``"tensor"``, ``"data"``, ``"other"``) and
    kind: see [Note: hybrid sharding and its traffic] in ``groups.py``. ``elements`` is their sum over scopes."""

    def add(self, kind: str, tensor: torch.Tensor, group: Optional[Any] = None) -> None:
        """Count ``tensor`` as the payload of one ``kind`` collective over ``group`` (``None``: the world)."""
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.elements[kind] += tensor.numel()
        self.calls[kind] += 1
        self.scopes[scope_of(group)][kind] += tensor.numel()

    def reset(self) -> None:
        """Start counting from zero."""
        self.bytes.clear()
        self.elements.clear()
        self.calls.clear()
        self.scopes.clear()

    def snapshot(self) -> dict[str, Any]:
        """A plain copy: ``{"bytes": {...}, "elements": {...}, "calls": {...}, "scopes": {scope: {...}}}``."""
        return {"bytes": dict(self.bytes), "elements": dict(self.elements), "calls": dict(self.calls),
                "scopes": {scope: dict(kinds) for scope, kinds in self.scopes.items()}}


#: The scope label of each process group made by :func:`make_shard_groups`, by ``id``.
_SCOPES: dict[int, str] = {}


def scope_of(group: Optional[Any]) -> str:
    """The traffic scope of ``group``: ``"world"`` for the default group, ``"shard"`` / ``"replicate"`` for hybrid
    sharding's groups (under tensor parallelism also ``"tensor"``, and ``"data"`` for the whole data dimension when it
    is split into shard groups), ``"other"`` for any other group."""
    if group is None:
        return "world"
    return _SCOPES.get(id(group), "other")


#: Counters of this process. Tests and benchmarks reset and read them around the steps they measure.
TRAFFIC = Traffic()


class _DoneWork:
    """Stands in for a ``dist.Work`` handle when nothing had to be communicated."""

    def wait(self) -> bool:
        return True


DIVERGENCE_HINT = (
    "The ranks probably issued different collectives (data-dependent control flow, or a rank that skipped a step). "
    "Every rank must run the same modules in the same order; under zero3 prefer zero2 for models whose ranks take "
    "different branches."
)


def wait(work: Any, what: str) -> None:
    """Wait for ``work``; a failure (a peer that never joined, the process group timeout) says what was waited for."""
    try:
        work.wait()
    except RuntimeError as error:
        raise RuntimeError(f"ZeRO could not {what}: {error}. {DIVERGENCE_HINT}") from error


def is_distributed(group: Optional[Any] = None) -> bool:
    """Whether a process group of more than one rank is there to talk to."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def world_size(group: Optional[Any] = None) -> int:
    """Ranks in ``group``; 1 without a process group."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rank(group: Optional[Any] = None) -> int:
    """This process's rank in ``group``; 0 without a process group."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


class _CopyAfter:
    """A work handle whose ``wait`` also copies ``source`` into ``target`` (the chunk of a reduce-scatter on gloo)."""

    def __init__(self, work: Any, target: torch.Tensor, source: torch.Tensor) -> None:
        self.work, self.target, self.source = work, target, source

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.target.copy_(self.source)
            self.work = None
        return True


def _via_all_reduce(group: Optional[Any]) -> bool:
    """Whether reduce-scatter and all-gather run as all-reduces (see [Note: reduce-scatter and all-gather on gloo])."""
    return dist.get_backend(group) == "gloo" and os.environ.get("LIGHTNING_ZERO_GLOO_NATIVE", "0") != "1"


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None, async_op: bool = False) -> Any:
    """Sum ``input`` (``world_size`` equal chunks) over ranks; this rank's chunk of the sum lands in ``output``.

    ``input`` is scratch: on gloo it is overwritten with the full sum.
    """
    if not is_distributed(group):
        output.copy_(input)
        return _DoneWork()
    fault_point("collective.reduce_scatter")
    TRAFFIC.add("reduce_scatter", input, group)
    if not _via_all_reduce(group):
        work = _reduce_scatter_single(output, input, group=group, async_op=async_op)
        return work if async_op else _DoneWork()
    n, r = output.numel(), rank(group)
    work = _CopyAfter(dist.all_reduce(input, group=group, async_op=True), output, input[r * n : (r + 1) * n])
    if not async_op:
        work.wait()
    return work


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None, async_op: bool = False,
               allow_all_reduce: bool = True) -> Any:
    """Concatenate every rank's ``input`` into ``output``; ``input`` may be this rank's slice of ``output``.

    ``allow_all_reduce=False`` keeps gloo's own all-gather: for gathers whose order follows the model's control flow
    (stage 3 units), where two ranks out of step must fail, not sum two different units of the same size.
    """
    if not is_distributed(group):
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _DoneWork()
    TRAFFIC.add("all_gather", output, group)
    if allow_all_reduce and _via_all_reduce(group):
        n, r = input.numel(), rank(group)
        mine = output[r * n : (r + 1) * n]
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)
        output[: r * n].zero_()
        output[(r + 1) * n :].zero_()
        work = dist.all_reduce(output, group=group, async_op=async_op)
    else:
        work = _all_gather_single(output, input, group=group, async_op=async_op)
    return work if async_op else _DoneWork()


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Optional[Any] = None) -> torch.Tensor:
    """In-place all-reduce (sum unless ``op`` says otherwise); returns ``tensor``."""
    if is_distributed(group):
        TRAFFIC.add("all_reduce", tensor, group)
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_async(tensor: torch.Tensor, group: Optional[Any] = None) -> Any:
    """In-place sum over ``group``, started now; returns the work to :func:`wait` on (done at once without peers)."""
    if not is_distributed(group):
        return _DoneWork()
    TRAFFIC.add("all_reduce", tensor, group)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Optional[Any] = None) -> torch.Tensor:
    """In-place broadcast from global rank ``src``; returns ``tensor``."""
    if is_distributed(group):
        TRAFFIC.add("broadcast", tensor, group)
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def barrier(device: Optional[torch.device] = None) -> None:
    """Wait for every rank (NCCL needs to know this rank's device)."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl" and device is not None and device.index is not None:
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s (picklable) ``obj`` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src)
    return holder[0]


MAX = dist.ReduceOp.MAX


def gather_objects(obj: Any, dst: int = 0, group: Optional[Any] = None) -> Optional[list[Any]]:
    """Pickle ``obj`` from every rank to ``dst``: the list on ``dst``, ``None`` elsewhere."""
    if not is_distributed(group):
        return [obj]
    out: Optional[list[Any]] = [None] * world_size(group) if rank(group) == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def all_gather_objects(obj: Any, group: Optional[Any] = None) -> list[Any]:
    """Pickle ``obj`` from every rank to every rank."""
    if not is_distributed(group):
        return [obj]
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def new_group(rank_lists: list[list[int]]) -> Optional[Any]:
    """Make one process group per list of global ranks (every rank must call this with the same lists) and return
    the one this rank belongs to, ``None`` if none."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    me, mine = dist.get_rank(), None
    for ranks in rank_lists:
        group = dist.new_group(sorted(ranks))
        if me in ranks:
            mine = group
    return mine


def register_scope(group: Any, scope: str) -> None:
    """Count the traffic of ``group`` under ``scope`` (see :func:`scope_of`)."""
    _SCOPES[id(group)] = scope


def global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank``."""
    return dist.get_global_rank(group, group_rank)


def world_key() -> int:
    """Identifies the default process group (groups made over it are cached per job)."""
    return id(dist.group.WORLD)


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """Collective: ``torch.distributed``'s ``DeviceMesh`` of ``shape`` over every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shape, mesh_dim_names=names)


_CONTROL_GROUP: Optional[Any] = None


def agree_max(values: list[int]) -> list[int]:
    """The element-wise maximum of small integer flags over all ranks (collective), on the CPU.

    Under NCCL a gloo group made for this once keeps the device stream out of it (no device synchronization per
    step). Counted as ``control``.
    """
    global _CONTROL_GROUP
    if not is_distributed():
        return list(values)
    if dist.get_backend() != "gloo" and _CONTROL_GROUP is None:
        _CONTROL_GROUP = dist.new_group(backend="gloo")
    tensor = torch.tensor(values, dtype=torch.int32)
    TRAFFIC.add("control", tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_CONTROL_GROUP)
    return tensor.tolist()


_LOCKSTEP_GROUPS: dict[int, Any] = {}


def make_lockstep_group() -> Optional[Any]:
    """Collective (every rank calls it at setup): the gloo group stage 3's lockstep check talks over, made once per
    job; ``None`` without a process group of more than one rank. A group of its own, so that a check never waits
    behind the data collectives in flight (gloo runs one group's collectives one after the other)."""
    if not is_distributed():
        return None
    key = world_key()
    if key not in _LOCKSTEP_GROUPS:
        _LOCKSTEP_GROUPS[key] = dist.new_group(backend="gloo")
    return _LOCKSTEP_GROUPS[key]


def exchange_positions(values: list[int], group: Any) -> list[list[int]]:
    """Every rank's few integers (the same count on each), on every rank, over ``group`` (from
    :func:`make_lockstep_group`); synchronous, on the CPU. Control messages, not payload: not counted."""
    mine = torch.tensor(values, dtype=torch.int64)
    out = torch.empty(world_size(group) * len(values), dtype=torch.int64)
    _all_gather_single(out, mine, group=group)
    return out.view(-1, len(values)).tolist()
