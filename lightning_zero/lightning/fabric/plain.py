"""Models that ``fabric.setup`` has not seen yet: ``fabric.save`` / ``fabric.load`` treat them as ``ddp`` does.

[Note: saving and loading a model that is not set up]
A script may save a freshly built model before ``fabric.setup`` (an initial checkpoint) or load weights into one
before setting it up (fine-tuning from a file). No engine holds such a model, so nothing is sharded: ``fabric.save``
writes what ``ddp`` writes (every entry as its state dict, one file from rank 0), and ``fabric.load`` restores it
from either format: that plain file, or a checkpoint of ours (a sharded directory is consolidated on the way, so a
model keeps the ``state_dict`` it had when it was saved set up). A set-up model loads the plain file too: the entry
under its key becomes its ``state_dict`` (``as_engine_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _Stateful
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.checkpoints.consolidate import load_full_checkpoint
from lightning_zero.lightning.fabric.several import MODELS_KEY

#: The entries of a checkpoint of ours that are not the user's.
_ENGINE_KEYS = ("state_dict", "optimizer_states", MODELS_KEY)


def is_engine_format(checkpoint: Mapping[str, Any]) -> bool:
    """Whether ``checkpoint`` was written by a set-up model (the Trainer's format), not by ``ddp`` or a bare model."""
    return "state_dict" in checkpoint


def as_engine_checkpoint(checkpoint: dict[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """A plain checkpoint (``{"model": state_dict, "optimizer": ...}``) in the engine's format for the one model of
    ``state``; a checkpoint of ours is returned as it is."""
    if is_engine_format(checkpoint):
        return checkpoint
    modules = [key for key, obj in state.items() if isinstance(obj, Module)]
    optimizers = [key for key, obj in state.items() if isinstance(obj, Optimizer)]
    if len(modules) != 1 or modules[0] not in checkpoint:
        return checkpoint
    converted = {key: value for key, value in checkpoint.items() if key not in modules and key not in optimizers}
    converted["state_dict"] = checkpoint[modules[0]]
    if optimizers and all(key in checkpoint for key in optimizers):
        converted["optimizer_states"] = [checkpoint[key] for key in optimizers]
    return converted


def read_for_plain_models(path: Path, checkpoint_io: Any, weights_only: Any) -> dict[str, Any]:
    """The checkpoint at ``path`` as a dict of whole tensors (a sharded directory consolidated)."""
    if path.is_dir():
        return load_full_checkpoint(path, trust_code=weights_only is False)
    return checkpoint_io.load_checkpoint(path, weights_only=weights_only)


def load_into_plain_models(checkpoint: dict[str, Any], state: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Restore ``state`` (no model of it set up) in place, as ``ddp``'s ``fabric.load`` would; the rest of the
    checkpoint is returned."""
    checkpoint = _as_plain(checkpoint, state)
    missing = [key for key in state if key not in checkpoint]
    if strict and missing:
        raise KeyError(
            f"The requested state contains keys that are not present in the checkpoint: {missing}. "
            "Pass `strict=False` to load what is there."
        )
    for key, obj in list(state.items()):
        if key not in checkpoint:
            continue
        value = checkpoint.pop(key)
        if isinstance(obj, Module):
            obj.load_state_dict(value, strict=strict)
        elif isinstance(obj, _Stateful):
            obj.load_state_dict(value)
        else:
            state[key] = value
    return checkpoint


def _as_plain(checkpoint: dict[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint of ours with its models and optimizers under the keys of ``state`` (the ``ddp`` layout)."""
    if not is_engine_format(checkpoint):
        return dict(checkpoint)
    modules = [key for key, obj in state.items() if isinstance(obj, Module)]
    optimizers = [key for key, obj in state.items() if isinstance(obj, Optimizer)]
    plain = {key: value for key, value in checkpoint.items() if key not in _ENGINE_KEYS}
    saved_models = checkpoint.get(MODELS_KEY)
    for key in modules:
        if saved_models is None:
            plain[key] = checkpoint["state_dict"]
        else:
            prefix = f"{key}."
            plain[key] = {
                name[len(prefix) :]: value
                for name, value in checkpoint["state_dict"].items()
                if name.startswith(prefix)
            }
    if optimizers:
        raise ValueError(
            "A ZeRO checkpoint's optimizer states load into set-up optimizers only: call "
            "`fabric.setup(model, optimizer)` before `fabric.load`."
        )
    return plain
