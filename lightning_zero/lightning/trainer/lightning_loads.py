"""Lightning's own checkpoint loaders, taught to read a sharded checkpoint directory.

[Note: Lightning's own loaders read a sharded directory]
``ModelCheckpoint`` names a sharded checkpoint ``last.ckpt`` like a file, and two of Lightning's ways in read a
checkpoint with ``pl_load`` (``torch.load`` of one file) where no code of ours runs: ``MyModule.load_from_checkpoint``
(``lightning.pytorch.core.saving``) and every strategy's ``TorchCheckpointIO`` (``ddp``, one device:
``trainer.fit(model, ckpt_path=dir)``). Both failed with a bare ``IsADirectoryError``. Importing ``lightning_zero``
wraps the ``pl_load`` those two modules call: a local directory is read as ``load_full_checkpoint`` reads it (every
file checked first, the checkpoint assembled in ``ddp``'s form in this process's memory); anything else goes to
Lightning's ``pl_load`` (a file: with ``pathlib`` paths admitted beside torch's ``weights_only`` types). A directory
that is not a checkpoint gets a ``CheckpointError`` saying what it is instead. Its files are unpickled as data
unless the caller passed ``weights_only=False`` (see [Note: a checkpoint is data, never code] in
``checkpoints/trust.py``), the same rule torch applies to a file. Under a ZeRO strategy a directory never reaches
``pl_load``: each rank reads only its pieces.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.fabric.plugins.io import torch_io
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.core import saving

from lightning_zero.checkpoints import trust
from lightning_zero.checkpoints.consolidate import load_full_checkpoint

_MARK = "__lightning_zero_reads_directories__"


def _reads_directories(load: Callable[..., Any]) -> Callable[..., Any]:
    """``load`` (Lightning's ``pl_load``) that reads a local directory as a sharded checkpoint."""

    @functools.wraps(load)
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        if isinstance(path_or_url, (str, os.PathLike)) and "://" not in str(path_or_url) and Path(path_or_url).is_dir():
            checkpoint = load_full_checkpoint(path_or_url, trust_code=weights_only is False)
            if isinstance(map_location, (str, torch.device)):
                checkpoint = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(map_location))
            return checkpoint
        if weights_only is False:
            return load(path_or_url, map_location=map_location, weights_only=weights_only)
        with torch.serialization.safe_globals(trust.safe_types()):  # a file: torch's allow-list and our data types
            return load(path_or_url, map_location=map_location, weights_only=weights_only)

    setattr(pl_load, _MARK, True)
    return pl_load


def install() -> None:
    """Wrap ``pl_load`` where Lightning's ``load_from_checkpoint`` and ``TorchCheckpointIO`` call it (once)."""
    modules: tuple[Any, ...] = (saving, torch_io)  # module attributes replaced: typed as Any
    for module in modules:
        if not getattr(module.pl_load, _MARK, False):
            module.pl_load = _reads_directories(module.pl_load)
