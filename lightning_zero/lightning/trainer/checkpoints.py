"""The checkpoint half of :class:`~lightning_zero.ZeroStrategy`: Lightning's save and load hooks, handed to the
engine's checkpoint functions (``engine/state.py``; see [Note: one checkpoint format for every way in]).

Kept apart from ``strategy.py`` so that each file stays readable. ``ZeroStrategy`` lists this class first among its
bases, so these hooks override ``ParallelStrategy``'s and ``super()`` here reaches Lightning's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import lightning
import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoints.storage import KEY
from lightning_zero.engine import state as engine_state
from lightning_zero.engine.state import STORAGE_OPTIONS_ERROR
from lightning_zero.lightning.trainer import early_checks
from lightning_zero.lightning.trainer.hooks_base import StrategyHooks


class CheckpointHooks(StrategyHooks):
    """Sharded (a directory, every rank writes its pieces) or full (one file on rank 0) checkpoints for ZeroStrategy.

    Uses the strategy's ``engine`` and Lightning's strategy attributes.
    """

    last_checkpoint: Optional[Path] = None
    """The last checkpoint this strategy wrote (the stop message of a Ctrl-C or SIGTERM names it)."""

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the sharded engines, so they are read after setup built them."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.engine.model_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.engine.optimizer_state(getattr(optimizer, "_optimizer", optimizer))

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if storage_options is not None:  # as Lightning's fsdp and deepspeed strategies
            raise TypeError(STORAGE_OPTIONS_ERROR)
        self.engine.save_checkpoint(checkpoint, Path(filepath), writer="trainer")
        self.last_checkpoint = Path(filepath)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)  # removes directories too

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A file is read whole (``ddp``'s form); a directory gives its ``meta.pt`` after every file was checked,
        and the tensors are read later, straight into this rank's shards. Only data is unpickled unless
        ``weights_only=False`` (see [Note: a checkpoint is data, never code] in ``checkpoints/trust.py``)."""
        # see [Note: the Trainer's weights_only reaches a strategy that restores after setup] in early_checks.py
        trusted = weights_only is False or (
            weights_only is None and early_checks.requested_trust(self.lightning_module)
        )
        if Path(checkpoint_path).is_file() or "://" in str(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, False if trusted else weights_only)
        meta = engine_state.read(Path(checkpoint_path), trusted=trusted)
        writer = meta[KEY].get("writer")
        if writer in ("fabric", "engine"):
            # Fabric's and a plain loop's loop state is the user's own entries: the Trainer's loops start afresh,
            # with no schedulers, from the step counter a plain loop recorded (see [Note: a plain loop's step])
            meta.setdefault("lr_schedulers", [])
            meta.setdefault("pytorch-lightning_version", lightning.__version__)
            trainer = self.lightning_module.trainer
            if writer == "engine" and "loops" not in meta and trainer.state.fn == "fit":
                meta["loops"] = {"fit_loop": _fit_loop_at_step(trainer, int(meta.get("global_step") or 0))}
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.engine.load_model_state(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self.engine.load_optimizer_states(checkpoint)


def _fit_loop_at_step(trainer: "pl.Trainer", global_step: int) -> dict[str, Any]:
    """The state of a fresh fit loop whose optimizer steps stand at ``global_step``.

    [Note: a plain loop's step]
    A ``ZeroEngine`` checkpoint records ``global_step`` (its optimizer steps) but no loop state: the Trainer resumes
    it with that step count (``trainer.global_step``, ``max_steps`` and the loggers' step go on from it), at the start
    of an epoch, its data from the beginning. The step counter lives in the optimizer progress of the automatic or
    manual optimization loop, whichever the module uses; both are set.
    """
    state = trainer.fit_loop.state_dict()
    steps = {"ready": global_step, "completed": global_step}
    automatic = state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]
    manual = state["epoch_loop.manual_optimization.optim_step_progress"]
    for progress in (automatic, manual):
        progress["total"].update(steps)
    state["epoch_loop.state_dict"]["_batches_that_stepped"] = global_step
    return state
