"""The checkpoint half of :class:`~lightning_zero.ZeroStrategy`: Lightning's save and load hooks.

Kept apart from ``strategy.py`` so that each file stays readable; the data path behind it is ``shards.py`` (this
rank's pieces) → ``checkpoint_state.py`` (Lightning's checkpoint dict ↔ keys) → ``checkpoint.py`` (DCP, atomic
writes, checks). ``ZeroStrategy`` lists this class first among its bases, so these hooks override
``ParallelStrategy``'s and ``super()`` here reaches Lightning's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.utilities.types import _PATH
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoint import KEY, check_files, read_meta, save_file, save_sharded
from lightning_zero.checkpoint_state import (
    check_optimizer_count,
    copy_full_state,
    load_model_from_dir,
    load_optimizers_from_dir,
    split_checkpoint,
)
from lightning_zero.optimizer import ShardedOptimizer
from lightning_zero.shards import model_shards, optimizer_shards, param_groups
from lightning_zero.state_dict import full_model_state_dict, load_optimizer_state, optimizer_state


class CheckpointHooks:
    """Sharded (a directory, every rank writes its pieces) or full (one file on rank 0) checkpoints for ZeroStrategy.

    Uses the strategy's ``config``, ``engines``, ``runtime``, ``shard_groups`` and Lightning's strategy attributes.
    """

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the sharded engines, so they are read after setup built them."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """``"sharded"``: this rank's pieces (``Shard``) of every entry; ``"full"``: full weights in the master
        precision (fp32 under mixed precision) on rank 0."""
        assert self.lightning_module is not None
        if self.config.state_dict_type == "full":
            return full_model_state_dict(self.lightning_module, self.engines)
        return model_shards(self.lightning_module, self.engines, full_copies=self.is_global_zero)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``"sharded"``: this rank's pieces; ``"full"``: gathered to rank 0 in the per-parameter form DDP uses."""
        engine = self._engine_for(getattr(optimizer, "_optimizer", optimizer))
        if self.config.state_dict_type == "full":
            state = optimizer_state(engine)
            return state if self.is_global_zero else {}
        return {"state": optimizer_shards(engine), "param_groups": param_groups(engine)}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Optional[Any] = None) -> None:
        """Write a sharded checkpoint directory (every rank) or, with ``state_dict_type="full"``, one file (rank 0);
        either appears complete or not at all."""
        if storage_options is not None:  # as Lightning's fsdp and deepspeed strategies
            raise TypeError(
                "ZeroStrategy does not take `storage_options`: no rank holds the whole model, so the checkpoint is "
                "not handed to the Trainer's CheckpointIO; every rank writes its own pieces with "
                "torch.distributed.checkpoint (with `state_dict_type='full'`, rank 0 writes one file with "
                "torch.save). Call `save_checkpoint` without `storage_options`, on a path every rank can reach; to "
                "store it elsewhere, copy the directory (or the full file) afterwards."
            )
        if self.config.state_dict_type == "full":
            if self.is_global_zero:
                save_file(checkpoint, Path(filepath))
            return
        info = {"stage": self.config.stage, "world_size": self.world_size,
                "precision": self.precision_plugin.precision,
                "num_parameters": sum(p.numel() for p in self.model.parameters()) if self.model is not None else 0}
        objects, shards, meta = split_checkpoint(checkpoint, self.engines, info)
        if not self.shard_groups.first_replica:
            # [Note: one replica writes] Under hybrid sharding the replicas of a shard group hold the same pieces;
            # those of the first shard group (which holds rank 0, the writer of whole tensors) are written, the
            # others write none. The directory is the one a plain run writes: any layout loads it.
            shards = {}
        save_sharded(Path(filepath), objects, shards, meta)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)  # removes directories too

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A file is read whole (``ddp``'s form); a directory gives its ``meta.pt`` after every file was checked,
        and the tensors are read later, straight into this rank's shards."""
        if Path(checkpoint_path).is_file() or "://" in str(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        meta = read_meta(Path(checkpoint_path))
        check_files(Path(checkpoint_path), meta, collective=True)
        meta[KEY]["path"] = str(checkpoint_path)
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        for engine in self.engines:  # a host master may be the host parameter shard an upload still reads
            if engine.sharded is not None:
                engine.sharded.settle()
        dest = model_shards(self.lightning_module, self.engines, full_copies=True)
        if _from_directory(checkpoint):
            path = Path(checkpoint[KEY]["path"])
            load_model_from_dir(path, dict(checkpoint), dest, strict, collective=True)
        else:
            copy_full_state(checkpoint["state_dict"], dest, strict, source="the checkpoint file")
        for engine in self.engines:
            engine.refresh_working()
        if self.runtime is not None:
            self.runtime.refresh()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint.get("optimizer_states")
        if not states:
            return
        if _from_directory(checkpoint):
            load_optimizers_from_dir(Path(checkpoint[KEY]["path"]), dict(checkpoint), self.engines, collective=True)
            return
        check_optimizer_count(len(states), self.engines, "file")
        for engine, state in zip(self.engines, states):
            load_optimizer_state(engine, state)

    def _engine_for(self, optimizer: Optimizer) -> ShardedOptimizer:
        for engine in self.engines:
            if engine.optimizer is optimizer:
                return engine
        raise ValueError("This optimizer was not set up by ZeroStrategy; return it from `configure_optimizers`.")


def _from_directory(checkpoint: Mapping[str, Any]) -> bool:
    """Whether ``checkpoint`` is the metadata of a sharded directory (its tensors still to be read)."""
    return KEY in checkpoint and "path" in checkpoint[KEY] and "state_dict" not in checkpoint
