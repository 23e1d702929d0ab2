"""Sharded checkpoints outside of training: one standard file, a summary, the checkpoint in ``ddp``'s form.

Everything here runs in one plain process (no process group needed) and reads the directory with
``torch.distributed.checkpoint`` straight into preallocated full tensors, so the peak memory is about the size of
what is produced: the output file's tensors for ``consolidate``. Building a LightningModule from a checkpoint
(``load_from_checkpoint``) and ``ZeroCheckpointIO`` are the Trainer's side: ``lightning/trainer/checkpoint_io.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_zero.checkpoints.export import PRETRAINED
from lightning_zero.checkpoints.sharded import is_stored_as_object, optimizer_keys
from lightning_zero.checkpoints.shards import Shard
from lightning_zero.checkpoints.storage import (
    KEY,
    META_FILE,
    CheckpointError,
    check_files,
    load_sharded,
    read_meta,
    save_file,
)
from lightning_zero.checkpoints.trust import torch_load
from lightning_zero.tensor_parallel import join

_PATH = Union[str, "os.PathLike[str]"]
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def load_full_checkpoint(
    path: _PATH,
    weights_only: bool = False,
    dtype: Optional[torch.dtype] = None,
    verify: bool = True,
    trust_code: bool = False,
) -> dict[str, Any]:
    """A sharded checkpoint directory as the dict ``ddp`` would have saved (``state_dict`` with full tensors,
    ``optimizer_states`` per parameter unless ``weights_only``). ``dtype`` converts the floating-point weights.
    Only data is unpickled unless ``trust_code`` (see [Note: a checkpoint is data, never code] in ``trust.py``)."""
    path = Path(path)
    meta = read_meta(path, trusted=trust_code)
    check_files(path, meta, verify=verify)
    info = meta.pop(KEY)
    full: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    for stored in info["model"].values():
        if stored not in full:
            shape, saved_dtype = info["tensors"][stored]
            want = getattr(torch, saved_dtype)
            full[stored] = torch.empty(shape, dtype=dtype if dtype is not None and want.is_floating_point else want)
    optimizer_states = []
    if not weights_only and "optimizer_states" in meta:
        for k, saved in enumerate(meta["optimizer_states"]):
            state: dict[int, dict[str, Any]] = {}
            for (index, name), (key, tensor) in optimizer_keys(info, k).items():
                if tensor is None or is_stored_as_object(tensor):
                    objects[key] = None
                else:
                    full[key] = torch.empty(tensor[0], dtype=getattr(torch, tensor[1]))
                state.setdefault(index, {})[name] = key
            optimizer_states.append((state, saved["param_groups"]))
    shards = {key: Shard.whole(t) for key, t in full.items() if t.numel()}
    load_sharded(path, shards, objects, collective=False, trusted=trust_code)
    values = {**full, **objects, **_joined_slices(info, full)}
    meta["state_dict"] = {key: values[stored] for key, stored in info["model"].items()}
    if PRETRAINED in info:  # the transformers configs, for `lightning-zero export` of the file
        meta[KEY] = {PRETRAINED: info[PRETRAINED]}
    if weights_only:
        meta.pop("optimizer_states", None)
        meta.pop("lr_schedulers", None)
    elif optimizer_states:
        meta["optimizer_states"] = [
            {
                "state": {i: {name: values[key] for name, key in entry.items()} for i, entry in sorted(state.items())},
                "param_groups": groups,
            }
            for state, groups in optimizer_states
        ]
    return meta


def _joined_slices(info: dict[str, Any], full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole tensors of the tensor-parallel slices read (stacked) into ``full``: see [Note: tensor-parallel
    slices in a checkpoint] in ``shards.py``."""
    joined = {}
    for key, joins in info.get("tensor_parallel", {}).items():
        if key not in full:
            continue
        if joins is None:
            raise CheckpointError(
                f"{key} is a statistic of a tensor-parallel slice that is not per element (Adafactor's factored "
                "statistics, for instance): the slices' statistics do not make the whole tensor's. Consolidate the "
                "weights only (`weights_only=True`, `lightning-zero consolidate --weights-only`), or resume the "
                f"sharded checkpoint with `tensor_parallel_size={info.get('tensor_parallel_size')}`."
            )
        joined[key] = join(tuple(full[key]), *joins)
    return joined


def consolidate(
    path: _PATH, out: _PATH, weights_only: bool = False, dtype: Optional[torch.dtype] = None, trust_code: bool = False
) -> Path:
    """Write the sharded checkpoint ``path`` as one standard Lightning checkpoint file ``out`` (atomically); see
    ``load_full_checkpoint`` for the arguments."""
    checkpoint = load_full_checkpoint(path, weights_only=weights_only, dtype=dtype, trust_code=trust_code)
    save_file(checkpoint, Path(out))
    return Path(out)


def inspect_checkpoint(path: _PATH, verify: bool = False, trust_code: bool = False) -> dict[str, Any]:
    """A summary of a sharded checkpoint directory: stage, world size, progress, parameters, bytes per rank; or of
    a checkpoint file in ``ddp``'s form (what ``consolidate``, ``ddp`` and ``state_dict_type="full"`` write). Only
    data is unpickled unless ``trust_code`` (see [Note: a checkpoint is data, never code] in ``trust.py``)."""
    path = Path(path)
    if path.is_file():
        return _inspect_file(path, trust_code)
    meta = read_meta(path, trusted=trust_code)
    check_files(path, meta, verify=verify)
    info = meta[KEY]
    per_rank = [0] * info["world_size"]
    for name, (size, _) in info["files"].items():
        if name.startswith("__"):
            per_rank[int(name[2:].split("_")[0])] += size
    return {
        "path": str(path),
        "format": info["format"],
        "stage": info["stage"],
        "world_size": info["world_size"],
        "tensor_parallel_size": info.get("tensor_parallel_size", 1),
        "precision": info["precision"],
        "epoch": meta.get("epoch"),
        "global_step": meta.get("global_step"),
        "entries": saved_entries(meta),
        "num_parameters": info["num_parameters"],
        "model_tensors": len(info["model"]),
        "optimizers": [o["class"] for o in info["optimizers"]],
        "has_optimizer_state": "optimizer_states" in meta,
        "bytes_per_rank": per_rank,
        "metadata_bytes": (path / META_FILE).stat().st_size,
        "total_bytes": sum(s for s, _ in info["files"].values()),
        "verified": verify,
        "lightning_version": meta.get("pytorch-lightning_version"),
    }


def saved_entries(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's top-level numbers and strings besides the Trainer's own: what a Fabric or plain loop saved
    beside the models (``fabric.save(path, {"model": m, "step": 7})``: ``{"step": 7}``), its progress where it has
    no ``epoch`` or ``global_step``."""
    own = ("epoch", "global_step", "pytorch-lightning_version", "hparams_name")
    return {
        key: value
        for key, value in checkpoint.items()
        if isinstance(value, (int, float, str)) and isinstance(key, str) and key not in own
    }


#: ``format`` of ``inspect_checkpoint``'s summary of a checkpoint file.
FILE_FORMAT = "file"


def _inspect_file(path: Path, trusted: bool) -> dict[str, Any]:
    """The summary of a Lightning checkpoint file (read whole, memory-mapped; a file has no checksums of its own)."""
    try:
        checkpoint = torch_load(path, path, trusted, mmap=True)
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(
            f"{path} is a file that torch.load cannot read ({error}): it is not a checkpoint, or it is damaged."
        ) from error
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise CheckpointError(f"{path} is a torch file but not a Lightning checkpoint (it has no 'state_dict').")
    tensors = {(t.data_ptr(), t.shape): t for t in checkpoint["state_dict"].values() if isinstance(t, torch.Tensor)}
    return {
        "path": str(path),
        "format": FILE_FORMAT,
        "epoch": checkpoint.get("epoch"),
        "global_step": checkpoint.get("global_step"),
        "entries": saved_entries(checkpoint),
        "num_parameters": sum(t.numel() for t in tensors.values()),
        "model_tensors": len(checkpoint["state_dict"]),
        "optimizers": len(checkpoint.get("optimizer_states") or []),
        "has_optimizer_state": bool(checkpoint.get("optimizer_states")),
        "total_bytes": path.stat().st_size,
        "lightning_version": checkpoint.get("pytorch-lightning_version"),
    }
