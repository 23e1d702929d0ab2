"""One rank of the activation-checkpointing suite (ZeRO-R), every case in the same processes.

A GPT with dropout and a frozen norm trains under ddp (no checkpointing: the oracle) and under zero1/2/3 with
``activation_checkpointing=True``; zero2 also with offload and the contiguous buffer; zero3 also in bf16-mixed; and
two models twice the size (depth for zero3, width for zero2) for the constant-buffer check; zero3 also without any
checkpointing and with the user's own ``torch.utils.checkpoint`` around each block (the model's ``checkpointing``).
Saves, per case: losses, final weights, checkpoint stats, stage-3 gathers per unit in backward and in each training
step, the bytes all-gathered in each step (the collectives' counters), and the collective buffers' high-water marks.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from tests.models import TinyGPT

warnings.filterwarnings("ignore")

BUCKET = 600  # elements: every block spans several buckets
PREFETCH = 15_000  # elements: about one block of width 32 may be gathered ahead


class Probe(L.Callback):
    """Counts stage 3 gathers per unit during each backward; reads the buffers' high-water marks at the end."""

    def __init__(self) -> None:
        self.in_backward = False
        self.backward_gathers: list[dict[int, int]] = []
        self.step_gathers: list[dict[int, int]] = []
        self.step_gathered_bytes: list[int] = []
        self.temporary: dict[str, int] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        if getattr(strategy, "runtime", None) is None:
            return
        for engine in strategy.storages:
            original = engine.unshard_unit

            def counted(unit: int, *args: Any, original: Any = original, **kwargs: Any) -> Any:
                if self.in_backward:
                    self.backward_gathers[-1][unit] += 1
                if self.step_gathers:
                    self.step_gathers[-1][unit] += 1
                return original(unit, *args, **kwargs)

            engine.unshard_unit = counted

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:  # a step's first micro-batch: the one before is over
            self._step_boundary(trainer)
            self.step_gathers.append(Counter())

    def _step_boundary(self, trainer: L.Trainer) -> None:
        """The bytes all-gathered since the last boundary (the root's gather ahead of the next step included)."""
        now = _gathered(getattr(trainer.strategy, "traffic", None))
        if self.step_gathers:
            self.step_gathered_bytes.append(now - self._gathered_before)
        self._gathered_before = now

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self.in_backward = True
        self.backward_gathers.append(Counter())

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.in_backward = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step_boundary(trainer)
        strategy = trainer.strategy
        if not isinstance(strategy, ZeroStrategy):
            return
        runtime = strategy.runtime
        self.temporary = {
            "bucket_bytes": sum(e.reducer.peak_buffer_bytes for e in strategy.storages),  # freed before each step
            "gathered_peak": runtime.peak_gathered_bytes if runtime is not None else 0,
            "units": len(runtime.plan.names) if runtime is not None else 0,
            "prefetch_size": PREFETCH,
            "unit_numels": [sum(s.unit_numel(u) for s in runtime.storages) for u in range(len(runtime.units))]
            if runtime is not None else [],
            "grad_shards": [e.reducer.grad_shard is not None for e in strategy.storages],
            "last_unit": runtime.forward_order[-1] if runtime is not None else None,
        }


def _gathered(traffic: Any) -> int:
    """The bytes the collectives' counters say were all-gathered so far (0 without counters)."""
    return 0 if traffic is None else sum(v for k, v in traffic.snapshot()["bytes"].items() if "gather" in k)


def run(name: str, precision: str = "32-true", width: int = 32, depth: int = 3, user_checkpointing: bool = False,
        **options: Any) -> dict:
    model = TinyGPT(width=width, depth=depth, dropout=0.1, frozen=True, checkpointing=user_checkpointing)
    if name == "ddp":
        strategy: Any = "ddp_find_unused_parameters_true"
    else:
        options.setdefault("activation_checkpointing", True)
        strategy = ZeroStrategy(stage=int(name[-1]), reduce_bucket_size=BUCKET, persistence_threshold=0,
                                prefetch_size=PREFETCH, **options)
    probe = Probe()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, precision=precision, max_steps=3,
                        accumulate_grad_batches=2, gradient_clip_val=0.05, callbacks=[probe], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    activations = getattr(trainer.strategy, "activations", None)
    return {
        "losses": list(model.losses),
        "params": {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()},
        "keys": list(model.state_dict()),
        "wrapped_after_fit": any("forward" in block.__dict__ for block in model.blocks),
        "stats": vars(activations.stats).copy() if activations is not None else None,
        "blocks": activations.names if activations is not None else [],
        "backward_gathers": [dict(c) for c in probe.backward_gathers],
        "step_gathers": [dict(c) for c in probe.step_gathers],
        "step_gathered_bytes": probe.step_gathered_bytes,
        "temporary": probe.temporary,
    }


CASES = {
    "ddp": lambda: run("ddp"),
    "zero1": lambda: run("zero1"),
    "zero2": lambda: run("zero2"),
    "zero3": lambda: run("zero3"),
    "zero2_offload_contiguous": lambda: run("zero2", activation_offload=True, contiguous_checkpoints=True),
    "zero3_bf16": lambda: run("zero3", precision="bf16-mixed"),
    "zero3_bf16_plain": lambda: run("zero3", precision="bf16-mixed", activation_checkpointing=False),
    "zero3_deep": lambda: run("zero3", depth=6),
    "zero3_plain": lambda: run("zero3", activation_checkpointing=False),
    "zero3_user": lambda: run("zero3", activation_checkpointing=False, user_checkpointing=True),
    "zero2_wide": lambda: run("zero2", width=64),
    "zero2_partition_refused": lambda: refused(),
}


def refused() -> dict:
    """Data-parallel ranks see different data: naming them as a Pa group must fail with a clear error."""
    try:
        run("zero2", activation_partition_group=[0, 1])
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": ""}


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CASES)
    results = {}
    for name in names:
        L.seed_everything(0, verbose=False)
        results[name] = CASES[name]()
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
