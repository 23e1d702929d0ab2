"""Pretrained weights into a model of any stage, tensor by tensor: ``load_pretrained``.

[Note: three moments to load pretrained weights]
- The module's tensors are materialized and not sharded (a plain module; ``ddp``; any stage before setup, e.g. built
  in ``__init__``; zero1/zero2 in ``configure_model``): every tensor is copied in place, one at a time.
- Under zero3, in ``configure_model`` (the parameters are on the meta device): names and shapes are checked right
  away against the files' headers, and the load is recorded on the module. The strategy fills the weights at setup,
  right after the sharded construction: each rank reads only the ranges of the tensors it keeps (its pieces of the
  master shards, and the buffers and frozen tensors every rank holds) and writes them into its shards. Peak host
  memory per rank: its shards plus one read block (see [Note: reading only what a rank keeps]).
- After the strategy's setup (``on_fit_start``, say) under zero1/2/3: the same, straight into the shards. It is
  collective there (the working parameters are gathered again from the masters): call it on every rank.

In every case all names and shapes are checked before the first tensor is written: a mismatch raises an error
naming the keys and shapes, before any training and before the module is touched.
"""

from __future__ import annotations

import gc
import os
import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol, Sequence, Union

import torch
from torch import nn

from lightning_zero.checkpoints.shards import Shard, model_shards
from lightning_zero.pretrained.files import WeightFiles
from lightning_zero.shards.store import ShardedStorage

_PENDING = "_lightning_zero_pretrained"
_SHOWN = 20  # keys listed per kind in an error message


class LoadResult(NamedTuple):
    """What ``load_pretrained`` did not match (always empty with ``strict=True``): module keys."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class ShardOwner(Protocol):
    """What holds a model's shards after setup (a ``ZeroEngine``): its parameter
    store and the stage 3 unit runtime."""

    store: Any
    runtime: Any


@dataclass
class _Plan:
    """A checked load: which file tensor goes into which module key (keys relative to the module loaded into)."""

    files: WeightFiles
    pairs: list[tuple[str, str]]
    result: LoadResult


#: See [Note: which engine holds a module].
_OWNERS: "weakref.WeakKeyDictionary[nn.Module, weakref.ReferenceType[ShardOwner]]" = weakref.WeakKeyDictionary()


def load_pretrained(
    module: nn.Module, source: Union[str, os.PathLike], *, prefix: str = "", strict: bool = True
) -> LoadResult:
    """Load pretrained weights from ``source`` into ``module``, a tensor at a time, at any stage.

    See [Note: three moments to load pretrained weights]: a module being built under zero3 (meta parameters, inside
    ``configure_model``) is filled by the strategy at setup, each rank reading only what it keeps.

    Args:
        module: the module to fill (an ``nn.Module`` inside your ``LightningModule``, or the LightningModule).
        source: a Hugging Face ``save_pretrained`` directory (``model.safetensors``, sharded with
            ``model.safetensors.index.json``, or ``pytorch_model.bin``), a ``.safetensors`` file, or a file written
            by ``torch.save(state_dict)``.
        prefix: put in front of every name in the files to give the module's key: ``"lm."`` to load a Hugging Face
            model's files into a LightningModule that holds it as ``self.lm``. Module keys not under ``prefix`` are
            left alone.
        strict: missing keys (module keys under ``prefix`` that no file tensor fills; a weight tied to a loaded one
            is filled) and unexpected keys (file tensors with no module key) are errors. Shapes must always match.

    Returns:
        The missing and unexpected keys (empty lists with ``strict=True``).

    Raises:
        ValueError: naming the missing and unexpected keys and the shapes that differ, before anything is loaded.
    """
    plan = _check(module, WeightFiles(source), prefix, strict)
    found = _owner_of(module)
    if found is not None:
        root, name, owner = found
        fill_shards(root, owner.store.storages, owner.runtime, [(name, plan)])
    elif _deferring:  # inside zero3's `configure_model` (recorded on the meta device): setup fills it
        module.__dict__.setdefault(_PENDING, []).append(plan)
    elif _on_meta(module):
        raise ValueError(
            f"{type(module).__name__} has parameters or buffers on the meta device, and only the zero3 strategy "
            "fills such a module (at setup, when it shards it). Call `load_pretrained` in `configure_model` under "
            "`strategy='zero3'`, or give the module memory first (`module.to_empty(device='cpu')`)."
        )
    else:
        _copy_plain(module, plan)
    return plan.result


# ---------------------------------------------------------------------- checking names and shapes
def _check(module: nn.Module, files: WeightFiles, prefix: str, strict: bool) -> _Plan:
    """Match the files' tensors to ``module``'s keys; raise before anything is loaded if they do not fit."""
    state = module.state_dict(keep_vars=True)
    ours = {key: tensor for key, tensor in state.items() if key.startswith(prefix)}
    pairs: list[tuple[str, str]] = []
    unexpected: list[str] = []
    shapes: dict[str, str] = {}
    ignored = _ignored_unexpected(module)
    for name, info in files.tensors.items():
        key = prefix + name
        if key not in ours:
            if not any(re.search(pattern, key) for pattern in ignored):
                unexpected.append(key)
        elif tuple(ours[key].shape) != info.shape:
            shapes[key] = f"{key}: {list(info.shape)} in the file, {list(ours[key].shape)} in the model"
        else:
            pairs.append((key, name))
    filled = {id(ours[key]) for key, _ in pairs}  # a tied weight is filled through any of its names
    missing = [key for key, tensor in ours.items() if id(tensor) not in filled and key not in shapes]
    if shapes or (strict and (missing or unexpected)):
        raise ValueError(
            _mismatch_message(
                module, files, prefix, missing if strict else [], unexpected if strict else [], list(shapes.values())
            )
        )
    return _Plan(files, pairs, LoadResult(missing, unexpected))


def _ignored_unexpected(module: nn.Module) -> list[str]:
    """Hugging Face's patterns of file tensors a model does not take (``_keys_to_ignore_on_load_unexpected``: GPT-2's
    causal-mask buffers ``attn.bias`` in older checkpoints), from ``module`` and its submodules."""
    patterns: set[str] = set()
    for sub in module.modules():
        patterns.update(getattr(sub, "_keys_to_ignore_on_load_unexpected", None) or ())
    return sorted(patterns)


def _mismatch_message(
    module: nn.Module, files: WeightFiles, prefix: str, missing: list[str], unexpected: list[str], shapes: list[str]
) -> str:
    lines = [
        f"The pretrained weights in {str(files.source)!r} do not fit {type(module).__name__} "
        f"(file names prefixed with {prefix!r}); nothing was loaded."
    ]
    for title, keys in (
        ("Shapes that differ", shapes),
        ("Missing in the files (module keys no file tensor fills)", missing),
        ("Unexpected in the files (no such module key)", unexpected),
    ):
        if keys:
            more = f"\n    ... and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
            lines.append(f"  {title}, {len(keys)}:\n    " + "\n    ".join(keys[:_SHOWN]) + more)
    hint = _prefix_hint(module, files, prefix)
    lines.append(
        hint
        or "Pass `strict=False` to load the tensors whose names match (shapes must still match), or "
        "`prefix=` to map the file's names to the module's."
    )
    return "\n".join(lines)


def _prefix_hint(module: nn.Module, files: WeightFiles, prefix: str) -> Optional[str]:
    """A ``prefix`` (or a submodule) that would make the names match, when none of them do now."""
    keys = list(module.state_dict().keys())
    if not files.tensors or any(prefix + name in keys for name in files.tensors):
        return None
    for name in files.tensors:
        for key in keys:
            if key.endswith("." + name):
                return f"Did you mean `prefix={key[: -len(name)]!r}`? Module key {key!r} ends with file name {name!r}."
            if name.endswith("." + key):
                return (
                    f"The file's names start with {name[: -len(key)]!r} (e.g. {name!r}): load into the module "
                    "that holds the whole model, or save the weights of this part only."
                )
    return None


# ---------------------------------------------------------------------- loading
def _copy_plain(module: nn.Module, plan: _Plan) -> None:
    """Copy every tensor in place into a materialized, unsharded module."""
    state = module.state_dict(keep_vars=True)
    done: set[int] = set()
    with torch.no_grad():
        for key, name in plan.pairs:
            tensor = state[key]
            if id(tensor) in done:
                continue
            done.add(id(tensor))
            if tensor.numel() and tensor.untyped_storage().nbytes() < tensor.numel() * tensor.element_size():
                raise RuntimeError(
                    f"{key} holds no memory (a stage 3 parameter after a failed run?); load the "
                    "weights into a module whose parameters are materialized."
                )
            flat = tensor.detach().reshape(-1)
            if flat.numel() and flat.data_ptr() == tensor.data_ptr() and tensor.is_contiguous():
                plan.files.copy_range(name, 0, flat)
            else:  # not contiguous: read it whole, then copy
                whole = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
                plan.files.copy_range(name, 0, whole)
                tensor.copy_(whole.view(tensor.shape))


def fill_shards(
    root: nn.Module, storages: Sequence[ShardedStorage], runtime: Any, loads: Sequence[tuple[str, _Plan]]
) -> None:
    """Write checked loads into this rank's shards of ``root``; ``loads`` holds (module name in ``root``, plan).

    Each rank reads only the ranges it keeps (see [Note: three moments to load pretrained weights]), then the
    storages' working parameters and the gathered units are refreshed from the masters.
    """
    gc.collect()  # construction can leave whole units in reference cycles: free them before reading more
    for storage in storages:  # a host master may be the host parameter shard an upload still reads (params.py)
        storage.settle()
    if runtime is not None:  # a gather started after the last step may still read the shards written below
        runtime.wait_for_unshard()
    dest = model_shards(root, list(storages), full_copies=True)
    done: set[int] = set()
    with torch.no_grad():
        for name, plan in loads:
            for key, file_name in plan.pairs:
                shard = dest[f"{name}.{key}" if name else key]
                if id(shard) not in done:
                    done.add(id(shard))
                    _fill(plan.files, file_name, shard)
    for storage in storages:
        storage.refresh_working()
    if runtime is not None:
        runtime.refresh()


def _fill(files: WeightFiles, name: str, shard: Shard) -> None:
    if shard.local_shape is not None:
        raise ValueError(
            f"load_pretrained: '{name}' is a tensor-parallel slice here, and reading pretrained files "
            "into slices is not supported. Load the pretrained weights into the model built without "
            "tensor parallelism, or into a ZeRO run without `tensor_parallel_size`, save, and load "
            "that checkpoint's consolidated file (`lightning-zero consolidate`) into this run."
        )
    for start, piece in shard.pieces:
        files.copy_range(name, start, piece)


def fill_pending(root: nn.Module, storages: Sequence[ShardedStorage], runtime: Any) -> None:
    """At zero3 setup, after the sharded construction: fill what ``load_pretrained`` recorded in
    ``configure_model`` (on ``root`` or any submodule), then forget it."""
    loads = []
    for name, module in root.named_modules():
        for plan in module.__dict__.pop(_PENDING, []):
            loads.append((name, plan))
    if loads:
        fill_shards(root, storages, runtime, loads)


# ---------------------------------------------------------------------- which strategy holds a module's shards
#
# [Note: which engine holds a module]
# `load_pretrained(module, source)` is called with the user's module alone (any submodule, from anywhere: a callback,
# the script after `fit`), so finding the engine whose shards it must fill needs a table from module to engine: the
# one registry of the package that is per process by design. It is weak both ways (a module or an engine that is
# gone drops out) and holds no state of its own. Not an attribute on the module instead: `copy.deepcopy(model)` would
# carry it to a copy that no engine shards. `_deferring` is a context flag of the same kind (like `torch.no_grad`):
# set only while zero3's `configure_model` runs, so that a load there waits for setup.
_deferring = False


@contextmanager
def deferring() -> Iterator[None]:
    """While active (zero3's ``model_sharded_context``), a module on the meta device may record a load for setup."""
    global _deferring
    previous, _deferring = _deferring, True
    try:
        yield
    finally:
        _deferring = previous


def attach(root: nn.Module, owner: ShardOwner) -> None:
    """From setup on, loads into ``root`` or its submodules go to ``owner``'s shards (``owner`` held weakly)."""
    _OWNERS[root] = weakref.ref(owner)


def detach(root: nn.Module) -> None:
    """At teardown: ``root``'s parameters are whole again (or the run is over)."""
    _OWNERS.pop(root, None)


def _owner_of(module: nn.Module) -> Optional[tuple[nn.Module, str, ShardOwner]]:
    """The attached root holding ``module``, ``module``'s name in it and the root's owner, if any."""
    for root, ref in list(_OWNERS.items()):
        owner = ref()
        if owner is None:
            continue
        for name, sub in root.named_modules():
            if sub is module:
                return root, name, owner
    return None


def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.state_dict(keep_vars=True).values())
