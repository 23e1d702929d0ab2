"""The only module that calls ``torch.distributed``; it counts what every collective moves.

[Note: what the counters count]
Each collective adds the *logical payload* it moves to its kind: the full input of a reduce-scatter, the full output
of an all-gather, the tensor of an all-reduce or broadcast. That is the unit of the ZeRO paper's traffic column: a
stage 1 or 2 step moves Ψ elements by reduce-scatter and Ψ by all-gather (2Ψ, the same as DDP's one all-reduce of
Ψ), stage 3 adds a second all-gather. Bytes on the wire depend on the algorithm (a ring moves about twice the payload
times ``(N - 1) / N``) and are not what is compared. A process group of one rank moves nothing and counts nothing.

[Note: reduce-scatter and all-gather on gloo]
gloo's ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` are much slower than its all-reduce of the same
buffer (2 CPU ranks, 23M fp32 elements: all-reduce 111 ms, reduce-scatter 272 ms, all-gather 220 ms; see
benchmarks/RESULTS.md), so on gloo both are carried out as one all-reduce each. A reduce-scatter all-reduces its
input in place (the caller's bucket is scratch) and copies this rank's chunk out when the work is waited for; an
all-gather zeros the other ranks' chunks of the output and all-reduces it. ``x + 0 == x`` exactly, so the gathered
values are bit-identical (only a ``-0.0`` comes back as ``+0.0``); the reduced sums are DDP's own all-reduce. The
memory is the same (in place), the counters still count the logical payload above, and the bytes on the wire of an
all-gather double, which gloo's own algorithm costs in time anyway. Stage 3's unit gathers stay native: their order
follows the model's control flow, and two ranks out of step must fail (an all-reduce would silently sum two units
of the same size; an all-reduce of two different sizes even aborts the process inside gloo). gloo's own all-gather
allocates a second, full-size output inside gloo and copies it out (measured: +95 MiB of peak for a 95 MiB
all-gather, +3 MiB for an all-reduce of the same buffer), so stage 3 gathers a unit bucket by bucket: the
temporary is bounded by the bucket size (see [Note: the default bucket size] in ``config.py``), not the unit's.
Bucket reduce-scatters and the after-step gathers are issued in a fixed order by every rank. NCCL keeps its native collectives, and
``LIGHTNING_ZERO_GLOO_NATIVE=1`` keeps gloo's (for comparisons).

[Note: hybrid sharding and its traffic]
With ``shard_group_size=k`` (k divides N) the N ranks form N/k *shard groups* of k consecutive ranks (a node, by
default) and k *replica groups* of R = N/k ranks (the ranks with the same position in every shard group); see
:func:`make_shard_groups`. Model states are sharded over the shard group exactly as over N ranks without hybrid
sharding and are replicated across the replica group. Per step and per rank, with Ψ the (padded) parameter count,
the counters count (logical payload, see [Note: what the counters count]):

- inside the shard group (scope ``"shard"``): reduce-scatter Ψ, all-gather Ψ (stages 1-2: the updated params; stage 3:
  twice, forward and backward), i.e. 2Ψ or 3Ψ as in the paper's table with k in place of N. A ring moves
  (k-1)/k of each payload per rank: 2Ψ(k-1)/k or 3Ψ(k-1)/k elements on the wire.
- across shard groups (scope ``"replicate"``): one all-reduce of each reduced bucket chunk, Ψ/k elements in all
  (the gradient shard). A ring all-reduce moves 2(Ψ/k)(R-1)/R elements per rank.

Only the second term crosses nodes when k is the node size. Collectives over the whole job (loss-scale overflow,
signal agreement, checkpoints) count under ``"world"``. Without hybrid sharding the shard group *is* the world and
everything counts under ``"world"``.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_zero.engine.faults import fault_point
from lightning_zero.engine.layout import hybrid_rank_lists

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
    kind: see [Note: hybrid sharding and its traffic]. ``elements`` is their sum over scopes."""

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


@dataclass(frozen=True)
class ShardGroups:
    """The process groups one engine talks over: see [Note: hybrid sharding and its traffic].

    The default (``ShardGroups()``) is plain ZeRO: the whole world shards, nothing replicates.
    """

    shard: Optional[Any] = None
    """The group model states are sharded over (reduce-scatter, all-gather, clipping norm); ``None``: the world."""
    replicate: Optional[Any] = None
    """The ranks holding the same shard (the gradient shards are all-reduced over it); ``None``: no replicas."""
    replicas: int = 1
    """R, the size of ``replicate``: the world size is ``replicas`` times the shard group's size."""
    tensor: Optional[Any] = None
    """Tensor parallelism: the ranks that hold the slices of the same tensors (``None``: no tensor parallelism). The
    shard group is then the data-parallel group: see [Note: ZeRO over the data dimension]."""
    mesh: Optional[Any] = None
    """Tensor parallelism: the 2-D ``DeviceMesh`` (``"data_parallel"``, ``"tensor_parallel"``) the module's
    ``configure_model`` parallelizes over."""
    data: Optional[Any] = None
    """Tensor parallelism with hybrid sharding: the whole data-parallel group (shard groups times replicas)."""

    @property
    def first_replica(self) -> bool:
        """Whether this rank is the replica that writes its shard's pieces of a checkpoint (position 0 of
        ``replicate``, i.e. in the first shard group)."""
        return self.replicate is None or rank(self.replicate) == 0

    @property
    def tensor_size(self) -> int:
        """t, the tensor-parallel degree (1 without tensor parallelism)."""
        return world_size(self.tensor) if self.tensor is not None else 1

    @property
    def data_group(self) -> Optional[Any]:
        """The ranks that must start from the same weights (``None``: the world); under tensor parallelism the
        data-parallel group, since the tensor-parallel ranks hold different slices."""
        if self.tensor is None:
            return None
        return self.data if self.data is not None else self.shard

    @property
    def data_source(self) -> int:
        """The global rank whose weights :attr:`data_group` starts from (its first rank)."""
        group = self.data_group
        return dist.get_global_rank(group, 0) if group is not None else 0


_HYBRID: dict[tuple[Any, ...], ShardGroups] = {}


def make_shard_groups(shard_group_size: int, tensor_parallel_size: int = 1, device_type: str = "cpu") -> ShardGroups:
    """Collective: the :class:`ShardGroups` of this rank for shard groups of ``shard_group_size`` ranks, or, with
    ``tensor_parallel_size > 1``, for ZeRO over the data dimension of a (data x tensor) mesh.

    Every rank makes every group, in the same order (shard groups, then replica groups), as ``dist.new_group``
    requires; made once per default process group and size (a second ``fit`` reuses them). A group size equal to
    the world size is plain ZeRO and makes no group.
    """
    world = world_size()
    if tensor_parallel_size > 1:
        return _tensor_parallel_groups(world, tensor_parallel_size, device_type, shard_group_size)
    if shard_group_size == world:
        return ShardGroups()
    key = (id(dist.group.WORLD), world, shard_group_size)
    if key not in _HYBRID:
        shard_lists, replica_lists = hybrid_rank_lists(world, shard_group_size)
        shard, replicate = new_group(shard_lists), new_group(replica_lists)
        _SCOPES[id(shard)], _SCOPES[id(replicate)] = "shard", "replicate"
        _HYBRID[key] = ShardGroups(shard, replicate, world // shard_group_size)
    return _HYBRID[key]


def _tensor_parallel_groups(world: int, tensor_parallel_size: int, device_type: str,
                            shard_group_size: int) -> ShardGroups:
    """The data-parallel and tensor-parallel groups of a (world / t) x t ``DeviceMesh``, made once per job; with a
    ``shard_group_size`` k below the data-parallel size d, also the shard groups (k consecutive data-parallel ranks
    of each tensor rank) and replica groups of hybrid sharding inside the data dimension.

    [Note: ZeRO over the data dimension]
    With tensor parallelism of degree t the N ranks form a mesh of d = N / t data-parallel rows (Lightning's
    ``ModelParallelStrategy`` layout: the t ranks of a tensor group are consecutive, i.e. inside one node). Rank
    ``i * t + j`` holds slice j of every tensor-parallel weight and the data of row i. ZeRO sees only this rank's
    slices: it shards them, their gradients and optimizer states over the d ranks with the same j (the shard group),
    exactly as plain ZeRO over d ranks would (with ``shard_group_size=k``: over groups of k of them, replicated
    across the d/k groups, as [Note: hybrid sharding and its traffic] with d for N); the tensor group is the
    module's own business (its layers' collectives), except for three things that span both dimensions: the
    gradient norm (see [Note: the norm over both dimensions] in ``amp.py``), Pa (the checkpointed block inputs are
    replicated over the tensor group, so that is the default partition group) and checkpoints (every
    tensor-parallel slice is a piece of its tensor: see [Note: tensor-parallel slices in a checkpoint] in
    ``checkpoints/shards.py``). Traffic over the tensor group counts under the scope ``"tensor"``.
    """
    t = tensor_parallel_size
    if world % t or (world // t) % shard_group_size:
        raise ValueError(f"tensor_parallel_size {t} and shard_group_size {shard_group_size} do not divide the world "
                         f"size {world} into a (data x tensor) mesh with equal shard groups.")
    key = ("tensor", id(dist.group.WORLD), world, t, device_type, shard_group_size)
    if key not in _HYBRID:
        from torch.distributed.device_mesh import init_device_mesh

        d = world // t
        mesh = init_device_mesh(device_type, (d, t), mesh_dim_names=("data_parallel", "tensor_parallel"))
        data, tensor = mesh.get_group("data_parallel"), mesh.get_group("tensor_parallel")
        _SCOPES[id(tensor)] = "tensor"
        if shard_group_size == d:
            _SCOPES[id(data)] = "shard"
            _HYBRID[key] = ShardGroups(shard=data, tensor=tensor, mesh=mesh)
        else:  # hybrid sharding of the data dimension: the lists of hybrid_rank_lists, for each tensor rank j
            shard_lists, replica_lists = hybrid_rank_lists(d, shard_group_size)
            shard = new_group([[i * t + j for i in ranks] for j in range(t) for ranks in shard_lists])
            replicate = new_group([[i * t + j for i in ranks] for j in range(t) for ranks in replica_lists])
            _SCOPES[id(data)], _SCOPES[id(shard)], _SCOPES[id(replicate)] = "data", "shard", "replicate"
            _HYBRID[key] = ShardGroups(shard, replicate, d // shard_group_size, tensor=tensor, mesh=mesh, data=data)
    return _HYBRID[key]


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
