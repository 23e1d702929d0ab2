"""A ``ckpt_path`` given to ``trainer.fit/validate/test/predict`` checked before the model is built and sharded.

[Note: a checkpoint is checked before the build]
Lightning restores a checkpoint after the strategy's setup (``restore_checkpoint_after_setup``: it loads into the
shards), so a path with nothing there, a damaged ``meta.pt`` or another model's checkpoint was found only after
``configure_model`` and the sharded construction (minutes to hours at scale). The path Lightning will restore is
what its checkpoint connector's ``_select_ckpt_path`` returns ("last", "best" and "hpc" resolved); importing
``lightning_zero`` records it on the connector (``install``). Then:

- in ``setup_environment``, before ``configure_model``: the path exists, and a directory's ``meta.pt`` matches its
  checksum and every file of it is there with its size (the full checksums are verified at the load, as before);
- at the start of ``setup``, after ``configure_model`` (zero3: recorded on the meta device, nothing built yet) and
  before the engine builds and shards the model: the saved shapes (and, with ``strict_loading``, the names) against
  the module's. A single file (``ddp``'s form) is only checked to exist: its shapes are inside the pickle, which
  would have to be read whole.

Every rank checks and the ranks agree (one all-gather of the error, if any), so all of them raise the same error at
the same point.

[Note: the Trainer's weights_only reaches a strategy that restores after setup]
``trainer.fit(ckpt_path=..., weights_only=False)`` is how a user says that a checkpoint is trusted (see [Note: a
checkpoint is data, never code] in ``checkpoints/trust.py``). Lightning passes it to ``strategy.load_checkpoint``
only when the strategy restores *before* setup; ours restores after (``restore_checkpoint_after_setup``), where
Lightning's ``_run`` calls ``_restore_modules_and_callbacks(ckpt_path)`` without it. Importing ``lightning_zero``
also records on the checkpoint connector the ``weights_only`` each ``Trainer._run`` was given
(``requested_trust``), for the early checks and for ``ZeroStrategy.load_checkpoint``. Each run records its own
value (``None`` when not given), so a trust given to one ``fit`` never carries over to the next.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from torch import nn

from lightning_zero.checkpoints.errors import CheckpointError, agree_on_check
from lightning_zero.checkpoints.sharded import check_model_keys
from lightning_zero.checkpoints.storage import KEY, check_files, missing_message, read_meta

_SELECTED = "lightning_zero_ckpt_path"
_WEIGHTS_ONLY = "lightning_zero_weights_only"
_MARK = "__lightning_zero_records_ckpt_path__"


def install() -> None:
    """Record on Lightning's checkpoint connector the path its ``_select_ckpt_path`` chose and the ``weights_only``
    each ``Trainer._run`` was given (once)."""
    select = _CheckpointConnector._select_ckpt_path
    if getattr(select, _MARK, False):
        return
    run = Trainer._run

    @functools.wraps(run)
    def recording_run(self: Trainer, model: Any, ckpt_path: Any = None, weights_only: Optional[bool] = None) -> Any:
        setattr(self._checkpoint_connector, _WEIGHTS_ONLY, weights_only)
        return run(self, model, ckpt_path=ckpt_path, weights_only=weights_only)

    Trainer._run = recording_run  # type: ignore[method-assign]

    @functools.wraps(select)
    def recording(self: _CheckpointConnector, *args: Any, **kwargs: Any) -> Any:
        path = select(self, *args, **kwargs)
        setattr(self, _SELECTED, path)
        return path

    setattr(recording, _MARK, True)
    _CheckpointConnector._select_ckpt_path = recording  # type: ignore[method-assign]


def selected_ckpt_path(module: Optional[nn.Module]) -> Optional[Path]:
    """The local path the Trainer of ``module`` will restore, if any (``None`` for URLs and the registry)."""
    trainer = getattr(module, "_trainer", None)
    path = getattr(getattr(trainer, "_checkpoint_connector", None), _SELECTED, None)
    if not isinstance(path, (str, os.PathLike)) or "://" in str(path) or str(path).startswith("registry"):
        return None
    return Path(path)


def requested_trust(module: Optional[nn.Module]) -> bool:
    """Whether the run of ``module``'s Trainer was given ``weights_only=False`` (see [Note: the Trainer's
    weights_only reaches a strategy that restores after setup])."""
    trainer = getattr(module, "_trainer", None)
    return getattr(getattr(trainer, "_checkpoint_connector", None), _WEIGHTS_ONLY, None) is False


def check_path(path: Optional[Path], trusted: bool = False) -> None:
    """Collective: raise on every rank if ``path`` is missing or a directory there is not a complete checkpoint
    (``meta.pt`` read as data unless ``trusted``)."""
    if path is not None:
        agree_on_check(lambda: _check_path(path, trusted))


def _check_path(path: Path, trusted: bool) -> None:
    if not path.exists():
        raise CheckpointError(
            f"`ckpt_path`: {missing_message(path)} Nothing was built yet. Check the path (a sharded "
            "checkpoint is a directory, e.g. checkpoints/last.ckpt), or leave `ckpt_path` out to "
            "start from scratch."
        )
    if path.is_dir():
        check_files(path, read_meta(path, trusted), verify=False)


def check_shapes(path: Optional[Path], module: nn.Module, strict: bool, trusted: bool = False) -> None:
    """Collective: raise on every rank if the checkpoint directory at ``path`` holds another model than ``module``
    (built or recorded on the meta device, not yet sharded). Tensor-parallel checkpoints are left to the load."""
    if path is not None and path.is_dir():
        agree_on_check(lambda: _check_shapes(path, module, strict, trusted))


def _check_shapes(path: Path, module: nn.Module, strict: bool, trusted: bool) -> None:
    info = read_meta(path, trusted)[KEY]
    if info.get("tensor_parallel_size", 1) != 1 or getattr(module, "_device_mesh", None) is not None:
        return  # local slices: the load compares them, with the mesh
    saved = {
        key: tuple(info["tensors"][stored][0])
        for key, stored in info["model"].items()
        if info["tensors"].get(stored) is not None
    }
    here = {
        key: SimpleNamespace(shape=tuple(t.shape), full_shape=tuple(t.shape))
        for key, t in module.state_dict(keep_vars=True).items()
        if hasattr(t, "shape")
    }
    try:
        check_model_keys(saved, here, strict, str(path), warn=False)  # type: ignore[arg-type]  # the load warns
    except CheckpointError as error:
        raise CheckpointError(
            f"`ckpt_path`: {error} Found before the model was built and sharded; nothing was loaded."
        ) from None
