"""The sharded form of model and optimizer states: what each rank holds of every tensor, for saving and loading.

[Note: every tensor is flat in a sharded checkpoint]
A sharded checkpoint stores each tensor flattened to one dimension, in *pieces*: ranges ``[start, start + n)`` of
the flattened tensor, each written by the rank that owns it. A parameter managed by an engine is written by the
ranks that hold its master pieces (a parameter may span buckets, so one rank can hold several pieces of it); a
tensor every rank holds in full (buffers, frozen parameters) is written once, by rank 0, as one piece. Because
every tensor is a union of 1-D ranges, loading is the same whatever the writer's world size or stage: a rank asks
for the ranges it owns now (or ``[0, numel)`` for a full copy) and reads the overlaps with the saved pieces. The
tensors' shapes travel in the checkpoint's metadata.

The same :class:`Shard` objects are sources when saving (views of the master shard and the optimizer state, no
copy) and destinations when loading (views the reader writes into in place), so loading needs no second copy of
the weights.

Optimizer states follow the canonical numbering of ``state_dict.py``: the index of each parameter in the user's
param groups. A state with one value per element (``exp_avg``) is cut like the parameter; any other value
(``step``, Adafactor's factored statistics) is written whole, by the rank that owns the parameter's first element.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_zero.optimizer import MasterSlot, ShardedOptimizer


@dataclass
class Shard:
    """Pieces of one flattened tensor held by this rank: ``(start in the flattened tensor, 1-D tensor)``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[tuple[int, Tensor]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @classmethod
    def whole(cls, tensor: Tensor) -> "Shard":
        """All of ``tensor`` as one piece (a view: loading into it writes ``tensor``)."""
        flat = tensor.detach().reshape(-1)
        if tensor.numel() and flat.data_ptr() != tensor.data_ptr():
            raise ValueError("Shard.whole needs a contiguous tensor to load into in place.")
        return cls(tuple(tensor.shape), tensor.dtype, [(0, flat)] if tensor.numel() else [])


def model_shards(module: torch.nn.Module, engines: list[ShardedOptimizer], full_copies: bool) -> dict[str, Shard]:
    """Every entry of ``module.state_dict()`` as this rank's :class:`Shard` (see [Note: every tensor is flat ...]).

    Managed parameters give the pieces of their master weights (full precision); every other tensor is one whole
    piece where ``full_copies`` (rank 0 when saving; every rank when loading, where each needs its full copy), and an
    empty ``Shard`` elsewhere.
    Tied parameters map to the same ``Shard`` object under each of their names.
    """
    managed: dict[int, Shard] = {}
    for engine in engines:
        for j, p in enumerate(engine.params):
            managed[id(p)] = Shard(tuple(p.shape), engine.masters[0].dtype if engine.masters else p.dtype)
        for slot, master in zip(engine.slots, engine.masters):
            flat = master.detach().reshape(-1)
            for p, p_start, length, offset in slot.pieces:
                managed[id(engine.params[p])].pieces.append((p_start, flat[offset : offset + length]))
    out: dict[str, Shard] = {}
    seen: dict[int, Shard] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in managed:
            out[key] = managed[id(tensor)]
        elif id(tensor) in seen:
            out[key] = seen[id(tensor)]
        else:
            shard = Shard.whole(tensor) if full_copies else Shard(tuple(tensor.shape), tensor.dtype)
            out[key] = seen[id(tensor)] = shard
    return out


def optimizer_shards(engine: ShardedOptimizer) -> dict[int, dict[str, Any]]:
    """This rank's pieces of the optimizer state, ``{canonical index: {state key: Shard or value}}``.

    Values that are not per-element are kept only by the owner of the parameter's first element.
    """
    out: dict[int, dict[str, Any]] = {}
    for slot, master in zip(engine.slots, engine.masters):
        for key, value in engine.optimizer.state.get(master, {}).items():
            for p, p_start, length, offset in slot.pieces:
                param = engine.params[p]
                entry = out.setdefault(engine.managed[p], {})
                if _per_element(value, slot, param):
                    shard = entry.setdefault(key, Shard(tuple(param.shape), value.dtype))
                    shard.pieces.append((p_start, value.detach().reshape(-1)[offset : offset + length]))
                elif p_start == 0:
                    entry[key] = Shard.whole(value) if isinstance(value, Tensor) else value
    return out


def param_groups(engine: ShardedOptimizer) -> list[dict[str, Any]]:
    """The param groups' hyperparameters with canonical parameter indices (as ``Optimizer.state_dict()`` has them)."""
    groups, start = [], 0
    for group, size in zip(engine.optimizer.param_groups, engine.group_sizes):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + size))})
        start += size
    return groups


# ---------------------------------------------------------------------- loading the optimizer state
@dataclass
class OptimizerDestination:
    """Where a loaded optimizer state lands: :class:`Shard` destinations to read, then :meth:`install`."""

    engine: ShardedOptimizer
    shards: dict[tuple[int, str], Shard] = field(default_factory=dict)
    """``(canonical index, state key)`` to the destination of a tensor value."""
    values: dict[tuple[int, str], Any] = field(default_factory=dict)
    """Non-tensor values, filled in by the reader."""
    _slot_tensors: dict[tuple[int, str], Tensor] = field(default_factory=dict)

    def install(self, groups: list[dict[str, Any]]) -> None:
        """Hand the read state to the user's optimizer (``Optimizer.load_state_dict``, so dtypes and devices fit)."""
        optimizer, engine = self.engine.optimizer, self.engine
        internal: dict[str, Any] = {"state": {}, "param_groups": []}
        index = 0
        slot_index = {id(m): s for s, m in enumerate(engine.masters)}
        for g, group in enumerate(optimizer.param_groups):
            ids = []
            for master in group["params"]:
                entry = self._slot_state(slot_index[id(master)])
                if entry:
                    internal["state"][index] = entry
                ids.append(index)
                index += 1
            internal["param_groups"].append({**{k: v for k, v in groups[g].items() if k != "params"}, "params": ids})
        optimizer.load_state_dict(internal)

    def _slot_state(self, s: int) -> dict[str, Any]:
        slot = self.engine.slots[s]
        entry = {key: t for (i, key), t in self._slot_tensors.items() if i == s}
        first = self.engine.managed[slot.pieces[0][0]] if slot.pieces else None
        for (canon, key), shard in self.shards.items():
            if canon == first and key not in entry:
                entry[key] = shard.pieces[0][1].view(shard.shape).clone() if shard.pieces else torch.zeros(shard.shape)
        for (canon, key), value in self.values.items():
            if canon == first:
                entry.setdefault(key, value)
        return entry


def optimizer_destination(engine: ShardedOptimizer, saved: dict[tuple[int, str], tuple[tuple[int, ...], torch.dtype]],
                          ) -> OptimizerDestination:
    """Destinations for the saved optimizer tensors this rank needs: ``saved`` maps ``(canonical index, key)`` to the
    saved shape and dtype. Per-element states are read into slot-shaped tensors, the rest whole."""
    dest = OptimizerDestination(engine)
    for s, slot in enumerate(engine.slots):
        for p, p_start, length, offset in slot.pieces:
            canon, param = engine.managed[p], engine.params[p]
            for (i, key), (shape, dtype) in saved.items():
                if i != canon:
                    continue
                if tuple(shape) == tuple(param.shape) and len(shape) > 0:
                    slot_tensor = dest._slot_tensors.get((s, key))
                    if slot_tensor is None:
                        slot_tensor = dest._slot_tensors[(s, key)] = torch.zeros(slot.shape, dtype=dtype)
                    shard = dest.shards.setdefault((i, key), Shard(tuple(shape), dtype))
                    shard.pieces.append((p_start, slot_tensor.view(-1)[offset : offset + length]))
                elif (i, key) not in dest.shards:
                    dest.shards[(i, key)] = Shard.whole(torch.zeros(shape, dtype=dtype))
    return dest


def _per_element(value: Any, slot: MasterSlot, param: Tensor) -> bool:
    """Whether an optimizer state has one entry per element of the master (``exp_avg``), not ``step`` or a factor."""
    return isinstance(value, Tensor) and value.dim() > 0 and value.numel() == _numel(slot.shape) and (
        len(slot.shape) == 1 or tuple(value.shape) == tuple(param.shape)
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
