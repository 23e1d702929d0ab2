"""Sharded checkpoint directories: written by every rank in parallel, complete or absent, read at any world size.

[Note: the checkpoint directory]
``trainer.save_checkpoint("run/step=100.ckpt")`` under a ZeRO stage makes a *directory* of that name::

    run/step=100.ckpt/
        __0_0.distcp, __1_0.distcp, ...   what each rank owns, written by that rank (torch.distributed.checkpoint)
        .metadata                          torch.distributed.checkpoint's index of the pieces
        meta.pt                            Lightning's state (loops, callbacks, schedulers, hyperparameters, precision)
                                           and ours: stage, world size, tensor shapes, sizes and CRC-32 of every file
        meta.crc32                         the size and CRC-32 of meta.pt, checked before it is unpickled
        README.md                          what the directory is, for people (never read by a load)

The storage layer is ``torch.distributed.checkpoint`` (DCP): each rank writes its own file, the coordinator writes
the index, and on load every rank reads only the overlaps of the saved pieces with what it owns now (see
[Note: every tensor is flat in a sharded checkpoint] in ``shards.py``), so any world size and stage can load it.
A small planner pair below teaches DCP about our 1-D pieces; the file format, threads and I/O are DCP's own.

[Note: complete or absent]
Everything is written into a hidden sibling ``.step=100.ckpt.tmp-<token>``; ``meta.pt`` and its checksum are written
last (after every rank's files and DCP's index exist, with their sizes and checksums), then rank 0 renames the
directory into place (see [Note: writers that cannot collide] in ``staging.py`` for two jobs writing one name). A kill
at any moment leaves either the previous checkpoint under the name or, between the two renames of an overwrite, the
previous one under ``.step=100.ckpt.old-<token>`` (the loader says so). A directory without ``meta.pt`` is never taken
for a checkpoint, and a missing, truncated or altered file is caught before loading.
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
import warnings
from pathlib import Path
from typing import Any, Optional, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_zero.checkpoints.errors import CheckpointError, agree_on_failure
from lightning_zero.checkpoints.readme import write_readme
from lightning_zero.checkpoints.shards import Shard
from lightning_zero.checkpoints.staging import (
    StagingLock,
    describe,
    make_staging,
    meta_digest_problem,
    remove,
    replace,
    siblings,
    write_meta_digest,
)
from lightning_zero.checkpoints.trust import SafeFileSystemReader, torch_load
from lightning_zero.comm import collectives
from lightning_zero.process.faults import fault_point
from lightning_zero.process.shutdown import GUARD

FORMAT = "lightning-zero/1"
META_FILE = "meta.pt"
#: The key of our own metadata in ``meta.pt`` (and in the dict ``ZeroStrategy.load_checkpoint`` returns).
KEY = "lightning_zero"


# ---------------------------------------------------------------------- DCP planners for 1-D pieces
class _ShardSavePlanner(DefaultSavePlanner):
    """Writes each ``Shard`` piece as a chunk ``[start, start + n)`` of a 1-D tensor of the full size."""

    def __init__(self, shards: dict[str, Shard]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [
            WriteItem(
                index=MetadataIndex(key, torch.Size([start])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size([start]), sizes=torch.Size([piece.numel()])),
                    properties=TensorProperties.create_from_tensor(piece),
                    size=torch.Size([shard.numel]),
                ),
            )
            for key, shard in self.shards.items()
            for start, piece in shard.pieces
            if piece.numel()
        ]
        self.plan = dataclasses.replace(plan, items=plan.items + items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        shard = self.shards.get(write_item.index.fqn)
        if shard is None:
            return super().resolve_data(write_item)
        fault_point("save.shard")  # inside DCP's write, where a full disk strikes
        assert write_item.index.offset is not None
        start = write_item.index.offset[0]
        return next(piece for s, piece in shard.pieces if s == start)


class _ShardLoadPlanner(DefaultLoadPlanner):
    """Reads, for every ``Shard`` destination piece, its overlaps with the saved pieces."""

    def __init__(self, shards: dict[str, Shard], source: Path, trusted: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards
        self.source = source
        self.trusted = trusted
        self.refused: Optional[CheckpointError] = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """A pickled object, read as data (DCP's own ``load_bytes`` unpickles anything: see [Note: a checkpoint is
        data, never code] in ``trust.py``)."""
        fqn = read_item.dest_index.fqn
        where = f"{self.source} (its object {fqn!r}, in a .distcp file)"
        try:
            self.state_dict[fqn] = torch_load(value.getvalue(), where, self.trusted)
        except CheckpointError as error:  # DCP wraps it: kept to be raised as it is (see ``load_sharded``)
            self.refused = error
            raise

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        assert self.metadata is not None
        items: list[ReadItem] = []
        for key, shard in self.shards.items():
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size([s]), sizes=torch.Size([p.numel()])) for s, p in shard.pieces
            ]
            stored = cast(TensorStorageMetadata, self.metadata.state_dict_metadata[key])  # shards are tensors
            items += create_read_items_for_chunk_list(key, stored, chunks)
        return dataclasses.replace(plan, items=plan.items + items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        shard = self.shards.get(read_item.dest_index.fqn)
        if shard is None:
            return super().resolve_tensor(read_item)
        assert read_item.dest_index.index is not None
        _, piece = shard.pieces[read_item.dest_index.index]
        return piece.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])


# ---------------------------------------------------------------------- save
def save_sharded(path: Path, objects: dict[str, Any], shards: dict[str, Shard], meta: dict[str, Any]) -> None:
    """Collective: write a checkpoint directory at ``path`` (see [Note: the checkpoint directory]).

    ``objects`` are small non-tensor values (pickled, deduplicated across ranks), ``shards`` this rank's pieces,
    ``meta`` what rank 0 writes to ``meta.pt``; ``meta[KEY]["files"]`` is filled in here. A failure on any rank
    raises ``CheckpointError`` on every rank (see [Note: a failed save is agreed on]).
    """
    path = Path(path)
    token = collectives.broadcast_object(uuid.uuid4().hex[:12])
    staging = path.parent / f".{path.name}.tmp-{token}"
    lock: Optional[StagingLock] = None
    failed: Optional[BaseException] = None
    if collectives.rank() == 0:
        try:
            fault_point("save.prepare")
            lock = make_staging(path, staging, token)
        except Exception as error:
            failed = error
    agree_on_failure(path, "making its staging directory", failed)
    try:
        with GUARD:  # a signal waits for the write to end (see [Note: signals act at agreed step boundaries])
            _write_sharded(path, staging, token, objects, shards, meta)
    except BaseException as error:
        failed = error
    try:
        agree_on_failure(path, "writing", failed)
    finally:
        if lock is not None:
            if staging.exists():  # a failure: the staging directory was not renamed into place
                remove(staging)
            lock.release()


def _write_sharded(
    path: Path, staging: Path, token: str, objects: dict[str, Any], shards: dict[str, Shard], meta: dict[str, Any]
) -> None:
    dcp.save(objects, storage_writer=dcp.FileSystemWriter(staging, sync_files=True), planner=_ShardSavePlanner(shards))
    fault_point("save.written")
    own = {f.name: _describe(f) for f in staging.glob(f"__{collectives.rank()}_*.distcp")}
    every = collectives.gather_objects(own)
    if every is not None:
        files = {name: info for part in every for name, info in part.items()}
        files[".metadata"] = _describe(staging / ".metadata")
        meta[KEY]["files"] = files
        write_readme(
            staging, path.name, meta, meta.get(KEY, {})
        )  # what the directory is, for people (never read by a load)
        _save_file(meta, staging / META_FILE)
        write_meta_digest(staging, staging / META_FILE)
        _replace(staging, path, token)


def save_file(obj: Any, path: Path) -> None:
    """Write ``obj`` with ``torch.save`` to ``path``, atomically (a locked temporary sibling, then a rename)."""
    path = Path(path)
    token = uuid.uuid4().hex[:12]
    staging = path.parent / f".{path.name}.tmp-{token}"
    lock = make_staging(path, staging, token, directory=False)
    try:
        with GUARD:  # a signal waits for the write to end (see [Note: signals act at agreed step boundaries])
            assert lock.fd is not None
            with open(lock.fd, "wb", closefd=False) as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            fault_point("save.full")
            _replace(staging, path, token)
    finally:
        lock.release()
        if staging.exists():
            staging.unlink()


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


#: (kept under these names: tests reach them here)
_describe = describe
_replace = replace


# ---------------------------------------------------------------------- load
def read_meta(path: Path, trusted: bool = False) -> dict[str, Any]:
    """``meta.pt`` of the checkpoint directory ``path``, after checking that the directory is ours and complete;
    read as data unless ``trusted`` (see [Note: a checkpoint is data, never code] in ``trust.py``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(missing_message(path))
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a lightning-zero checkpoint directory.")
    meta_file = path / META_FILE
    if not meta_file.is_file():
        if (path / ".metadata").is_file():
            raise CheckpointError(
                f"{path} has no {META_FILE}: it is a torch.distributed.checkpoint directory that lightning-zero did "
                "not write (or whose save was interrupted). Load it with `torch.distributed.checkpoint` directly."
            )
        raise CheckpointError(f"{path} is not a checkpoint: it has no {META_FILE} (nor the shards that go with it).")
    data = meta_file.read_bytes()
    problem = meta_digest_problem(path, data)  # see [Note: every byte a load reads is checked first]
    if problem is not None:
        raise CheckpointError(
            f"The checkpoint {path} is damaged: {problem}. Nothing was loaded. Use another "
            "checkpoint (e.g. an earlier one)."
        )
    try:
        meta = torch_load(data, meta_file, trusted)
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(f"{meta_file} cannot be read ({error}); the checkpoint is damaged.") from error
    info = meta.get(KEY) if isinstance(meta, dict) else None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        found = info.get("format") if isinstance(info, dict) else None
        raise CheckpointError(
            f"{meta_file} is not lightning-zero checkpoint metadata of format {FORMAT!r} (found {found!r})."
        )
    return meta


def check_files(path: Path, meta: dict[str, Any], verify: bool = True, collective: bool = False) -> None:
    """Raise if a file of the checkpoint is missing, truncated, or (with ``verify``) altered.

    ``collective``: the ranks share the checksumming (each reads a part of the files) and all raise the same error.
    """
    names = sorted(meta[KEY]["files"])
    rank, world = (collectives.rank(), collectives.world_size()) if collective else (0, 1)
    problems = [
        p
        for i, name in enumerate(names)
        if i % world == rank
        for p in [_file_problem(Path(path) / name, meta[KEY]["files"][name], verify)]
        if p
    ]
    if collective:
        problems = [p for part in collectives.all_gather_objects(problems) for p in part]
    if problems:
        raise CheckpointError(
            f"The checkpoint {path} is damaged: "
            + "; ".join(problems)
            + ". Nothing was loaded. Use another checkpoint (e.g. an earlier one)."
        )


def _file_problem(file: Path, expected: tuple[int, int], verify: bool) -> Optional[str]:
    size, crc = expected
    if not file.is_file():
        return f"{file.name} is missing"
    actual = file.stat().st_size
    if actual != size:
        return f"{file.name} has {actual} bytes instead of {size} (truncated or overwritten)"
    if verify and _describe(file)[1] != crc:
        return f"{file.name} does not match its checksum (corrupted)"
    return None


def load_sharded(
    path: Path,
    shards: dict[str, Shard],
    objects: Optional[dict[str, Any]] = None,
    collective: bool = True,
    trusted: bool = False,
) -> None:
    """Read the saved pieces overlapping ``shards`` into them, and the pickled ``objects`` into that dict.

    ``collective``: every rank of the process group calls this (DCP coordinates the plans); otherwise this process
    reads alone (a single process, or one rank of a job that needs a private full copy). DCP's index and the objects
    are read as data unless ``trusted`` (see [Note: a checkpoint is data, never code] in ``trust.py``).
    """
    objects = {} if objects is None else objects
    alone = not collective or not collectives.is_distributed()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        reader, planner = SafeFileSystemReader(path, trusted), _ShardLoadPlanner(shards, Path(path), trusted)
        try:
            dcp.load(objects, storage_reader=reader, planner=planner, no_dist=alone)
        except BaseException:
            refused = reader.refused or planner.refused  # every rank reads the index and its own objects
            if refused is not None:  # what DCP wrapped into its own errors, as it was
                raise refused from None
            raise


def missing_message(path: Path) -> str:
    """ "No checkpoint at PATH", and where the previous checkpoint is if an overwrite of it was interrupted."""
    message = f"No checkpoint at {path}."
    backups = siblings(path, "old")
    if backups:
        message += (
            f" A save that replaced it was interrupted; the previous checkpoint is intact at {backups[-1]}: "
            f"rename it to {path.name} to use it."
        )
    return message
