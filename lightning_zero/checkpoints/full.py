"""Model and optimizer state between ZeRO's sharded form and the per-parameter form DDP checkpoints use.

[Note: the canonical form]
A checkpoint written by ``ZeroStrategy`` holds exactly what Lightning's ``ddp`` would write:
``state_dict`` with full weights (fp32 masters under mixed precision, so resuming loses nothing) and
``optimizer_states`` in ``torch.optim.Optimizer.state_dict()`` form, keyed by the index of each original parameter
in the user's param groups. Each rank contributes its pieces, rank 0 assembles them; loading slices the pieces a
rank owns back out. Because the form does not depend on the world size, stage or layout, a checkpoint resumes at any
world size and under ``ddp`` too.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.checkpoints.shards import Shard, is_per_element, optimizer_destination, param_groups, stack_slices
from lightning_zero.comm import collectives
from lightning_zero.shards.layout import MasterSlot
from lightning_zero.shards.optimizer import ShardedOptimizer
from lightning_zero.shards.store import ShardedStorage

# (canonical parameter index, state key or None for the weight, start in the flattened parameter, value)
_Piece = tuple[int, Optional[str], Optional[int], Any]


def full_model_state_dict(module: torch.nn.Module, storages: Sequence[ShardedStorage]) -> dict[str, Any]:
    """``module.state_dict()`` with every managed parameter replaced by its full master-precision value.

    Where the masters alias the full working parameters (stages 1 and 2 in ``32-true`` or ``bf16-true``) this is
    ``module.state_dict()``; otherwise (mixed precision, stage 3) the masters are gathered to rank 0 and the other
    ranks get an empty dict.
    """
    if all(storage.master_storage is None for storage in storages):
        return module.state_dict()
    full: dict[int, Tensor] = {}
    for storage in storages:
        weights = _assemble(storage.params, _collect_weights(storage))
        if weights is not None:
            full.update({id(storage.params[j]): entry[None] for j, entry in weights.items()})
    if collectives.rank() != 0:
        return {}
    state = module.state_dict(keep_vars=True)
    return {key: full[id(value)] if id(value) in full else value.detach() for key, value in state.items()}


def optimizer_state(sharded: ShardedOptimizer) -> dict[str, Any]:
    """The optimizer's state in canonical form on rank 0 (see [Note: the canonical form]); ``{}`` elsewhere."""
    assembled = _assemble(sharded.canonical, _collect(sharded))
    if assembled is None:
        return {}
    return {
        "state": {i: entry for i, entry in sorted(assembled.items()) if entry},
        "param_groups": param_groups(sharded),
    }


def load_optimizer_state(sharded: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a canonical optimizer state dict into the shard this rank owns: the pieces of its parameters are copied
    into the same destinations a sharded checkpoint is read into (``shards.optimizer_destination``)."""
    _check_canonical(sharded, state_dict)
    entries = {
        (int(i), key): _as_slices(sharded.canonical[int(i)], value)
        for i, entry in state_dict["state"].items()
        for key, value in entry.items()
    }
    dest = optimizer_destination(
        sharded, {k: (tuple(v.shape), v.dtype) for k, v in entries.items() if isinstance(v, Tensor)}
    )
    with torch.no_grad():
        for k, shard in dest.shards.items():
            full = entries[k].reshape(-1)
            for start, piece in shard.pieces:
                piece.copy_(full[start : start + piece.numel()])
    dest.values = {k: v for k, v in entries.items() if not isinstance(v, Tensor)}
    dest.install(state_dict["param_groups"])


def _as_slices(param: Tensor, value: Any) -> Any:
    """A whole per-element state of a tensor-parallel slice ``param`` in the stacked form its shards read from (see
    [Note: tensor-parallel slices in a checkpoint] in ``shards.py``); anything else as it is."""
    placed = Shard.placed(param, param.dtype)[0]
    if placed.local_shape is not None and isinstance(value, Tensor) and tuple(value.shape) == placed.full_shape:
        return stack_slices(value, placed)
    return value


# ---------------------------------------------------------------------- pieces
def _collect_weights(storage: ShardedStorage) -> list[_Piece]:
    """This rank's pieces of the master weights of ``storage``, on CPU, keyed by the index in ``storage.params``."""
    pieces: list[_Piece] = []
    for slot, master in storage.own_masters():
        value = master.detach().cpu()
        pieces.extend(_pieces(value, slot, None, storage.params, list(range(len(storage.params)))))
    return pieces


def _pieces(
    value: Any, slot: MasterSlot, key: Optional[str], members: Sequence[Tensor], canonical: Sequence[int]
) -> list[_Piece]:
    """``value`` (a master or one of its states) cut into the pieces of ``slot``'s parameters."""
    out: list[_Piece] = []
    for p, p_start, length, offset in slot.pieces:
        if not is_per_element(value, slot, members[p]):
            out.append((canonical[p], key, None, value))
        else:
            out.append((canonical[p], key, p_start, value.reshape(-1)[offset : offset + length]))
    return out


def _collect(sharded: ShardedOptimizer) -> list[_Piece]:
    """This rank's pieces of the optimizer states, on CPU.

    Whole-parameter masters contribute their values as they are (whatever their shape, e.g. Adafactor's factored
    statistics); flat masters contribute the slice of every per-element state that belongs to each parameter.
    """
    pieces: list[_Piece] = []
    for slot, master in zip(sharded.slots, sharded.masters):
        for key, value in sharded.optimizer.state.get(master, {}).items():
            value = value.detach().cpu() if isinstance(value, Tensor) else value
            pieces.extend(_pieces(value, slot, key, sharded.members, sharded.managed))
    return pieces


def _assemble(params: Sequence[Tensor], local: list[_Piece]) -> Optional[dict[int, Any]]:
    """Gather every rank's pieces to rank 0 and put them together per parameter (``params[index]``).

    Returns ``{index: {key: value}}`` (the weight under key ``None``) on rank 0, ``None`` elsewhere.
    """
    gathered = collectives.gather_objects(local)
    if gathered is None:
        return None
    out: dict[int, dict[Optional[str], Any]] = {}
    for canon, key, start, value in (piece for pieces in gathered for piece in pieces):
        entry = out.setdefault(canon, {})
        if start is None:
            entry[key] = value
            continue
        param = params[canon]
        if key not in entry:
            entry[key] = torch.zeros(param.shape, dtype=value.dtype)
        entry[key].view(-1)[start : start + value.numel()] = value
    return out


def _check_canonical(sharded: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not isinstance(state_dict.get("state"), dict):
        raise ValueError("The optimizer state in the checkpoint is not a `torch.optim.Optimizer.state_dict()`.")
    sizes = [len(g.get("params", [])) for g in groups]
    if sizes != sharded.group_sizes:
        raise ValueError(
            f"The checkpoint's optimizer has param groups of sizes {sizes}, but {type(sharded.optimizer).__name__} "
            f"here has {sharded.group_sizes}. Resume with the same model and `configure_optimizers`."
        )
    if sharded.layout.whole_params:
        return
    for canon, saved in state_dict["state"].items():
        param = sharded.canonical[int(canon)]
        whole = math.prod(Shard.placed(param, param.dtype)[0].full_shape)  # a tensor-parallel slice's whole tensor
        for key, value in saved.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.numel() not in (param.numel(), whole):
                raise ValueError(
                    f"Optimizer state '{key}' of parameter {canon} has shape {tuple(value.shape)}, but the parameter "
                    f"has shape {tuple(param.shape)}. The checkpoint comes from a different model."
                )
