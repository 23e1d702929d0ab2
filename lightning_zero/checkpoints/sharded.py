"""Lightning's checkpoint dict to and from a sharded checkpoint directory: keys, checks, and where loads land.

Keys in the directory: ``model/<state_dict key>`` (a tied weight once, under its first name; ``meta.pt`` maps every
name to it) and ``optimizer/<k>/<canonical index>/<state key>`` for optimizer ``k``. Every check that can refuse a
checkpoint (other model, other optimizers, shapes) runs before anything is written into the model.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.checkpoints.key_match import RENAME, check_coverage, coverage_message, prefix_hint
from lightning_zero.checkpoints.recut import (
    Copy,
    cannot_recut,
    finish,
    saved_cut,
    shard_cut,
    to_saved_layout,
    whole_shape,
)
from lightning_zero.checkpoints.shards import Shard, optimizer_destination, stack_slices
from lightning_zero.checkpoints.storage import FORMAT, KEY, CheckpointError, load_sharded
from lightning_zero.comm import collectives
from lightning_zero.shards.optimizer import ShardedOptimizer

# (shape, dtype name) of a saved tensor, or None for a pickled object
TensorInfo = Optional[tuple[tuple[int, ...], str]]


# ---------------------------------------------------------------------- save
def split_checkpoint(
    checkpoint: dict[str, Any],
    sharded_optimizers: list[ShardedOptimizer],
    info: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Shard], dict[str, Any]]:
    """Cut Lightning's checkpoint dict into DCP objects, this rank's shards, and ``meta.pt`` (complete on rank 0).

    ``checkpoint["state_dict"]`` holds ``Shard`` values (``ZeroStrategy.lightning_module_state_dict``) and each
    of ``checkpoint["optimizer_states"]`` ``{"state": {index: {key: Shard or value}}, "param_groups": [...]}``.
    """
    objects: dict[str, Any] = {}
    shards: dict[str, Shard] = {}
    tensors: dict[str, TensorInfo] = {}
    slices: dict[str, Optional[tuple[int, int]]] = {}
    model: dict[str, str] = {}
    stored: dict[int, str] = {}
    for key, value in checkpoint["state_dict"].items():
        shard = value if isinstance(value, Shard) else Shard.whole(value)
        if id(value) not in stored:
            stored[id(value)] = f"model/{key}"
            _put(f"model/{key}", shard, objects, shards, tensors, slices)
        model[key] = stored[id(value)]
    optimizers = []
    for k, state in enumerate(checkpoint.get("optimizer_states", [])):
        for index, entry in state["state"].items():
            for name, value in entry.items():
                _put(f"optimizer/{k}/{index}/{name}", value, objects, shards, tensors, slices)
        sharded = sharded_optimizers[k]
        optimizers.append(
            {
                "class": type(sharded.optimizer).__qualname__,
                "params": [tuple(p.shape) for p in sharded.canonical],
                "group_sizes": sharded.group_sizes,
                "whole_params": [_whole(p) for p in sharded.canonical],
            }
        )
    every = collectives.gather_objects((tensors, slices))
    meta = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
    if "optimizer_states" in checkpoint:
        meta["optimizer_states"] = [
            {"param_groups": s["param_groups"], "sharded": True} for s in checkpoint["optimizer_states"]
        ]
    meta[KEY] = {
        **info,
        "format": FORMAT,
        "model": model,
        "optimizers": optimizers,
        "tensors": {k: v for part, _ in (every or []) for k, v in part.items()},
        "tensor_parallel": {k: v for _, part in (every or []) for k, v in part.items()},
    }
    return objects, shards, meta


def _whole(param: Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor a parameter is a tensor-parallel slice of (its own shape if it is none)."""
    return Shard.placed(param, param.dtype)[0].full_shape


def _put(
    key: str,
    value: Any,
    objects: dict[str, Any],
    shards: dict[str, Shard],
    tensors: dict[str, TensorInfo],
    slices: dict[str, Optional[tuple[int, int]]],
) -> None:
    if isinstance(value, Tensor):
        value = Shard.whole(value)
    if isinstance(value, Shard):
        tensors[key] = (value.shape, str(value.dtype).removeprefix("torch."))
        if value.local_shape is not None:  # see [Note: tensor-parallel slices in a checkpoint]
            slices[key] = (value.joins_along, value.parts) if value.joins_along is not None else None
        if value.numel:
            shards[key] = value
        else:  # DCP cannot index an empty tensor by pieces: store it as an object
            objects[key] = torch.empty(value.shape, dtype=value.dtype)
    else:
        tensors[key] = None
        objects[key] = value


# ---------------------------------------------------------------------- model
def check_model_keys(
    saved: dict[str, tuple[int, ...]],
    dest: dict[str, Shard],
    strict: bool,
    source: str,
    full: bool = False,
    warn: bool = True,
) -> None:
    """Refuse a checkpoint of another model: shapes must match (``full``: the shapes of whole tensors, as a file in
    ``ddp``'s form has them); with ``strict`` the keys too (as ``nn.Module``); without, at least one key, and fewer
    than half of them warns when ``warn`` (see [Note: a non-strict load says what it skipped])."""
    shape_of = (lambda d: d.full_shape) if full else (lambda d: d.shape)
    mismatched = [
        f"{k}: checkpoint {tuple(saved[k])}, model {shape_of(d)}"
        for k, d in dest.items()
        if k in saved and tuple(saved[k]) != tuple(shape_of(d))
    ]
    missing = [k for k in dest if k not in saved]
    unexpected = [k for k in saved if k not in dest]
    problems = []
    if mismatched:
        problems.append("shape mismatch for " + _some(mismatched))
    if strict and missing:
        problems.append("missing keys " + _some(missing))
    if strict and unexpected:
        problems.append("unexpected keys " + _some(unexpected))
    if problems:
        hint = _keys_hint(saved, dest, mismatched)
        raise CheckpointError(
            f"The checkpoint {source} does not fit this model: "
            + "; ".join(problems)
            + f". It comes from a different model (or another version of it){hint}."
        )
    if not strict:
        check_coverage(saved, dest, source, warn)


def _keys_hint(saved: Collection[str], dest: Collection[str], mismatched: list[str]) -> str:
    """What to do about keys that differ: the prefix that makes them match, else ``strict=False`` where that loads at
    least half of the model."""
    hint = prefix_hint(saved, dest)
    if hint is not None:
        return f"; to load it, {hint}{RENAME}"
    if mismatched or coverage_message(saved, dest, "") is not None:
        return ""
    return "; pass `strict=False` to load the keys both have"


def load_model_from_dir(
    path: Path, meta: dict[str, Any], dest: dict[str, Shard], strict: bool, collective: bool, trusted: bool = False
) -> None:
    """Read the model's tensors from a checkpoint directory into ``dest`` (``model_shards`` of the module); slices
    saved at another tensor-parallel size are re-cut (see [Note: re-cutting tensor-parallel slices on load]).
    ``trusted``: as ``load_sharded``."""
    info = meta[KEY]
    saved = {k: whole_shape(info, stored) for k, stored in info["model"].items()}
    check_model_keys(saved, dest, strict, str(path), full=True)
    rounds: list[dict[str, Shard]] = [{}]
    for key, shard in dest.items():
        if key not in saved:
            continue
        stored = info["model"][key]
        round_ = next((r for r in rounds if stored not in r or r[stored] is shard), None)
        if round_ is None:  # tied in the checkpoint, separate here: read the stored tensor once more
            round_ = {}
            rounds.append(round_)
        round_[stored] = shard
    reads = [{k: to_saved_layout(k, s, info) for k, s in r.items() if s.numel} for r in rounds]  # all before reading
    for read in reads:  # (empty tensors have nothing to read)
        load_sharded(path, {k: shard for k, (shard, _) in read.items()}, None, collective, trusted)
        for _, copies in read.values():
            finish(copies)


def copy_full_state(state_dict: Mapping[str, Any], dest: dict[str, Shard], strict: bool, source: str) -> None:
    """Load a full ``state_dict`` (one file, DDP's form) into ``dest``: each rank copies the pieces it owns."""
    saved = {k: tuple(v.shape) for k, v in state_dict.items() if isinstance(v, Tensor)}
    check_model_keys(saved, dest, strict, source, full=True)
    with torch.no_grad():
        for key, shard in dest.items():
            if key in saved:
                full = stack_slices(state_dict[key], shard).reshape(-1)
                for start, piece in shard.pieces:
                    piece.copy_(full[start : start + piece.numel()])


def check_tensor_parallel(
    info: dict[str, Any], tensor_parallel_size: int, source: str, sharded_optimizers: Sequence[ShardedOptimizer] = ()
) -> None:
    """Refuse a sharded checkpoint written with another tensor-parallel degree if a state in it cannot be re-cut to
    this run's slices (see [Note: re-cutting tensor-parallel slices on load]); ``sharded_optimizers``: the run's,
    whose parameters tell which whole states of a t = 1 checkpoint are slices here. Nothing is read or changed."""
    saved = info.get("tensor_parallel_size", 1)
    if saved == tensor_parallel_size:
        return
    stuck = cannot_recut(info, [sharded.canonical for sharded in sharded_optimizers])
    if stuck:
        raise CheckpointError(
            f"The checkpoint {source} was written with `tensor_parallel_size={saved}` and this run has "
            f"`tensor_parallel_size={tensor_parallel_size}`: its tensor-parallel slices are re-cut on load, but "
            f"{len(stuck)} optimizer state(s) of sliced parameters are not per element ({_some(stuck)}: Adafactor's "
            "factored statistics, for instance) and cannot be re-cut: a slice's statistics are means over its own "
            "rows or columns, and those of another cut are not in the checkpoint. Nothing was loaded. Resume with "
            f"`tensor_parallel_size={saved}`, or consolidate its weights (`lightning-zero consolidate "
            "--weights-only`) and load that file (each rank cuts its slices), starting the optimizer afresh."
        )


# ---------------------------------------------------------------------- optimizers
def optimizer_keys(info: dict[str, Any], k: int) -> dict[tuple[int, str], tuple[str, TensorInfo]]:
    """Optimizer ``k``'s saved entries: ``(canonical index, state key)`` to (directory key, tensor info)."""
    prefix = f"optimizer/{k}/"
    out = {}
    for key, tensor in info["tensors"].items():
        if key.startswith(prefix):
            index, name = key[len(prefix) :].split("/", 1)
            out[(int(index), name)] = (key, tensor)
    return out


def is_stored_as_object(tensor: TensorInfo) -> bool:
    """Pickled values and empty tensors are stored whole, as objects (see ``split_checkpoint``)."""
    return tensor is None or math.prod(tensor[0]) == 0


def check_optimizer_count(saved: int, sharded_optimizers: list[ShardedOptimizer], source: str) -> None:
    if saved != len(sharded_optimizers):
        raise CheckpointError(
            f"The checkpoint {source} holds {saved} optimizer states but `configure_optimizers` returned "
            f"{len(sharded_optimizers)} optimizers. Resume with the same optimizers the checkpoint was trained with."
        )


def load_optimizers_from_dir(
    path: Path,
    meta: dict[str, Any],
    sharded_optimizers: list[ShardedOptimizer],
    collective: bool,
    trusted: bool = False,
) -> None:
    """Read every optimizer's state from a checkpoint directory into the shards this rank owns (``trusted``: as
    ``load_sharded``)."""
    info = meta[KEY]
    states = meta.get("optimizer_states", [])
    check_optimizer_count(len(states), sharded_optimizers, str(path))
    for k, sharded in enumerate(sharded_optimizers):
        check_optimizer_fits(info["optimizers"][k], sharded, str(path), _saved_wholes(info, k))
    shards: dict[str, Shard] = {}
    copies: dict[str, list[Copy]] = {}
    objects: dict[str, Any] = {}
    dests, object_keys = [], []
    for k, sharded in enumerate(sharded_optimizers):
        saved = optimizer_keys(info, k)
        dest = optimizer_destination(
            sharded,
            {
                i: (_shape_here(info, key, sharded.canonical[i[0]], tuple(t[0])), getattr(torch, t[1]))
                for i, (key, t) in saved.items()
                if t is not None and not is_stored_as_object(t)
            },
        )
        for i, shard in dest.shards.items():
            shards[saved[i][0]], copies[saved[i][0]] = to_saved_layout(saved[i][0], shard, info)
        wanted = {sharded.managed[p] for slot in sharded.slots for p, *_ in slot.pieces}
        keys = {i: key for i, (key, t) in saved.items() if is_stored_as_object(t) and i[0] in wanted}
        objects.update({key: None for key in keys.values()})
        dests.append(dest)
        object_keys.append(keys)
    load_sharded(path, shards, objects, collective, trusted)
    for staged in copies.values():
        finish(staged)
    for k, (dest, keys) in enumerate(zip(dests, object_keys)):
        dest.values = {i: objects[key] for i, key in keys.items()}
        dest.install(states[k]["param_groups"])


def _shape_here(info: dict[str, Any], key: str, param: Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a saved optimizer tensor has in this run: a per-element state of a slice saved at another
    tensor-parallel size takes this run's stacked shape (it is re-cut on load); anything else keeps its own."""
    here = Shard.placed(param, param.dtype)[0]
    cut, cut_here = saved_cut(info, key), shard_cut(here)
    whole = cut.whole if cut is not None else shape
    if (cut is not None or cut_here is not None) and whole == here.full_shape:
        return here.shape
    return shape


def check_optimizer_fits(
    saved: dict[str, Any],
    sharded: ShardedOptimizer,
    source: str,
    wholes: Optional[list[Optional[tuple[int, ...]]]] = None,
) -> None:
    """Refuse an optimizer state saved for other param groups or parameters: with ``wholes`` (the saved parameters'
    whole shapes, ``_saved_wholes``) the shapes of the whole tensors their tensor-parallel slices are cut from,
    which any tensor-parallel size shares; where a whole shape is unknown (``None``) the slices' own shapes."""
    if list(saved["group_sizes"]) != sharded.group_sizes:
        raise CheckpointError(
            f"The checkpoint {source} has an optimizer with param groups of sizes {list(saved['group_sizes'])}, but "
            f"{saved['class']} here has {sharded.group_sizes}. Resume with the same model and `configure_optimizers`."
        )
    wholes = wholes if wholes is not None else [None] * len(saved["params"])
    pairs = [
        (tuple(whole), _whole(p)) if whole is not None else (tuple(local), tuple(p.shape))
        for whole, local, p in zip(wholes, saved["params"], sharded.canonical)
    ]
    bad = [f"parameter {i}: checkpoint {a}, model {b}" for i, (a, b) in enumerate(pairs) if a != b]
    if bad:
        raise CheckpointError(
            f"The optimizer state in {source} is for parameters of other shapes ({_some(bad)}); "
            "it comes from a different model."
        )


def _saved_wholes(info: dict[str, Any], k: int) -> list[Optional[tuple[int, ...]]]:
    """Optimizer ``k``'s parameters' whole shapes as saved; a checkpoint that predates the record derives them from
    the states' cuts (``None`` where no state tells: a slice without a per-element state, or a replicated tensor)."""
    saved = info["optimizers"][k]
    if "whole_params" in saved:
        return [tuple(s) for s in saved["whole_params"]]
    wholes: list[Optional[tuple[int, ...]]] = [None] * len(saved["params"])
    for (index, _), (key, _) in optimizer_keys(info, k).items():
        cut = saved_cut(info, key)
        if cut is not None and index < len(wholes):
            wholes[index] = cut.whole
    return wholes


def _some(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(i) if " " not in i else i for i in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
