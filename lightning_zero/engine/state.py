"""An engine's states to and from checkpoints, without Lightning: the code behind ``ZeroEngine``'s checkpoint methods
(``save_checkpoint``, ``load_checkpoint``, ...), which the Trainer's and Fabric's adapters call.

The functions take the engine as an ``EngineStates``, the few attributes they read: a ``ZeroEngine``, or
Fabric's group of several engines seen as one (see [Note: several models in one checkpoint] in ``several.py``).

[Note: one checkpoint format for every way in]
The Trainer's checkpoint hooks, Fabric's ``save``/``load`` and a plain loop all write Lightning's checkpoint dict:
the model's entries under ``state_dict``, each optimizer's under ``optimizer_states`` (in the engine's order, which
is the order the optimizers were given to it), everything else as objects. ``"sharded"`` writes it as a directory
(``checkpoints/sharded.py``: every rank its pieces), ``"full"`` as one file on rank 0 in ``ddp``'s form. The metadata
records which API wrote it (``writer``), so that a checkpoint written by one resumes under another at any world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional, Protocol, Sequence

from torch import nn
from torch.optim import Optimizer

from lightning_zero.checkpoints.errors import agree_on_failure
from lightning_zero.checkpoints.export import PRETRAINED, pretrained_configs
from lightning_zero.checkpoints.full import full_model_state_dict, load_optimizer_state
from lightning_zero.checkpoints.full import optimizer_state as full_optimizer_state
from lightning_zero.checkpoints.sharded import (
    check_optimizer_count,
    check_tensor_parallel,
    copy_full_state,
    load_model_from_dir,
    load_optimizers_from_dir,
    split_checkpoint,
)
from lightning_zero.checkpoints.shards import model_shards, optimizer_shards, param_groups
from lightning_zero.checkpoints.storage import KEY, check_files, read_meta, save_file, save_sharded
from lightning_zero.checkpoints.trust import torch_load
from lightning_zero.comm import collectives
from lightning_zero.comm.groups import ShardGroups
from lightning_zero.config import ZeroConfig
from lightning_zero.engine import simulated
from lightning_zero.engine.amp import PrecisionMode
from lightning_zero.process import user_calls
from lightning_zero.shards.optimizer import ShardedOptimizer
from lightning_zero.shards.slices import tensor_parallel_slice
from lightning_zero.shards.store import ShardedStorage

Writer = Literal["trainer", "fabric", "engine"]
#: Why the Trainer's and Fabric's ``save`` refuse ``storage_options``.
STORAGE_OPTIONS_ERROR = (
    "ZeRO does not take `storage_options`: no rank holds the whole model, so the checkpoint is not handed to a "
    "CheckpointIO; every rank writes its own pieces with torch.distributed.checkpoint (with "
    "`state_dict_type='full'`, rank 0 writes one file with torch.save). Save without `storage_options`, on a path "
    "every rank can reach; to store it elsewhere, copy the directory (or the full file) afterwards."
)

#: Keys of a checkpoint dict that belong to the format, not to the user's own entries.
INTERNAL_KEYS = (KEY, "state_dict", "optimizer_states")


class _Storages(Protocol):
    """The engine's parameter store, as the format reads it."""

    @property
    def storages(self) -> Sequence[ShardedStorage]:
        """One storage per layout, in the engine's order."""
        ...


class _Runtime(Protocol):
    """Stage 3's unit runtime, as a load uses it."""

    def wait_for_unshard(self) -> None:
        """Wait for the gathers in flight (they may read the shards a load writes)."""
        ...

    def refresh(self) -> None:
        """Fill the gathered units again from the shards."""
        ...


class EngineStates(Protocol):
    """What the checkpoint functions read of an engine (``ZeroEngine`` has all of it)."""

    @property
    def config(self) -> ZeroConfig: ...
    @property
    def module(self) -> nn.Module: ...
    @property
    def precision(self) -> PrecisionMode: ...
    @property
    def shard_groups(self) -> ShardGroups: ...
    @property
    def store(self) -> _Storages: ...
    @property
    def optimizers(self) -> list[ShardedOptimizer]: ...
    @property
    def runtime(self) -> Optional[_Runtime]: ...
    def sharded(self, optimizer: Optimizer) -> ShardedOptimizer: ...


def model_state(engine: EngineStates) -> dict[str, Any]:
    """``"sharded"``: this rank's pieces (``Shard``) of every entry; ``"full"``: full weights in the master precision
    (fp32 under mixed precision) on rank 0 (a collective, checked: see [Note: a collective called on one rank])."""
    user_calls.check_every_rank_calls(user_calls.SAVE)
    if engine.config.state_dict_type == "full":
        return full_model_state_dict(engine.module, engine.store.storages)
    # whole tensors are written by rank 0, under tensor parallelism by the first rank of every data-parallel group
    # (each holds its own slices; the replicated ones are the same pieces, which DCP writes once)
    groups = engine.shard_groups
    writes_whole = collectives.rank() == 0 or (groups.tensor is not None and collectives.rank(groups.data_group) == 0)
    return model_shards(engine.module, engine.store.storages, full_copies=writes_whole)


def optimizer_state(engine: EngineStates, optimizer: Optimizer) -> dict[str, Any]:
    """``"sharded"``: this rank's pieces; ``"full"``: gathered to rank 0 in the per-parameter form DDP uses."""
    sharded = engine.sharded(optimizer)
    if engine.config.state_dict_type == "full":
        state = full_optimizer_state(sharded)
        return state if collectives.rank() == 0 else {}
    return {"state": optimizer_shards(sharded), "param_groups": param_groups(sharded)}


def states_entries(engine: EngineStates, optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    """The format's entries of a checkpoint: ``state_dict`` (``model_state``) and, when ``optimizers`` are given,
    ``optimizer_states`` in the engine's order (``optimizer_state``); all of the engine's optimizers or none,
    so that the checkpoint resumes."""
    entries: dict[str, Any] = {"state_dict": model_state(engine)}
    if not optimizers:
        return entries
    states = {engine.optimizers.index(engine.sharded(o)): optimizer_state(engine, o) for o in optimizers}
    if sorted(states) != list(range(len(engine.optimizers))):
        raise ValueError(
            f"Got {len(states)} of the model's {len(engine.optimizers)} optimizers: save all of them "
            "(or none), so that the checkpoint resumes."
        )
    entries["optimizer_states"] = [states[k] for k in range(len(states))]
    return entries


def save(engine: EngineStates, checkpoint: dict[str, Any], path: Path, writer: Writer) -> None:
    """Write ``checkpoint`` (``state_dict`` from ``model_state``, ``optimizer_states`` from
    ``optimizer_state``, in the engine's order) as a directory (every rank) or, with ``state_dict_type="full"``,
    one file (rank 0); either appears complete or not at all."""
    simulated.refuse_to_save()
    configs = pretrained_configs(engine.module)  # see [Note: configs recorded at save time] in export.py
    if engine.config.state_dict_type == "full":
        if configs:
            checkpoint = {**checkpoint, KEY: {PRETRAINED: configs}}
        failed = None
        if collectives.rank() == 0:
            try:
                save_file(checkpoint, Path(path))
            except Exception as error:
                failed = error
        agree_on_failure(Path(path), "writing", failed)
        return
    info: dict[str, Any] = {
        "stage": engine.config.stage,
        "world_size": collectives.world_size(),
        "tensor_parallel_size": engine.shard_groups.tensor_size,
        "precision": engine.precision.precision,
        "writer": writer,
        "num_parameters": sum(
            p.numel() * (engine.shard_groups.tensor_size if tensor_parallel_slice(p) else 1)
            for p in engine.module.parameters()
        ),
    }
    if configs:
        info[PRETRAINED] = configs
    objects, shards, meta = split_checkpoint(checkpoint, engine.optimizers, info)
    if not engine.shard_groups.first_replica:
        # [Note: one replica writes] Under hybrid sharding the replicas of a shard group hold the same pieces;
        # those of the first shard group (which holds rank 0, the writer of whole tensors) are written, the others
        # write none. The directory is the one a plain run writes: any layout loads it.
        shards = {}
    save_sharded(Path(path), objects, shards, meta)


def read(path: Path, trusted: bool = False) -> dict[str, Any]:
    """A directory gives its ``meta.pt`` once every file was checked (by all ranks together; the tensors are read
    later, straight into the shards); a file is read whole. Only data is unpickled, now and when the tensors are
    read, unless ``trusted`` (see [Note: a checkpoint is data, never code] in ``checkpoints/trust.py``).

    [Note: what a read directory carries]
    ``meta[KEY]["path"]`` and ``meta[KEY]["trusted"]`` tell the later loads where the tensors are and whether this
    load was trusted. Both are set here, over whatever ``meta.pt`` held under those names: a checkpoint cannot say
    that it is to be trusted.
    """
    path = Path(path)
    if path.is_file():
        return torch_load(path, path, trusted)
    meta = read_meta(path, trusted)
    check_files(path, meta, collective=True)
    meta[KEY]["path"] = str(path)
    meta[KEY]["trusted"] = trusted
    return meta


def is_directory(checkpoint: Mapping[str, Any]) -> bool:
    """Whether ``checkpoint`` is the metadata of a sharded directory (its tensors still to be read)."""
    return KEY in checkpoint and "path" in checkpoint[KEY] and "state_dict" not in checkpoint


def load_model(engine: EngineStates, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
    """Load the model part of ``checkpoint`` (from ``read``) into this rank's shards, then refresh the working
    parameters (and the gathered units of stage 3)."""
    for storage in engine.store.storages:  # a host master may be the host parameter shard an upload still reads
        storage.settle()
    if engine.runtime is not None:  # a gather started after the last step may still read the shards written below
        engine.runtime.wait_for_unshard()
    dest = model_shards(engine.module, engine.store.storages, full_copies=True)
    if is_directory(checkpoint):
        check_tensor_parallel(
            checkpoint[KEY],
            engine.shard_groups.tensor_size,
            checkpoint[KEY]["path"],
            engine.optimizers if checkpoint.get("optimizer_states") else (),
        )
        load_model_from_dir(
            Path(checkpoint[KEY]["path"]),
            dict(checkpoint),
            dest,
            strict,
            collective=True,
            trusted=checkpoint[KEY].get("trusted") is True,
        )
    else:
        state_dict = checkpoint["state_dict"] if "state_dict" in checkpoint else checkpoint
        copy_full_state(state_dict, dest, strict, source="the checkpoint file")
    for storage in engine.store.storages:
        storage.refresh_working()
    if engine.runtime is not None:
        engine.runtime.refresh()


def load_optimizers(engine: EngineStates, checkpoint: Mapping[str, Any]) -> None:
    """Load every optimizer's state of ``checkpoint`` into the engine's optimizers (the same number, in order)."""
    states = checkpoint.get("optimizer_states")
    if not states:
        return
    if is_directory(checkpoint):
        check_tensor_parallel(
            checkpoint[KEY], engine.shard_groups.tensor_size, checkpoint[KEY]["path"], engine.optimizers
        )
        load_optimizers_from_dir(
            Path(checkpoint[KEY]["path"]),
            dict(checkpoint),
            engine.optimizers,
            collective=True,
            trusted=checkpoint[KEY].get("trusted") is True,
        )
        return
    check_optimizer_count(len(states), engine.optimizers, "file")
    for sharded, state in zip(engine.optimizers, states):
        load_optimizer_state(sharded, state)


def load_one_optimizer(engine: EngineStates, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
    """Load a single optimizer's full state dict (``optimizer.state_dict()`` of an unsharded run)."""
    load_optimizer_state(engine.sharded(optimizer), dict(state))
