"""Reading checkpoints as data: every unpickling of a load goes through here, and admits only an allow-list of types.

[Note: a checkpoint is data, never code]
A pickle names the functions and classes it calls while it is read (``os.system``, ``builtins.eval``): unpickling a
file from someone else runs whatever it names. Every file a load of ours unpickles is therefore read by an
unpickler that resolves only allow-listed names, and refuses the file at the first other name, *before* anything
is called (a check of the result after unpickling would come too late: the payload would already have run):

- ``meta.pt``, the objects DCP stores pickled (non-tensor optimizer values, empty tensors) and single checkpoint
  files: ``torch.load(weights_only=True)`` (tensors, numbers, strings, ``None``, lists, tuples, dicts, sets,
  ``torch.Size``, dtypes, devices) inside ``torch.serialization.safe_globals`` of ``DATA_TYPES``, the path
  types Lightning keeps in hyperparameters and callback states. That is all the project writes: its own metadata
  is dicts, lists, tuples, strings and numbers, and Lightning's checkpoint dict (loops, callbacks, schedulers,
  ``hyper_parameters`` as a plain ``dict``) is data too. Types a user registered with ``torch.serialization.
  add_safe_globals`` are admitted as well: that is torch's own switch, and the user's decision. Lightning's
  ``AttributeDict`` (``model.hparams``, when a Fabric user saves it as it is) is not admitted: torch's
  weights-only reader fills no ``dict`` subclass, so it is refused by name like any other type; save
  ``dict(model.hparams)``, or load with ``weights_only=False``.
- DCP's ``.metadata``, a plain pickle that ``FileSystemReader`` would unpickle without restriction:
  ``SafeFileSystemReader`` reads it with ``_MetadataUnpickler``, which resolves DCP's own metadata
  classes (``METADATA_GLOBALS``), ``torch.Size``, dtypes, layouts and paths, and nothing else.

A refused file raises ``UntrustedCheckpointError``, naming the file and the refused types and saying how to
load a file one trusts: ``weights_only=False`` on Lightning's and Fabric's loads, ``trust_code=True`` on ours,
``--trust-code`` on the command line. That switch holds for the one load it is passed to; nothing else turns the
checks off.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from pathlib import Path
from typing import IO, Any, Callable, Optional, Union, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_zero.checkpoints.errors import CheckpointError

#: How to load a file one trusts, on every way in (the end of every refusal).
TRUST_HINT = (
    "If you trust whoever wrote it, load it with `weights_only=False` (Trainer's `fit/validate/test(ckpt_path=...)`, "
    "Fabric's `load`, `load_from_checkpoint`), `trust_code=True` (`load_full_checkpoint`, `consolidate`, "
    "`inspect_checkpoint`), `trusted=True` (the engine's `state.read`) or `--trust-code` (`lightning-zero "
    "inspect/consolidate`)."
)

#: Types beyond torch's ``weights_only`` defaults that a checkpoint of ours may hold: paths, which Lightning keeps
#: in hyperparameters (``data_dir: Path``) and callback states. Building one touches no file.
DATA_TYPES: tuple[type, ...] = (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath)

#: ``(module, name)`` of the classes DCP pickles into ``.metadata``, resolved by ``_MetadataUnpickler``.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ]
    + [
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
    ]
    + [
        (module, name)
        for module in ("pathlib", "pathlib._local")
        for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    ]
)

_SourceFile = Union[Path, bytes, IO[bytes]]


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint file that names a function or class outside the allow-list (``refused``): it was not loaded,
    and nothing in it ran."""

    def __init__(self, file: Union[Path, str], refused: list[str], hint: str = TRUST_HINT) -> None:
        kinds = ", ".join(f"`{name}`" for name in refused) or "a type outside the allow-list"
        super().__init__(
            f"{file} holds {kinds}, which a checkpoint may not hold: unpickling it could run code. "
            f"Nothing was loaded and nothing in it ran. {hint}"
        )
        self.file = file
        self.refused = refused
        self.hint = hint

    def __reduce__(self) -> tuple[Any, ...]:  # DCP sends a rank's failure to the others pickled
        return (type(self), (self.file, self.refused, self.hint))


def safe_types() -> list[Union[Callable[..., Any], tuple[Callable[..., Any], str]]]:
    """The types a load admits beyond torch's ``weights_only`` defaults (see [Note: a checkpoint is data, never
    code])."""
    return list(DATA_TYPES)


def torch_load(
    source: _SourceFile, file: Union[Path, str], trusted: bool = False, mmap: bool = False, hint: str = TRUST_HINT
) -> Any:
    """``torch.load`` of ``source`` (a path, bytes or a file object; ``file`` is its name in errors) admitting only
    data (see [Note: a checkpoint is data, never code]); ``trusted``: anything, as the user asked for this load.
    ``hint``: what a refusal tells the user to do."""
    data = io.BytesIO(source) if isinstance(source, bytes) else source
    if trusted:
        return torch.load(data, map_location="cpu", weights_only=False, mmap=mmap)  # type: ignore[arg-type]
    with torch.serialization.safe_globals(safe_types()):
        try:
            return torch.load(data, map_location="cpu", weights_only=True, mmap=mmap)  # type: ignore[arg-type]
        except pickle.UnpicklingError as error:
            raise UntrustedCheckpointError(file, _refused_globals(source, error), hint) from None


def _refused_globals(source: _SourceFile, error: Exception) -> list[str]:
    """The names in ``source`` that the allow-list refuses, found by disassembling its pickle (nothing runs), or the
    one torch's error names."""
    try:
        if not isinstance(source, (Path, bytes)):
            source.seek(0)
        found = torch.serialization.get_unsafe_globals_in_checkpoint(
            io.BytesIO(source) if isinstance(source, bytes) else source
        )  # type: ignore[arg-type]
    except Exception:
        found = []
    return (
        sorted(found)
        or re.findall(r"GLOBAL ([\w.]+)", str(error))[:1]
        or re.findall(r"WeightsUnpickler error: (.+)", str(error))[:1]
    )


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only ``METADATA_GLOBALS`` and torch's dtypes (exact names: no dotted lookups through them)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (
            module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def load_dcp_metadata(stream: IO[bytes], file: Path, trusted: bool = False) -> Metadata:
    """DCP's ``.metadata`` index, unpickled with ``_MetadataUnpickler`` unless ``trusted``."""
    if trusted:
        return pickle.load(stream)
    try:
        metadata = _MetadataUnpickler(stream).load()
    except _Refused as refused:
        raise UntrustedCheckpointError(file, [refused.name]) from None
    except Exception as error:
        raise CheckpointError(f"{file} cannot be read ({error}); the checkpoint is damaged.") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{file} is not torch.distributed.checkpoint's index (it holds a "
            f"{type(metadata).__name__}); the checkpoint is damaged."
        )
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's ``FileSystemReader`` reading ``.metadata`` through ``load_dcp_metadata`` (see [Note: a checkpoint
    is data, never code]). DCP wraps what ``read_metadata`` raises into errors of its own (it then tries a
    rank-local index, and reports both): the refusal is kept in ``refused`` for the caller to raise as it is."""

    def __init__(self, path: Union[str, Path], trusted: bool = False) -> None:
        super().__init__(path)
        self.trusted = trusted
        self.refused: Optional[CheckpointError] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = load_dcp_metadata(cast(IO[bytes], stream), path, self.trusted)
            except CheckpointError as error:
                self.refused = self.refused or error
                raise
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
