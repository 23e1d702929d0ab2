"""One rank: build a GPT under ``configure_model`` with zero3 and record how much memory setup took.

Usage: ``meta_init.py OUT WIDTH DEPTH``. Saves the peak resident memory growth during setup and the model's size.
"""

from __future__ import annotations

import resource
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from tests.models import TinyGPT

warnings.filterwarnings("ignore")


class GatheredDuringValidation(L.Callback):
    """The most bytes of block weights holding memory as any block starts its forward in validation."""

    def __init__(self) -> None:
        self.most = 0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for block in pl_module.blocks:  # runs after ZeRO's own pre-forward hook, which gathers the block
            block.register_forward_pre_hook(lambda module, args: self._measure(pl_module))

    def _measure(self, pl_module: L.LightningModule) -> None:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in pl_module.blocks.parameters()}
        self.most = max(self.most, sum(storages.values()))


class PeakAtSetup(L.Callback):
    def __init__(self, baseline_kib: int) -> None:
        self.baseline_kib = baseline_kib
        self.growth = -1
        self.gathered = -1

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.baseline_kib) * 1024
        self.gathered = sum(e.gathered_bytes for e in trainer.strategy.storages)


def main() -> None:
    out, width, depth = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    L.seed_everything(0, verbose=False)
    model = TinyGPT(width=width, depth=depth, meta_init=True)
    probe = PeakAtSetup(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=torch.distributed.get_world_size()
                        if torch.distributed.is_initialized() else int(__import__("os").environ["WORLD_SIZE"]),
                        max_steps=1, callbacks=[probe], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    # standalone validation under zero3 is sharded too: blocks are gathered one (plus prefetch) at a time
    validation = GatheredDuringValidation()
    validator = L.Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=trainer.world_size,
                          callbacks=[validation], logger=False, enable_progress_bar=False, enable_model_summary=False,
                          limit_val_batches=2)
    val_loss = validator.validate(model, verbose=False)[0]["val_loss"]
    result: dict[str, Any] = {"growth": probe.growth, "full_bytes": full_bytes, "gathered": probe.gathered,
                              "loss": model.losses[0], "units": len(trainer.strategy.engine.unit_plan.names),
                              "val_loss": val_loss, "val_gathered": validation.most,
                              "blocks_bytes": sum(p.numel() * 4 for p in model.blocks.parameters())}
    torch.save(result, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
