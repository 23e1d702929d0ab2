"""The Trainer's side of sharded checkpoints outside of training: a LightningModule for inference from a checkpoint
directory (``load_from_checkpoint``), and ``ZeroCheckpointIO``, with which any other strategy (``ddp``, a
single device) resumes from one. Both read the directory as ``checkpoints/consolidate.py`` does, in one plain
process: one copy of the weights in memory.
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

from lightning_zero.checkpoints.consolidate import load_full_checkpoint
from lightning_zero.checkpoints.sharded import load_model_from_dir
from lightning_zero.checkpoints.shards import Shard
from lightning_zero.checkpoints.storage import KEY, check_files, read_meta

ModuleT = TypeVar("ModuleT", bound=pl.LightningModule)


def load_from_checkpoint(
    cls: type[ModuleT],
    path: _PATH,
    map_location: Optional[Union[str, torch.device]] = None,
    strict: bool = True,
    weights_only: Optional[bool] = None,
    **kwargs: Any,
) -> ModuleT:
    """``cls.load_from_checkpoint`` for sharded directories and files alike, in a plain process.

    For a directory the module is built from the saved hyperparameters (``kwargs`` override them), ``configure_model``
    and ``on_load_checkpoint`` run as in Lightning, and the weights are read straight into its parameters (one copy
    of the weights in memory). It is then moved to ``map_location`` (a device or device name). Only data is
    unpickled unless ``weights_only=False`` (see [Note: a checkpoint is data, never code] in
    ``checkpoints/trust.py``).
    """
    path = Path(path)
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"No checkpoint at {path}.")
        return cls.load_from_checkpoint(
            path, map_location=map_location, strict=strict, weights_only=weights_only, **kwargs
        )
    trusted = weights_only is False
    meta = read_meta(path, trusted)
    check_files(path, meta)
    model = _instantiate(cls, meta, kwargs)
    model.on_load_checkpoint(meta)
    if meta[KEY].get("tensor_parallel_size", 1) > 1:
        # tensor-parallel slices join into the model built without a device mesh: read them whole, then load
        full = load_full_checkpoint(path, weights_only=True, verify=False, trust_code=trusted)
        model.load_state_dict(full["state_dict"], strict=strict)
    else:
        dest = {key: Shard.whole(t) for key, t in model.state_dict(keep_vars=True).items()}
        load_model_from_dir(path, meta, dest, strict, collective=False, trusted=trusted)
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
    checkpoint in ``ddp``'s form, assembled in memory by every process. A directory's files are unpickled as data
    unless ``weights_only=False`` (see [Note: a checkpoint is data, never code] in ``checkpoints/trust.py``).
    """

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        if Path(path).is_dir():
            return load_full_checkpoint(path, trust_code=weights_only is False)
        if map_location is None:
            return super().load_checkpoint(path, weights_only=weights_only)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
