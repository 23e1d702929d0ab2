"""One rank of the hybrid sharding run (4 ranks, ``shard_group_size=2``): ddp, then zero1-3 sharded over pairs of
ranks and replicated across the two pairs, on the same seed and data; then checkpoints crossing layouts.

Saves per run the losses, the final weights, the collective payload per batch by scope (see [Note: hybrid sharding
and its traffic] in ``groups.py``) and T, the padded flat size of the storages (Ψ rounded up per bucket). The
checkpoint chain: the zero3 k=2 checkpoint resumes a plain zero1 run (k=4) for one step, whose checkpoint resumes a
zero2 k=2 run for one more; ddp resumes its own checkpoints the same way.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import grad_norm

from lightning_zero import Traffic, ZeroStrategy
from tests.compare import last_unit_elements
from tests.models import TinyLM

warnings.filterwarnings("ignore")

K = 2  # the shard group size
WORLD = int(os.environ["WORLD_SIZE"])
STEPS = 3  # optimizer steps of the first runs
# SGD without clipping, so that the weights move with the gradients' scale (clipping and Adam would hide an error
# in it: see [Note: the gradient's scale] in tests/test_hybrid.py); accumulation; one optimizer step per epoch, so
# that every resume starts at an epoch boundary
FIT = dict(accumulate_grad_batches=2, limit_train_batches=2)
OPTIMIZER = "sgd"


class Probe(L.Callback):
    """The collective payload of every training batch, and the weights when training starts (after a restore)."""

    def __init__(self) -> None:
        self.traffic: list[dict[str, Any]] = []
        self.last = 0
        """Elements of the stage 3 unit a forward runs last (0: none)."""
        self.start: dict[str, torch.Tensor] = {}
        self.grad_norms: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if getattr(trainer.strategy, "runtime", None) is None:  # stage 3's parameters are not gathered here
            self.start = _weights(pl_module)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        """The total 2-norm of the averaged gradients (DDP's ``.grad``; ZeRO's from its shards, over the shard group)."""
        if isinstance(trainer.strategy, ZeroStrategy):
            norms = trainer.strategy.grad_norms(2)
        else:
            norms = grad_norm(pl_module, 2)
        self.grad_norms.append(float(norms["grad_2.0_norm_total"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.last = last_unit_elements(trainer.strategy)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.counters = getattr(trainer.strategy, "traffic", Traffic())  # ddp: counts nothing
        self.counters.reset()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.traffic.append(self.counters.snapshot())


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def strategy(name: str, k: Optional[int]) -> Any:
    if name == "ddp":
        return "ddp"
    stage = int(name[-1])
    # few buckets: parameters span buckets (stages 1-2), units split into several (stage 3), and gloo stays quick
    options = dict(persistence_threshold=0, reduce_bucket_size=1500) if stage == 3 else dict(reduce_bucket_size=800)
    return ZeroStrategy(stage=stage, shard_group_size=k, **options)


def fit(name: str, k: Optional[int], steps: int, ckpt: Path, resume: Optional[Path] = None) -> dict[str, Any]:
    """Train ``TinyLM`` to ``steps`` optimizer steps (from ``resume`` if given), then save ``ckpt``."""
    L.seed_everything(0, verbose=False)
    model, probe = TinyLM(optimizer=OPTIMIZER), Probe()
    trainer = L.Trainer(strategy=strategy(name, k), accelerator="cpu", devices=WORLD,
                        max_steps=steps, callbacks=[probe], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **FIT)
    trainer.fit(model, ckpt_path=resume)
    trainer.save_checkpoint(ckpt)
    storages = trainer.strategy.storages if isinstance(trainer.strategy, ZeroStrategy) else []  # ddp: none
    return {"losses": list(model.losses), "params": _weights(model), "start": probe.start, "traffic": probe.traffic,
            "grad_norms": probe.grad_norms, "last": probe.last,
            "padded": sum(s.layout.total for s in storages), "shard": sum(s.layout.shard_size for s in storages),
            "ckpt": str(ckpt)}


def main() -> None:
    out = Path(sys.argv[1])
    runs: dict[str, Any] = {}
    for name in ("ddp", "zero1", "zero2", "zero3"):
        runs[name] = fit(name, K, STEPS, out / f"{name}.ckpt")
    runs["ddp_resumed"] = fit("ddp", None, STEPS + 1, out / "ddp_resumed.ckpt", resume=out / "ddp.ckpt")
    runs["ddp_resumed_again"] = fit("ddp", None, STEPS + 2, out / "ddp_again.ckpt", resume=out / "ddp_resumed.ckpt")
    runs["plain_from_hybrid"] = fit("zero1", None, STEPS + 1, out / "plain.ckpt", resume=out / "zero3.ckpt")
    runs["hybrid_from_plain"] = fit("zero2", K, STEPS + 2, out / "hybrid.ckpt", resume=out / "plain.ckpt")
    torch.save(runs, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
