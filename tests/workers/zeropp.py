"""One rank of the ZeRO++ runs (4 ranks): ddp, zero2, zero3, zero3 with hpZ (``secondary_shard_group_size=2``, with
and without activation checkpointing), with qwZ (alone and with hpZ) and with qgZ (stages 2 and 3), on the same seed
and data, with clipping by norm, gradient accumulation and a validation pass (see [Note: hpZ, the secondary
partition] in ``stage3/secondary.py`` and the Notes of ``comm/quantize.py``).

Saves per run the losses, the final weights, the collective payload and the engine's allocations per training batch
(bytes, and elements by scope; every allocation counted, the tiny model's buffers being far below the large-size
mark), the padded flat size of the storages, the padded size of their root units and every bucket's chunk size.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_zero import Traffic, ZeroStrategy
from lightning_zero.comm import collectives
from lightning_zero.memory import costs
from tests.compare import last_unit, last_unit_elements
from tests.models import TinyLM

warnings.filterwarnings("ignore")
costs.LARGE_BYTES = 1  # count every buffer the engine makes, small or large

S = 2  # the secondary group size
WORLD = int(os.environ["WORLD_SIZE"])
STEPS = 3
FIT = dict(gradient_clip_val=0.05, accumulate_grad_batches=2, limit_train_batches=2 * STEPS, limit_val_batches=1,
           val_check_interval=2)
BLOCK = 64  # quantization_block_size: several blocks per chunk, and a padded last block
RUNS: dict[str, Any] = {
    "zero2": {"stage": 2},
    "zero3": {},
    "hpz": {"secondary_shard_group_size": S},
    "hpz_checkpointed": {"secondary_shard_group_size": S, "activation_checkpointing": True},
    "qwz": {"quantized_weights": True, "quantization_block_size": BLOCK},
    "qwz_hpz": {"quantized_weights": True, "quantization_block_size": BLOCK, "secondary_shard_group_size": S},
    "qgz2": {"stage": 2, "quantized_gradients": True, "quantization_block_size": BLOCK},
    "qgz3": {"quantized_gradients": True, "quantization_block_size": BLOCK},
}


class Probe(L.Callback):
    """The collective payload and the engine's allocations of every training batch."""

    def __init__(self) -> None:
        self.traffic: list[dict[str, Any]] = []
        self.last = 0
        self.last_chunks: list[int] = []
        """The chunk size of each bucket of that unit."""
        """Elements of the stage 3 unit a forward runs last (0: none)."""
        self.allocations: list[int] = []

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.last = last_unit_elements(trainer.strategy)
        unit = last_unit(trainer.strategy)
        storages = trainer.strategy.storages if unit is not None else []
        self.last_chunks = [b.chunk_size for s in storages for b in s.layout.buckets if b.unit == unit]

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.counters = getattr(trainer.strategy, "traffic", Traffic())  # ddp: counts nothing
        self.counters.reset()
        self.allocated = costs.COSTS.large_allocations

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.traffic.append(self.counters.snapshot())
        self.allocations.append(costs.COSTS.large_allocations - self.allocated)


def fit(name: str) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    model, probe = TinyLM(), Probe()
    options = dict(RUNS.get(name, {}))
    stage = options.pop("stage", 3)
    stage3 = dict(persistence_threshold=0) if stage == 3 else {}
    strategy = "ddp" if name == "ddp" else ZeroStrategy(stage=stage, reduce_bucket_size=1500, **stage3, **options)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=STEPS, max_epochs=1,
                        callbacks=[probe], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, **FIT)
    trainer.fit(model)
    zero = isinstance(trainer.strategy, ZeroStrategy)
    storages = trainer.strategy.storages if zero else []
    secondary = trainer.strategy.shard_groups.secondary if zero else None
    return {"losses": list(model.losses), "traffic": probe.traffic, "allocations": probe.allocations,
            "params": {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()},
            "padded": sum(s.layout.total for s in storages),
            "root": sum(s.unit_numel(0) for s in storages if hasattr(s, "unit_numel")), "last": probe.last,
            "chunks": [b.chunk_size for s in storages for b in s.layout.buckets], "last_chunks": probe.last_chunks,
            "secondary_ranks": collectives.world_size(secondary) if secondary is not None else None,
            "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan")))}


def main() -> None:
    out = Path(sys.argv[1])
    runs = {name: fit(name) for name in ("ddp", *RUNS)}
    torch.save(runs, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
