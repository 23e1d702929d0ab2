"""Which ranks talk to which: the sizes of a job's shard and secondary groups (resolved from the options), the
process groups one engine shards over, replicates across and (under tensor parallelism) leaves to the module, and how
each group's traffic is counted. Every collective still goes through ``collectives.py``.

[Note: hybrid sharding and its traffic]
With ``shard_group_size=k`` (k divides N; ``"node"``: a node's devices) the N ranks form N/k *shard groups* of k
consecutive ranks and k *replica groups* of R = N/k ranks (the ranks with the same position in every shard group); see
``make_shard_groups``. Model states are sharded over the shard group exactly as over N ranks without hybrid
sharding and are replicated across the replica group. Per step and per rank, with Ψ the (padded) parameter count,
the counters count (logical payload, see [Note: what the counters count] in ``traffic.py``):

- inside the shard group (scope ``"shard"``): reduce-scatter Ψ, all-gather Ψ (stages 1-2: the updated params; stage 3:
  twice, forward and backward, less the unit forward ran last, which backward finds gathered), i.e. 2Ψ or 3Ψ as in
  the paper's table with k in place of N. A ring moves (k-1)/k of each payload per rank: 2Ψ(k-1)/k or 3Ψ(k-1)/k
  elements on the wire.
- across shard groups (scope ``"replicate"``): one all-reduce of each reduced bucket chunk, Ψ/k elements in all
  (the gradient shard). A ring all-reduce moves 2(Ψ/k)(R-1)/R elements per rank.

Only the second term crosses nodes when k is the node size. Collectives over the whole job (loss-scale overflow,
signal agreement, checkpoints) count under ``"world"``. Without hybrid sharding the shard group *is* the world and
everything counts under ``"world"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from lightning_zero.comm import collectives
from lightning_zero.comm.traffic import Group, Traffic

_COUNTED = ("shard", "replicate", "tensor", "data", "secondary")
"""The fields of ``ShardGroups`` that hold a process group; each counts under its own name as scope (``shard``
made with ``None``, the world, under ``"world"``)."""


@dataclass(frozen=True, eq=False)
class ShardGroups:
    """The communication object of one engine: the process groups it shards over, replicates across and (under tensor
    parallelism) leaves to the module, and the ``Traffic`` their collectives
    count into (see [Note: hybrid sharding and its traffic] and [Note: counted groups] in ``traffic.py``).

    Made with process groups (or ``None``); each field then holds a counted
    ``Group`` over that process group, which every function of
    ``collectives.py`` takes as its ``group``. The default (``ShardGroups()``) is plain ZeRO: the whole world
    shards (``shard`` counts under ``"world"``), nothing replicates.
    """

    shard: Any = None
    """The group model states are sharded over (reduce-scatter, all-gather, clipping norm); made with ``None``: the
    world."""
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
    secondary: Optional[Any] = None
    """hpZ: the in-node group of ``secondary_shard_group_size`` consecutive ranks over which stage 3 keeps a
    secondary copy of each unit for backward's re-gather (see [Note: hpZ, the secondary partition] in
    ``stage3/secondary.py``); ``None``: off."""
    traffic: Traffic = field(default_factory=Traffic)
    """What the collectives over these groups moved, by kind and scope; tests and benchmarks reset and read it
    around the steps they measure (a strategy's ``traffic`` is this object; a plain loop reads
    ``engine.shard_groups.traffic``)."""

    def __post_init__(self) -> None:
        for name in _COUNTED:
            group = getattr(self, name)
            if isinstance(group, Group):
                group = group.process_group
            if group is not None or name == "shard":
                scope = name if group is not None else "world"
                object.__setattr__(self, name, Group(group, scope, self.traffic))

    @property
    def world(self) -> Group:
        """The default group, counted under ``"world"`` (the loss-scale overflow check, the signal agreement)."""
        return Group(None, "world", self.traffic)

    @property
    def first_replica(self) -> bool:
        """Whether this rank is the replica that writes its shard's pieces of a checkpoint (position 0 of
        ``replicate``, i.e. in the first shard group)."""
        return self.replicate is None or collectives.rank(self.replicate) == 0

    @property
    def tensor_size(self) -> int:
        """t, the tensor-parallel degree (1 without tensor parallelism)."""
        return collectives.world_size(self.tensor) if self.tensor is not None else 1

    @property
    def data_group(self) -> Group:
        """The ranks that must start from the same weights (the world); under tensor parallelism the data-parallel
        group, since the tensor-parallel ranks hold different slices."""
        if self.tensor is None:
            return self.world
        return self.data if self.data is not None else self.shard

    @property
    def data_source(self) -> int:
        """The global rank whose weights ``data_group`` starts from (its first rank)."""
        group = self.data_group
        return collectives.global_rank(group, 0) if group.process_group is not None else 0


def make_shard_groups(
    shard_group_size: int,
    tensor_parallel_size: int = 1,
    device_type: str = "cpu",
    secondary_shard_group_size: Optional[int] = None,
) -> ShardGroups:
    """Collective: the ``ShardGroups`` of this rank for shard groups of ``shard_group_size`` ranks, or, with
    ``tensor_parallel_size > 1``, for ZeRO over the data dimension of a (data x tensor) mesh; a new object (its own
    counters) on every call.

    Every rank makes every group, in the same order (shard groups, then replica groups), as ``dist.new_group``
    requires; the process groups are made once per default process group and size (a second ``fit`` reuses them:
    see [Note: process groups are made once per job] in ``collectives.py``). A group size equal to the world size is
    plain ZeRO and makes no group. ``secondary_shard_group_size`` s (hpZ, plain ZeRO only: the config refuses it
    with hybrid sharding and tensor parallelism) adds the groups of s consecutive ranks as ``secondary``.
    """
    world = collectives.world_size()
    if tensor_parallel_size > 1:
        return _tensor_parallel_groups(world, tensor_parallel_size, device_type, shard_group_size)
    if shard_group_size == world:
        return ShardGroups(secondary=_secondary_group(world, secondary_shard_group_size))

    def make() -> tuple[Any, Any]:
        shard_lists, replica_lists = hybrid_rank_lists(world, shard_group_size)
        return collectives.new_group(shard_lists), collectives.new_group(replica_lists)

    shard, replicate = collectives.job_group(("hybrid", world, shard_group_size), make)
    return ShardGroups(shard, replicate, world // shard_group_size)


def _secondary_group(world: int, size: Optional[int]) -> Optional[Any]:
    """hpZ's group of this rank: ``size`` consecutive ranks (one node's when ``size`` is its device count), made once
    per job; ``None`` when ``size`` is ``None``."""
    if size is None:
        return None
    return collectives.job_group(
        ("secondary", world, size), lambda: collectives.new_group(hybrid_rank_lists(world, size)[0])
    )


def _tensor_parallel_groups(
    world: int, tensor_parallel_size: int, device_type: str, shard_group_size: int
) -> ShardGroups:
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
        raise ValueError(
            f"tensor_parallel_size {t} and shard_group_size {shard_group_size} do not divide the world "
            f"size {world} into a (data x tensor) mesh with equal shard groups."
        )
    d = world // t

    def make() -> tuple[Any, ...]:
        mesh = collectives.device_mesh(device_type, (d, t), ("data_parallel", "tensor_parallel"))
        data, tensor = mesh.get_group("data_parallel"), mesh.get_group("tensor_parallel")
        if shard_group_size == d:
            return mesh, data, tensor, None, None
        # hybrid sharding of the data dimension: the lists of hybrid_rank_lists, for each tensor rank j
        shard_lists, replica_lists = hybrid_rank_lists(d, shard_group_size)
        shard = collectives.new_group([[i * t + j for i in ranks] for j in range(t) for ranks in shard_lists])
        replicate = collectives.new_group([[i * t + j for i in ranks] for j in range(t) for ranks in replica_lists])
        return mesh, data, tensor, shard, replicate

    mesh, data, tensor, shard, replicate = collectives.job_group(
        ("tensor", world, t, device_type, shard_group_size), make
    )
    if shard is None:
        return ShardGroups(shard=data, tensor=tensor, mesh=mesh)
    return ShardGroups(shard, replicate, d // shard_group_size, tensor=tensor, mesh=mesh, data=data)


def resolve_shard_group_size(
    configured: Optional[Union[int, Literal["node"]]],
    world_size: int,
    devices_per_node: int,
    num_nodes: int,
    tensor_parallel_size: int = 1,
) -> int:
    """The shard group size of a job: ``configured`` (a number of ranks, or ``"node"``: one node's devices), by
    default the whole world (the paper's N, whatever ``num_nodes`` is); with tensor parallelism the data-parallel
    size, ``"node"`` then being one node's data-parallel rows. Raises a ``ValueError`` if it does not divide
    ``world_size`` (the data-parallel size)."""
    t = tensor_parallel_size
    if t > 1:
        if world_size % t:
            raise ValueError(
                f"`tensor_parallel_size={t}` does not divide the world size {world_size} ({num_nodes} "
                f"node(s) x {devices_per_node} device(s)): the ranks must form a (data x tensor) mesh. "
                f"Pick one of {_divisors(world_size)} (e.g. the devices per node)."
            )
        d = world_size // t
        if configured == "node":
            if devices_per_node % t:
                raise ValueError(
                    f"`shard_group_size='node'` with `tensor_parallel_size={t}` needs whole tensor "
                    f"groups inside a node, but a node has {devices_per_node} device(s). Pick a "
                    f"`tensor_parallel_size` that divides {devices_per_node}, or a number of ranks."
                )
            configured = devices_per_node // t
        if configured is not None and (configured < 1 or d % configured):
            raise ValueError(
                f"`shard_group_size={configured}` does not divide the data-parallel size {d} (world "
                f"size {world_size} / `tensor_parallel_size={t}`): with tensor parallelism the shard "
                f"groups split the data dimension. Pick one of {_divisors(d)}, or leave it out (all {d})."
            )
        return configured if configured is not None else d
    k = devices_per_node if configured == "node" else configured if configured is not None else world_size
    assert isinstance(k, int)
    if k < 1 or world_size % k:
        raise ValueError(
            f"`shard_group_size={k}` does not divide the world size {world_size} ({num_nodes} node(s) x "
            f"{devices_per_node} device(s)): the ranks must split into equal shard groups. Pick one of "
            f"{_divisors(world_size)}, or 'node' (the devices per node), or leave it out (all ranks)."
        )
    return k


def resolve_secondary_group_size(configured: Optional[int], world_size: int, shard_group_size: int) -> Optional[int]:
    """hpZ's group size of a job (``None``: off). Raises a ``ValueError`` if it does not divide ``world_size``, or
    if the job shards over groups smaller than the world (hybrid sharding, ``shard_group_size``)."""
    if configured is None:
        return None
    if world_size % configured:
        raise ValueError(
            f"`secondary_shard_group_size={configured}` does not divide the world size {world_size}: the "
            f"ranks must split into equal secondary groups. Pick one of {_divisors(world_size)} (e.g. "
            "the devices per node), or leave it out."
        )
    if shard_group_size != world_size:
        raise ValueError(
            f"`secondary_shard_group_size` (hpZ) needs stage 3 sharded over all {world_size} ranks, but "
            f"this job shards over groups of {shard_group_size} (hybrid sharding), which already keeps the "
            "all-gathers inside them. Leave `shard_group_size` out (all ranks), or leave "
            "`secondary_shard_group_size` out."
        )
    return configured


@dataclass(frozen=True)
class GroupSizes:
    """The sizes of a job's groups, resolved once from the options and the world, then handed down (as torchtitan's
    ``ParallelDims``): the engine without Lightning resolves them over the world it finds, the strategies over their
    nodes and devices before any process starts; ``make`` turns them into one engine's ``ShardGroups``.

    [Note: the group sizes are resolved in one place]
    ``shard_group_size="node"``, tensor parallelism and hpZ all change what the shard group is; every caller gets
    its sizes from ``resolve`` (the strategies to refuse a bad size before launching, the engine when it is
    given no groups), so the rules and their errors are written once.
    """

    world: int
    """N, every rank of the job."""
    shard: int
    """k, the ranks each model state is sharded over (N, or the data-parallel size, without hybrid sharding)."""
    tensor: int
    """t, the tensor-parallel degree (1: none)."""
    secondary: Optional[int]
    """hpZ's secondary group size (``None``: off)."""

    @classmethod
    def resolve(
        cls,
        shard_group_size: Optional[Union[int, Literal["node"]]],
        tensor_parallel_size: int,
        secondary_shard_group_size: Optional[int],
        world_size: int,
        devices_per_node: int,
        num_nodes: int,
    ) -> GroupSizes:
        """The sizes of the options over ``num_nodes`` nodes of ``devices_per_node`` ranks (``world_size`` in all);
        raises a ``ValueError`` naming the sizes that would fit for a size that does not divide."""
        shard = resolve_shard_group_size(
            shard_group_size, world_size, devices_per_node, num_nodes, tensor_parallel_size
        )
        secondary = resolve_secondary_group_size(secondary_shard_group_size, world_size, shard)
        return cls(world_size, shard, tensor_parallel_size, secondary)

    def make(self, device_type: str) -> ShardGroups:
        """Collective: this rank's ``ShardGroups`` (see ``make_shard_groups``)."""
        return make_shard_groups(self.shard, self.tensor, device_type, self.secondary)


def _divisors(n: int) -> list[int]:
    """The group sizes ``n`` ranks split into evenly (what an error about a size that does not divide offers)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def hybrid_rank_lists(world_size: int, shard_group_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The shard groups and replica groups of hybrid sharding, as lists of global ranks.

    Shard group ``g`` is the ``shard_group_size`` consecutive ranks ``g*k .. g*k + k - 1`` (one node when ``k`` is
    the devices per node, since launchers number a node's ranks consecutively); replica group ``i`` holds the ranks
    at position ``i`` of every shard group. ``shard_group_size`` must divide ``world_size``.
    """
    k = shard_group_size
    if k < 1 or world_size % k:
        raise ValueError(f"shard_group_size {k} does not divide the world size {world_size}.")
    shards = [list(range(g * k, (g + 1) * k)) for g in range(world_size // k)]
    replicas = [list(range(i, world_size, k)) for i in range(k)]
    return shards, replicas
