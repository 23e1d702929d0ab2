"""Model and optimizer state between ZeRO's sharded form and the per-parameter form DDP checkpoints use.

[Note: the canonical form]
A checkpoint written by :class:`~lightning_zero.ZeroStrategy` holds exactly what Lightning's ``ddp`` would write:
``state_dict`` with full weights (fp32 masters under mixed precision, so resuming loses nothing) and
``optimizer_states`` in ``torch.optim.Optimizer.state_dict()`` form, keyed by the index of each original parameter
in the user's param groups. Each rank contributes its pieces, rank 0 assembles them; loading slices the pieces a
rank owns back out. Because the form does not depend on the world size, stage or layout, a checkpoint resumes at any
world size and under ``ddp`` too.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero import collectives
from lightning_zero.optimizer import MasterSlot, ShardedOptimizer

# (canonical parameter index, state key or None for the weight, start in the flattened parameter, value)
_Piece = tuple[int, Optional[str], Optional[int], Any]


def full_model_state_dict(module: torch.nn.Module, engines: list[ShardedOptimizer]) -> dict[str, Any]:
    """``module.state_dict()`` with every managed parameter replaced by its full master-precision value.

    Where the masters alias the full working parameters (stages 1 and 2 in ``32-true`` or ``bf16-true``) this is
    ``module.state_dict()``; otherwise (mixed precision, stage 3) the masters are gathered to rank 0 and the other
    ranks get an empty dict.
    """
    if all(engine.master_storage is None for engine in engines):
        return module.state_dict()
    full: dict[int, Tensor] = {}
    for engine in engines:
        weights = _assemble(engine, _collect(engine, include_weights=True, include_state=False))
        if weights is not None:
            full.update({id(engine.canonical[i]): entry[None] for i, entry in weights.items()})
    if collectives.rank() != 0:
        return {}
    state = module.state_dict(keep_vars=True)
    return {key: full[id(value)] if id(value) in full else value.detach() for key, value in state.items()}


def optimizer_state(engine: ShardedOptimizer) -> dict[str, Any]:
    """The optimizer's state in canonical form on rank 0 (see [Note: the canonical form]); ``{}`` elsewhere."""
    assembled = _assemble(engine, _collect(engine, include_weights=False, include_state=True))
    if assembled is None:
        return {}
    groups, start = [], 0
    for group, size in zip(engine.optimizer.param_groups, engine.group_sizes):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + size))})
        start += size
    return {"state": {i: entry for i, entry in sorted(assembled.items()) if entry}, "param_groups": groups}


def load_optimizer_state(engine: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a canonical optimizer state dict into the shard this rank owns."""
    _check_canonical(engine, state_dict)
    optimizer = engine.optimizer
    slot_of = {id(m): s for m, s in zip(engine.masters, engine.slots)}
    internal: dict[str, Any] = {"state": {}, "param_groups": []}
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        saved = state_dict["param_groups"][g]
        ids = []
        for master in group["params"]:
            entry = _slice_state(engine, slot_of[id(master)], state_dict["state"])
            if entry:
                internal["state"][index] = entry
            ids.append(index)
            index += 1
        internal["param_groups"].append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict(internal)


# ---------------------------------------------------------------------- pieces
def _collect(engine: ShardedOptimizer, include_weights: bool, include_state: bool) -> list[_Piece]:
    """This rank's pieces of the master weights and/or optimizer states, on CPU.

    Whole-parameter masters contribute their values as they are (whatever their shape, e.g. Adafactor's factored
    statistics); flat masters contribute the slice of every per-element state that belongs to each parameter.
    """
    pieces: list[_Piece] = []
    for slot, master in zip(engine.slots, engine.masters):
        sources: dict[Optional[str], Any] = {None: master.detach()} if include_weights else {}
        if include_state:
            sources.update(engine.optimizer.state.get(master, {}))
        for key, value in sources.items():
            value = value.detach().cpu() if isinstance(value, Tensor) else value
            for p, p_start, length, offset in slot.pieces:
                canon = engine.managed[p]
                if engine.layout.whole_params or not _per_element(value, master.numel()):
                    pieces.append((canon, key, None, value))
                else:
                    pieces.append((canon, key, p_start, value.reshape(-1)[offset : offset + length]))
    return pieces


def _assemble(engine: ShardedOptimizer, local: list[_Piece]) -> Optional[dict[int, Any]]:
    """Gather every rank's pieces to rank 0 and put them together per canonical parameter.

    Returns ``{canonical index: {key: value}}`` (the weight under key ``None``) on rank 0, ``None`` elsewhere.
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
        param = engine.canonical[canon]
        if key not in entry:
            entry[key] = torch.zeros(param.shape, dtype=value.dtype)
        entry[key].view(-1)[start : start + value.numel()] = value
    return out


def _slice_state(engine: ShardedOptimizer, slot: MasterSlot, canonical: dict[Any, Any]) -> dict[str, Any]:
    """The state of one master tensor, cut out of the canonical per-parameter states."""
    entry: dict[str, Any] = {}
    for p, p_start, length, offset in slot.pieces:
        saved = _saved_state(canonical, engine.managed[p])
        for key, value in saved.items():
            if engine.layout.whole_params or not _per_element(value, engine.params[p].numel()):
                entry[key] = value.clone() if isinstance(value, Tensor) else value
                continue
            if key not in entry:
                entry[key] = torch.zeros(slot.shape, dtype=value.dtype)
            entry[key].view(-1)[offset : offset + length] = value.reshape(-1)[p_start : p_start + length]
    return entry


def _saved_state(canonical: dict[Any, Any], index: int) -> dict[str, Any]:
    # torch.load keeps int keys; a checkpoint that went through JSON-like storage may have str keys.
    return canonical.get(index) or canonical.get(str(index)) or {}


def _per_element(value: Any, numel: int) -> bool:
    """Whether ``value`` is a state with one entry per element (``exp_avg``), not a scalar (``step``)."""
    return isinstance(value, Tensor) and value.dim() > 0 and value.numel() == numel


def _check_canonical(engine: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not isinstance(state_dict.get("state"), dict):
        raise ValueError("The optimizer state in the checkpoint is not a `torch.optim.Optimizer.state_dict()`.")
    sizes = [len(g.get("params", [])) for g in groups]
    if sizes != engine.group_sizes:
        raise ValueError(
            f"The checkpoint's optimizer has param groups of sizes {sizes}, but {type(engine.optimizer).__name__} "
            f"here has {engine.group_sizes}. Resume with the same model and `configure_optimizers`."
        )
    if engine.layout.whole_params:
        return
    for canon, saved in state_dict["state"].items():
        param = engine.canonical[int(canon)]
        for key, value in saved.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.numel() != param.numel():
                raise ValueError(
                    f"Optimizer state '{key}' of parameter {canon} has shape {tuple(value.shape)}, but the parameter "
                    f"has shape {tuple(param.shape)}. The checkpoint comes from a different model."
                )
