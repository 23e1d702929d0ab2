"""Sharded checkpoints outside of training: one standard file, a summary, a module for inference, ``ddp`` resume.

Everything here runs in one plain process (no process group needed) and reads the directory with
``torch.distributed.checkpoint`` straight into preallocated full tensors, so the peak memory is about the size of
what is produced: the output file's tensors for :func:`consolidate`, one copy of the weights for
:func:`load_from_checkpoint`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_zero.checkpoint import KEY, META_FILE, check_files, load_sharded, read_meta, save_file
from lightning_zero.checkpoint_state import is_stored_as_object, load_model_from_dir, optimizer_keys
from lightning_zero.shards import Shard

ModuleT = TypeVar("ModuleT", bound=pl.LightningModule)
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def load_full_checkpoint(path: _PATH, weights_only: bool = False, dtype: Optional[torch.dtype] = None,
                         verify: bool = True) -> dict[str, Any]:
    """A sharded checkpoint directory as the dict ``ddp`` would have saved (``state_dict`` with full tensors,
    ``optimizer_states`` per parameter unless ``weights_only``). ``dtype`` converts the floating-point weights."""
    path = Path(path)
    meta = read_meta(path)
    check_files(path, meta, verify=verify)
    info = meta.pop(KEY)
    full: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    for key, stored in info["model"].items():
        if stored not in full:
            shape, saved_dtype = info["tensors"][stored]
            want = getattr(torch, saved_dtype)
            full[stored] = torch.empty(shape, dtype=dtype if dtype is not None and want.is_floating_point else want)
    optimizer_states = []
    if not weights_only and "optimizer_states" in meta:
        for k, saved in enumerate(meta["optimizer_states"]):
            state: dict[int, dict[str, Any]] = {}
            for (index, name), (key, tensor) in optimizer_keys(info, k).items():
                if is_stored_as_object(tensor):
                    objects[key] = None
                else:
                    full[key] = torch.empty(tensor[0], dtype=getattr(torch, tensor[1]))
                state.setdefault(index, {})[name] = key
            optimizer_states.append((state, saved["param_groups"]))
    shards = {key: Shard.whole(t) for key, t in full.items() if t.numel()}
    load_sharded(path, shards, objects, collective=False)
    values = {**full, **objects}
    meta["state_dict"] = {key: values[stored] for key, stored in info["model"].items()}
    if weights_only:
        meta.pop("optimizer_states", None)
        meta.pop("lr_schedulers", None)
    elif optimizer_states:
        meta["optimizer_states"] = [
            {"state": {i: {name: values[key] for name, key in entry.items()} for i, entry in sorted(state.items())},
             "param_groups": groups}
            for state, groups in optimizer_states
        ]
    return meta


def consolidate(path: _PATH, out: _PATH, weights_only: bool = False, dtype: Optional[torch.dtype] = None) -> Path:
    """Write the sharded checkpoint ``path`` as one standard Lightning checkpoint file ``out`` (atomically)."""
    checkpoint = load_full_checkpoint(path, weights_only=weights_only, dtype=dtype)
    save_file(checkpoint, Path(out))
    return Path(out)


def inspect_checkpoint(path: _PATH, verify: bool = False) -> dict[str, Any]:
    """A summary of a sharded checkpoint directory: stage, world size, progress, parameters, bytes per rank."""
    path = Path(path)
    meta = read_meta(path)
    check_files(path, meta, verify=verify)
    info = meta[KEY]
    per_rank = [0] * info["world_size"]
    for name, (size, _) in info["files"].items():
        if name.startswith("__"):
            per_rank[int(name[2:].split("_")[0])] += size
    return {
        "path": str(path), "format": info["format"], "stage": info["stage"], "world_size": info["world_size"],
        "precision": info["precision"], "epoch": meta.get("epoch"), "global_step": meta.get("global_step"),
        "num_parameters": info["num_parameters"], "model_tensors": len(info["model"]),
        "optimizers": [o["class"] for o in info["optimizers"]],
        "has_optimizer_state": "optimizer_states" in meta, "bytes_per_rank": per_rank,
        "metadata_bytes": (path / META_FILE).stat().st_size, "total_bytes": sum(s for s, _ in info["files"].values()),
        "verified": verify, "lightning_version": meta.get("pytorch-lightning_version"),
    }


def load_from_checkpoint(cls: type[ModuleT], path: _PATH, map_location: Optional[Union[str, torch.device]] = None,
                         strict: bool = True, **kwargs: Any) -> ModuleT:
    """``cls.load_from_checkpoint`` for sharded directories and files alike, in a plain process.

    For a directory the module is built from the saved hyperparameters (``kwargs`` override them), ``configure_model``
    and ``on_load_checkpoint`` run as in Lightning, and the weights are read straight into its parameters (one copy
    of the weights in memory). It is then moved to ``map_location`` (a device or device name).
    """
    path = Path(path)
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"No checkpoint at {path}.")
        return cls.load_from_checkpoint(path, map_location=map_location, strict=strict, **kwargs)
    meta = read_meta(path)
    check_files(path, meta)
    model = _instantiate(cls, meta, kwargs)
    model.on_load_checkpoint(meta)
    dest = {key: Shard.whole(t) for key, t in model.state_dict(keep_vars=True).items()}
    load_model_from_dir(path, meta, dest, strict, collective=False)
    if map_location is not None:
        if callable(map_location) or isinstance(map_location, dict):
            raise TypeError("`map_location` must be a device or a device name for a sharded checkpoint.")
        model = model.to(map_location)
    return model


def _instantiate(cls: type[ModuleT], meta: dict[str, Any], overrides: dict[str, Any]) -> ModuleT:
    """Build ``cls`` from the checkpoint's hyperparameters as Lightning's ``_load_state`` does."""
    hparams = dict(meta.get(cls.CHECKPOINT_HYPER_PARAMS_KEY) or {})
    hparams.update(overrides)
    signature = inspect.signature(cls.__init__).parameters
    name = meta.get(cls.CHECKPOINT_HYPER_PARAMS_NAME)
    if name and name in signature:
        hparams = {name: hparams}
    if not any(p.kind == p.VAR_KEYWORD for p in signature.values()):
        hparams = {k: v for k, v in hparams.items() if k in signature}
    model = cls(**hparams)
    if is_overridden("configure_model", model):
        model.configure_model()
    return model


class ZeroCheckpointIO(TorchCheckpointIO):
    """Lets any strategy (``ddp``, a single device) load lightning-zero's sharded checkpoint directories.

    ``Trainer(strategy="ddp", plugins=[ZeroCheckpointIO()])``: ``fit/validate/test(ckpt_path=dir)`` then get the
    checkpoint in ``ddp``'s form, assembled in memory by every process.
    """

    @override
    def load_checkpoint(self, path: _PATH, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if Path(path).is_dir():
            return load_full_checkpoint(path)
        if map_location is None:
            return super().load_checkpoint(path, weights_only=weights_only)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
