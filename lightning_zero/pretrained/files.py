"""Weights on disk, read a range at a time: Hugging Face ``save_pretrained`` directories, ``.safetensors`` files
(single or sharded with an index) and ``torch.save`` state dicts.

[Note: reading only what a rank keeps]
``WeightFiles`` knows every tensor's name, shape and file from the files' headers alone (safetensors headers;
a ``torch.load(mmap=True)`` that maps the file and reads none of its data). ``WeightFiles.copy_range`` then
copies elements ``[start, start + n)`` of one flattened tensor into a destination: it reads the rows that cover the
range (``safe_open(...).get_slice(name)[r0:r1]``, a view of the memory-mapped file) in blocks of at most
``READ_BLOCK_BYTES``, and opens and closes the file around each block. A file mapping keeps every page it has
touched resident (counted in the process's resident set, though the kernel may drop such clean pages) until it is
unmapped, so closing after each block bounds the transient memory of a load by one block (or one row, if a row is
larger), whatever the size of the file or of the tensor. Nothing is read for a tensor of which this rank keeps no
element.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
from torch import Tensor

from lightning_zero.checkpoints.trust import torch_load

#: What a refused pretrained file (one that holds more than tensors) tells the user to do.
PRETRAINED_HINT = (
    "Pretrained weights are read as a state dict of tensors only: if you trust the file, convert it "
    "with `torch.save(torch.load(f, weights_only=False)['state_dict'], f)` (or save the model's "
    "`state_dict()`) and load that."
)

#: The most bytes of a file read (and kept mapped) at once; a row larger than this is read one row at a time.
READ_BLOCK_BYTES = 64 * 2**20

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_FILE = "pytorch_model.bin"

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives on disk and what it is, from the file's header."""

    path: Path
    shape: tuple[int, ...]
    dtype: Union[torch.dtype, str]

    @property
    def is_safetensors(self) -> bool:
        return self.path.suffix == ".safetensors"


class WeightFiles:
    """The tensors of a checkpoint on disk by name (headers only; see [Note: reading only what a rank keeps]).

    Args:
        source: a ``save_pretrained`` directory (``model.safetensors[.index.json]``, else
            ``pytorch_model.bin[.index.json]``), a ``.safetensors`` file, an index ``.json`` file, or a file written
            by ``torch.save(state_dict)``.
    """

    def __init__(self, source: Union[str, os.PathLike]) -> None:
        self.source = Path(source)
        self.tensors: dict[str, TensorInfo] = {}
        for path in _files_of(self.source):
            for name, info in _headers(path).items():
                self.tensors.setdefault(name, info)

    def __repr__(self) -> str:
        return f"WeightFiles({str(self.source)!r}, {len(self.tensors)} tensors)"

    def copy_range(self, name: str, start: int, dest: Tensor) -> None:
        """Copy elements ``[start, start + dest.numel())`` of tensor ``name``, flattened, into the 1-D ``dest``
        (converted to its dtype), reading the covering rows a block at a time."""
        info = self.tensors[name]
        if not info.shape:  # a 0-d tensor: one element
            with _rows(info, name, None) as value:
                dest.copy_(value.reshape(-1))
            return
        row = math.prod(info.shape[1:])
        end = start + dest.numel()
        if row == 0 or end == start:
            return
        rows_per_block = max(1, READ_BLOCK_BYTES // max(1, row * _itemsize(info.dtype)))
        r = start // row
        while r * row < end:
            r_end = min(info.shape[0], r + rows_per_block, -(-end // row))
            lo, hi = max(start, r * row), min(end, r_end * row)
            with _rows(info, name, (r, r_end)) as block:
                dest[lo - start : hi - start].copy_(block.reshape(-1)[lo - r * row : hi - r * row])
            r = r_end


def _files_of(source: Path) -> list[Path]:
    """The weight files behind ``source`` (see ``WeightFiles``)."""
    if source.is_dir():
        for index, single in ((SAFETENSORS_INDEX, SAFETENSORS_FILE), (TORCH_INDEX, TORCH_FILE)):
            if (source / index).is_file():
                return _files_of(source / index)
            if (source / single).is_file():
                return [source / single]
        found = sorted(p.name for p in source.iterdir())[:20]
        raise FileNotFoundError(
            f"No weights found in directory {str(source)!r}: expected {SAFETENSORS_INDEX}, {SAFETENSORS_FILE}, "
            f"{TORCH_INDEX} or {TORCH_FILE} (a `save_pretrained` directory); it holds {found}. Pass the weight "
            "file itself if it has another name."
        )
    if not source.is_file():
        raise FileNotFoundError(f"No such file or directory: {str(source)!r} (pretrained weights to load).")
    if source.suffix == ".json":
        with open(source) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(
                f"{str(source)!r} is not a weights index: it has no 'weight_map' of tensor names to "
                "files (as `save_pretrained` writes in model.safetensors.index.json)."
            )
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (source.parent / f).is_file()]
        if missing:
            raise FileNotFoundError(f"The index {str(source)!r} names files that are not next to it: {missing}.")
        return [source.parent / f for f in files]
    return [source]


def _headers(path: Path) -> dict[str, TensorInfo]:
    """Name, shape and dtype of every tensor in one file, without reading tensor data."""
    if path.suffix == ".safetensors":
        with _safe_open(path) as f:
            return {
                name: TensorInfo(
                    path,
                    tuple(f.get_slice(name).get_shape()),
                    _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype(), f.get_slice(name).get_dtype()),
                )
                for name in f.keys()
            }
    state = _torch_load(path)
    return {name: TensorInfo(path, tuple(t.shape), t.dtype) for name, t in state.items()}


def _torch_load(path: Path) -> dict[str, Tensor]:
    """A ``torch.save`` state dict, memory-mapped (no tensor data is read until it is used)."""
    try:  # data only: see [Note: a checkpoint is data, never code] in trust.py
        state: Any = torch_load(path, path, mmap=True, hint=PRETRAINED_HINT)
    except RuntimeError as error:
        raise ValueError(
            f"Could not memory-map {str(path)!r} as a torch.save file ({error}). Pretrained weights are read "
            "tensor by tensor from safetensors files or from files written by `torch.save(model.state_dict(), f)` "
            "(the zip format of torch >= 1.6); convert older files with `torch.save(torch.load(f), f)`."
        ) from error
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]  # a Lightning checkpoint file
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(
            f"{str(path)!r} does not hold a state dict (a dict of tensor names to tensors); "
            "save one with `torch.save(model.state_dict(), path)`."
        )
    return state


@contextmanager
def _rows(info: TensorInfo, name: str, rows: Union[tuple[int, int], None]) -> Iterator[Tensor]:
    """Rows ``[r0, r1)`` of tensor ``name`` (all of it for ``None``), with the file open (and mapped) only while the
    caller copies from them: the tensor may be a view of the mapping, valid inside the ``with`` block only."""
    if info.is_safetensors:
        with _safe_open(info.path) as f:
            yield f.get_tensor(name) if rows is None else f.get_slice(name)[rows[0] : rows[1]]
        return
    tensor = _torch_load(info.path)[name]  # the mapping lives as long as its tensors
    yield tensor if rows is None else tensor[rows[0] : rows[1]]


def _safe_open(path: Path) -> Any:
    """``safetensors.safe_open`` (an optional dependency), as a context manager that unmaps the file on exit."""
    try:
        from safetensors import safe_open
    except ImportError as error:
        raise ImportError(
            f"Reading {str(path)!r} needs the safetensors package: "
            "`pip install 'lightning-zero[hf]'` (or `pip install safetensors`)."
        ) from error
    return safe_open(str(path), framework="pt")


def _itemsize(dtype: Union[torch.dtype, str]) -> int:
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 4
