"""Lightning's checkpoint dict to and from a sharded checkpoint directory: keys, checks, and where loads land.

Keys in the directory: ``model/<state_dict key>`` (a tied weight once, under its first name; ``meta.pt`` maps every
name to it) and ``optimizer/<k>/<canonical index>/<state key>`` for optimizer ``k``. Every check that can refuse a
checkpoint (other model, other optimizers, shapes) runs before anything is written into the model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.core import collectives
from lightning_zero.checkpoints.storage import FORMAT, KEY, CheckpointError, load_sharded
from lightning_zero.core.optimizer import ShardedOptimizer
from lightning_zero.checkpoints.shards import Shard, optimizer_destination, stack_slices

# (shape, dtype name) of a saved tensor, or None for a pickled object
TensorInfo = Optional[tuple[tuple[int, ...], str]]


# ---------------------------------------------------------------------- save
def split_checkpoint(checkpoint: dict[str, Any], sharded_optimizers: list[ShardedOptimizer], info: dict[str, Any],
                     ) -> tuple[dict[str, Any], dict[str, Shard], dict[str, Any]]:
    """Cut Lightning's checkpoint dict into DCP objects, this rank's shards, and ``meta.pt`` (complete on rank 0).

    ``checkpoint["state_dict"]`` holds :class:`Shard` values (``ZeroStrategy.lightning_module_state_dict``) and each
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
        optimizers.append({"class": type(sharded.optimizer).__qualname__,
                           "params": [tuple(p.shape) for p in sharded.canonical], "group_sizes": sharded.group_sizes})
    every = collectives.gather_objects((tensors, slices))
    meta = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
    if "optimizer_states" in checkpoint:
        meta["optimizer_states"] = [{"param_groups": s["param_groups"], "sharded": True}
                                    for s in checkpoint["optimizer_states"]]
    meta[KEY] = {**info, "format": FORMAT, "model": model, "optimizers": optimizers,
                 "tensors": {k: v for part, _ in (every or []) for k, v in part.items()},
                 "tensor_parallel": {k: v for _, part in (every or []) for k, v in part.items()}}
    return objects, shards, meta


def _put(key: str, value: Any, objects: dict[str, Any], shards: dict[str, Shard], tensors: dict[str, TensorInfo],
         slices: dict[str, Optional[tuple[int, int]]]) -> None:
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
def check_model_keys(saved: dict[str, tuple[int, ...]], dest: dict[str, Shard], strict: bool, source: str,
                     full: bool = False) -> None:
    """Refuse a checkpoint of another model: shapes must match (``full``: the shapes of whole tensors, as a file in
    ``ddp``'s form has them); with ``strict`` the keys too (as ``nn.Module``)."""
    shape_of = (lambda d: d.full_shape) if full else (lambda d: d.shape)
    mismatched = [f"{k}: checkpoint {tuple(saved[k])}, model {shape_of(d)}" for k, d in dest.items()
                  if k in saved and tuple(saved[k]) != tuple(shape_of(d))]
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
        hint = "" if mismatched else "; pass `strict=False` to load the keys both have"
        raise CheckpointError(f"The checkpoint {source} does not fit this model: " + "; ".join(problems) +
                              f". It comes from a different model (or another version of it){hint}.")


def load_model_from_dir(path: Path, meta: dict[str, Any], dest: dict[str, Shard], strict: bool,
                        collective: bool) -> None:
    """Read the model's tensors from a checkpoint directory into ``dest`` (``model_shards`` of the module)."""
    info = meta[KEY]
    saved = {k: tuple(info["tensors"][stored][0]) for k, stored in info["model"].items()}
    check_model_keys(saved, dest, strict, str(path))
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
    for round_ in rounds:  # (empty tensors have nothing to read)
        load_sharded(path, {k: s for k, s in round_.items() if s.numel}, None, collective)


def copy_full_state(state_dict: dict[str, Any], dest: dict[str, Shard], strict: bool, source: str) -> None:
    """Load a full ``state_dict`` (one file, DDP's form) into ``dest``: each rank copies the pieces it owns."""
    saved = {k: tuple(v.shape) for k, v in state_dict.items() if isinstance(v, Tensor)}
    check_model_keys(saved, dest, strict, source, full=True)
    with torch.no_grad():
        for key, shard in dest.items():
            if key in saved:
                full = stack_slices(state_dict[key], shard).reshape(-1)
                for start, piece in shard.pieces:
                    piece.copy_(full[start : start + piece.numel()])


def check_tensor_parallel(info: dict[str, Any], tensor_parallel_size: int, source: str) -> None:
    """Refuse a sharded checkpoint written with another tensor-parallel degree (its slices are of other sizes)."""
    saved = info.get("tensor_parallel_size", 1)
    if saved != tensor_parallel_size:
        raise CheckpointError(
            f"The checkpoint {source} was written with `tensor_parallel_size={saved}` and this run has "
            f"`tensor_parallel_size={tensor_parallel_size}`: its tensor-parallel slices are of other sizes. Resume "
            f"with `tensor_parallel_size={saved}` (any number of data-parallel ranks and any stage work), or "
            "consolidate it into one file (`lightning-zero consolidate`) and load that (weights and optimizer state "
            "are sliced for this run).")


# ---------------------------------------------------------------------- optimizers
def optimizer_keys(info: dict[str, Any], k: int) -> dict[tuple[int, str], tuple[str, TensorInfo]]:
    """Optimizer ``k``'s saved entries: ``(canonical index, state key)`` to (directory key, tensor info)."""
    prefix = f"optimizer/{k}/"
    out = {}
    for key, tensor in info["tensors"].items():
        if key.startswith(prefix):
            index, name = key[len(prefix):].split("/", 1)
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


def load_optimizers_from_dir(path: Path, meta: dict[str, Any], sharded_optimizers: list[ShardedOptimizer],
                             collective: bool) -> None:
    """Read every optimizer's state from a checkpoint directory into the shards this rank owns."""
    info = meta[KEY]
    states = meta.get("optimizer_states", [])
    check_optimizer_count(len(states), sharded_optimizers, str(path))
    for k, sharded in enumerate(sharded_optimizers):
        check_optimizer_fits(info["optimizers"][k], sharded, str(path))
    shards: dict[str, Shard] = {}
    objects: dict[str, Any] = {}
    dests, object_keys = [], []
    for k, sharded in enumerate(sharded_optimizers):
        saved = optimizer_keys(info, k)
        dest = optimizer_destination(sharded, {i: (tuple(t[0]), getattr(torch, t[1])) for i, (_, t) in saved.items()
                                              if not is_stored_as_object(t)})
        shards.update({saved[i][0]: s for i, s in dest.shards.items()})
        wanted = {sharded.managed[p] for slot in sharded.slots for p, *_ in slot.pieces}
        keys = {i: key for i, (key, t) in saved.items() if is_stored_as_object(t) and i[0] in wanted}
        objects.update({key: None for key in keys.values()})
        dests.append(dest)
        object_keys.append(keys)
    load_sharded(path, shards, objects, collective)
    for k, (dest, keys) in enumerate(zip(dests, object_keys)):
        dest.values = {i: objects[key] for i, key in keys.items()}
        dest.install(states[k]["param_groups"])


def check_optimizer_fits(saved: dict[str, Any], sharded: ShardedOptimizer, source: str) -> None:
    """Refuse an optimizer state saved for other param groups or parameters."""
    if list(saved["group_sizes"]) != sharded.group_sizes:
        raise CheckpointError(
            f"The checkpoint {source} has an optimizer with param groups of sizes {list(saved['group_sizes'])}, but "
            f"{saved['class']} here has {sharded.group_sizes}. Resume with the same model and `configure_optimizers`."
        )
    shapes = [tuple(p.shape) for p in sharded.canonical]
    bad = [f"parameter {i}: checkpoint {tuple(a)}, model {b}" for i, (a, b) in enumerate(zip(saved["params"], shapes))
           if tuple(a) != b]
    if bad:
        raise CheckpointError(f"The optimizer state in {source} is for parameters of other shapes ({_some(bad)}); "
                              "it comes from a different model.")


def _some(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(i) if " " not in i else i for i in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
