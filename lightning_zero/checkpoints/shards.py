"""The sharded form of model and optimizer states: what each rank holds of every tensor, for saving and loading.

[Note: every tensor is flat in a sharded checkpoint]
A sharded checkpoint stores each tensor flattened to one dimension, in *pieces*: ranges ``[start, start + n)`` of
the flattened tensor, each written by the rank that owns it. A parameter managed by a storage is written by the
ranks that hold its master pieces (a parameter may span buckets, so one rank can hold several pieces of it); a
tensor every rank holds in full (buffers, frozen parameters) is written once, by rank 0, as one piece. Because
every tensor is a union of 1-D ranges, loading is the same whatever the writer's world size or stage: a rank asks
for the ranges it owns now (or ``[0, numel)`` for a full copy) and reads the overlaps with the saved pieces. The
tensors' shapes travel in the checkpoint's metadata.

The same ``Shard`` objects are sources when saving (views of the master shard and the optimizer state, no
copy) and destinations when loading (views the reader writes into in place), so loading needs no second copy of
the weights.

[Note: tensor-parallel slices in a checkpoint]
Under tensor parallelism (t ranks per tensor group) a parameter marked as a slice (``lightning_zero.tensor_parallel``)
of local shape L is stored as slice j (this rank's tensor rank) of a tensor of shape ``(t, *L)``: its flattened
elements ``[j * numel(L), (j + 1) * numel(L))``, in which the ZeRO pieces of the data dimension fall as usual. So the
checkpoint records both dimensions: the data dimension reshards freely (any number of data-parallel ranks, any
stage), the tensor dimension is re-cut on load (see [Note: re-cutting tensor-parallel slices on load] in
``recut.py``), and the metadata names the dimension each stacked tensor joins along (``tensor_parallel``), so that
``consolidate`` makes the full tensors (``tensor_parallel.join`` of the t slices along it) and a full file loads into a
tensor-parallel model (each rank its slice). A state of a sliced parameter that is not per element (Adafactor's
factored statistics) is stacked the same way but does not join (its dimension is recorded as ``None``). Replicated
tensors are stored as usual; the t ranks of a tensor group write the same pieces of them, which DCP writes once.

Optimizer states follow the canonical numbering of ``full.py``: the index of each parameter in the user's
param groups, per optimizer (a parameter held by two optimizers has a state in each, under each one's index). A state
with one value per element (``exp_avg``) is cut like the parameter; any other value (``step``, Adafactor's factored
statistics) is written whole, by the rank that owns the parameter's first element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.shards.layout import MasterSlot
from lightning_zero.shards.optimizer import ShardedOptimizer
from lightning_zero.shards.store import ShardedStorage
from lightning_zero.tensor_parallel import cut, tensor_parallel_slice


@dataclass
class Shard:
    """Pieces of one flattened tensor held by this rank: ``(start in the flattened tensor, 1-D tensor)``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[tuple[int, Tensor]] = field(default_factory=list)
    local_shape: Optional[tuple[int, ...]] = None
    """Tensor parallelism: the shape of this rank's slice when ``shape`` is ``(t, *local_shape)`` (see
    [Note: tensor-parallel slices in a checkpoint]); ``None`` for an ordinary tensor."""
    joins_along: Optional[int] = None
    """The dimension of ``local_shape`` the stacked slices join along (``None``: they do not join)."""
    parts: int = 1
    """The blocks the joined tensor is made of along that dimension (see ``TensorParallelSlice``)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The shape of the whole tensor: ``shape``, or for joinable tensor-parallel slices the joined shape."""
        if self.local_shape is None or self.joins_along is None:
            return self.shape
        full = list(self.local_shape)
        full[self.joins_along] *= self.shape[0]
        return tuple(full)

    @classmethod
    def placed(
        cls, tensor: Tensor, dtype: torch.dtype, owner: Optional[Tensor] = None, per_element: bool = True
    ) -> tuple["Shard", int]:
        """An empty ``Shard`` for ``tensor`` (a parameter, or a state of the parameter ``owner``) and the offset of this
        rank's slice in it: 0, or for a tensor-parallel slice ``j * numel`` of the stacked tensor."""
        where = tensor_parallel_slice(owner if owner is not None else tensor)
        if where is None or tensor.dim() == 0:  # a scalar (a step count) is the same on every tensor-parallel rank
            return cls(tuple(tensor.shape), dtype), 0
        local = tuple(tensor.shape)
        shard = cls(
            (where.size, *local),
            dtype,
            local_shape=local,
            joins_along=where.dim if per_element else None,
            parts=where.parts,
        )
        return shard, where.rank * math.prod(local)

    @classmethod
    def whole(cls, tensor: Tensor, owner: Optional[Tensor] = None, per_element: bool = True) -> "Shard":
        """All of ``tensor`` as one piece (a view: loading into it writes ``tensor``); a tensor-parallel slice (or
        a state of one, ``owner``) as its slice of the stacked tensor."""
        flat = tensor.detach().reshape(-1)
        if tensor.numel() and flat.data_ptr() != tensor.data_ptr():
            raise ValueError("Shard.whole needs a contiguous tensor to load into in place.")
        shard, base = cls.placed(tensor, tensor.dtype, owner, per_element)
        if tensor.numel():
            shard.pieces.append((base, flat))
        return shard


def model_shards(module: torch.nn.Module, storages: Sequence[ShardedStorage], full_copies: bool) -> dict[str, Shard]:
    """Every entry of ``module.state_dict()`` as this rank's ``Shard`` (see [Note: every tensor is flat ...]).

    Managed parameters give the pieces of their master weights (full precision); every other tensor is one whole
    piece where ``full_copies`` (rank 0 when saving; every rank when loading, where each needs its full copy), and an
    empty ``Shard`` elsewhere.
    Tied parameters map to the same ``Shard`` object under each of their names.
    """
    managed: dict[int, Shard] = {}
    base: dict[int, int] = {}
    for storage in storages:
        for p in storage.params:
            managed[id(p)], base[id(p)] = Shard.placed(p, storage.masters[0].dtype if storage.masters else p.dtype)
        for slot, master in storage.own_masters():  # a parameter held by several optimizers: its owner's pieces
            flat = master.detach().reshape(-1)
            for index, p_start, length, offset in slot.pieces:
                param = storage.params[index]
                managed[id(param)].pieces.append((base[id(param)] + p_start, flat[offset : offset + length]))
    out: dict[str, Shard] = {}
    seen: dict[int, Shard] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in managed:
            out[key] = managed[id(tensor)]
        elif id(tensor) in seen:
            out[key] = seen[id(tensor)]
        else:
            shard = Shard.whole(tensor) if full_copies else Shard.placed(tensor, tensor.dtype)[0]
            out[key] = seen[id(tensor)] = shard
    return out


def stack_slices(tensor: Tensor, shard: Shard) -> Tensor:
    """A whole tensor in the stacked form of ``shard`` (see [Note: tensor-parallel slices in a checkpoint]): its t
    slices along the joined dimension, stacked; any other tensor as it is."""
    if shard.local_shape is None or shard.joins_along is None:
        return tensor
    return torch.stack(cut(tensor, shard.shape[0], shard.joins_along, shard.parts))


def optimizer_shards(sharded: ShardedOptimizer) -> dict[int, dict[str, Any]]:
    """This rank's pieces of the optimizer state, ``{canonical index: {state key: Shard or value}}``.

    Values that are not per-element are kept only by the owner of the parameter's first element.
    """
    out: dict[int, dict[str, Any]] = {}
    bases: dict[tuple[int, str], int] = {}
    for slot, master in zip(sharded.slots, sharded.masters):
        for key, value in sharded.optimizer.state.get(master, {}).items():
            for p, p_start, length, offset in slot.pieces:
                param = sharded.members[p]
                entry = out.setdefault(sharded.managed[p], {})
                if is_per_element(value, slot, param):
                    if key not in entry:
                        entry[key], bases[(p, key)] = Shard.placed(param, value.dtype)
                    piece = value.detach().reshape(-1)[offset : offset + length]
                    entry[key].pieces.append((bases[(p, key)] + p_start, piece))
                elif p_start == 0:
                    entry[key] = Shard.whole(value, param, per_element=False) if isinstance(value, Tensor) else value
    return out


def param_groups(sharded: ShardedOptimizer) -> list[dict[str, Any]]:
    """The param groups' hyperparameters with canonical parameter indices (as ``Optimizer.state_dict()`` has them)."""
    groups, start = [], 0
    for group, size in zip(sharded.optimizer.param_groups, sharded.group_sizes):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + size))})
        start += size
    return groups


# ---------------------------------------------------------------------- loading the optimizer state
@dataclass
class OptimizerDestination:
    """Where a loaded optimizer state lands: ``Shard`` destinations to read, then ``install``."""

    sharded: ShardedOptimizer
    shards: dict[tuple[int, str], Shard] = field(default_factory=dict)
    """``(canonical index, state key)`` to the destination of a tensor value."""
    values: dict[tuple[int, str], Any] = field(default_factory=dict)
    """Non-tensor values, filled in by the reader."""
    slot_states: list[dict[str, Tensor]] = field(default_factory=list)
    """Per master slot, its per-element states (the shards' pieces are views of them)."""
    whole: dict[int, dict[str, Shard]] = field(default_factory=dict)
    """Per canonical index, the states read whole (``step``, factored statistics); also in ``shards``."""

    def install(self, groups: list[dict[str, Any]]) -> None:
        """Hand the read state to the user's optimizer (``Optimizer.load_state_dict``, so dtypes and devices fit).

        A slot's per-element states come from its pieces; its other values (``step``, a factored statistic) from
        the first parameter in it.
        """
        sharded = self.sharded
        whole: dict[int, dict[str, Any]] = {canon: dict(states) for canon, states in self.whole.items()}
        for (canon, key), value in self.values.items():
            whole.setdefault(canon, {}).setdefault(key, value)
        internal: dict[str, Any] = {"state": {}, "param_groups": []}
        slot_index = {id(m): s for s, m in enumerate(sharded.masters)}
        index = 0
        for g, group in enumerate(sharded.optimizer.param_groups):
            ids = []
            for master in group["params"]:
                s = slot_index[id(master)]
                entry: dict[str, Any] = dict(self.slot_states[s])
                first = sharded.managed[sharded.slots[s].pieces[0][0]] if sharded.slots[s].pieces else None
                for key, value in (whole.get(first, {}) if first is not None else {}).items():
                    entry.setdefault(key, _whole_value(value))
                if entry:
                    internal["state"][index] = entry
                ids.append(index)
                index += 1
            internal["param_groups"].append({**{k: v for k, v in groups[g].items() if k != "params"}, "params": ids})
        sharded.optimizer.load_state_dict(internal)


def _whole_value(value: Any) -> Any:
    if not isinstance(value, Shard):
        return value
    shape = value.local_shape if value.local_shape is not None else value.shape
    return value.pieces[0][1].view(shape).clone() if value.pieces else torch.zeros(shape, dtype=value.dtype)


def optimizer_destination(
    sharded: ShardedOptimizer,
    saved: dict[tuple[int, str], tuple[tuple[int, ...], torch.dtype]],
) -> OptimizerDestination:
    """Destinations for the saved optimizer tensors this rank needs: ``saved`` maps ``(canonical index, key)`` to the
    saved shape and dtype. Per-element states are read into slot-shaped tensors, the rest whole."""
    by_param: dict[int, list[tuple[str, tuple[int, ...], torch.dtype]]] = {}
    for (i, key), (shape, dtype) in saved.items():
        by_param.setdefault(i, []).append((key, tuple(shape), dtype))
    dest = OptimizerDestination(sharded, slot_states=[{} for _ in sharded.slots])
    for s, slot in enumerate(sharded.slots):
        for p, p_start, length, offset in slot.pieces:
            canon, param = sharded.managed[p], sharded.members[p]
            placed, base = Shard.placed(param, param.dtype)
            for key, shape, dtype in by_param.get(canon, []):
                if shape == placed.shape and len(shape) > 0:
                    state = dest.slot_states[s].get(key)
                    if state is None:
                        state = dest.slot_states[s][key] = torch.zeros(slot.shape, dtype=dtype)
                    shard = dest.shards.setdefault((canon, key), Shard.placed(param, dtype)[0])
                    shard.pieces.append((base + p_start, state.view(-1)[offset : offset + length]))
                elif (canon, key) not in dest.shards:
                    local = shape[1:] if tensor_parallel_slice(param) is not None and len(shape) > 0 else shape
                    shard = Shard.whole(torch.zeros(local, dtype=dtype), param, per_element=False)
                    dest.shards[(canon, key)] = dest.whole.setdefault(canon, {})[key] = shard
    return dest


def is_per_element(value: Any, slot: MasterSlot, param: Tensor) -> bool:
    """Whether an optimizer state has one entry per element of the master (``exp_avg``), not ``step`` or a factor."""
    return (
        isinstance(value, Tensor)
        and value.dim() > 0
        and value.numel() == math.prod(slot.shape)
        and (len(slot.shape) == 1 or tuple(value.shape) == tuple(param.shape))
    )
