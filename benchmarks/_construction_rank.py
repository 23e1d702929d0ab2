"""One rank of ``python -m benchmarks.construction``: build a Hugging Face GPT-2 in ``configure_model`` under zero3."""

from __future__ import annotations

import os
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any


import lightning as L
import torch

from lightning_zero import ZeroStrategy

warnings.filterwarnings("ignore")


def config(layers: int, width: int) -> Any:
    import transformers

    return transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=50257,
                                   n_positions=1024, bos_token_id=0, eos_token_id=0)


class Build(L.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers, self.width = layers, width

    def configure_model(self) -> None:
        import transformers

        self.lm = transformers.AutoModelForCausalLM.from_config(config(self.layers, self.width))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.lm(input_ids=batch[0]).logits.mean()

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 8, dtype=torch.long)))


class Probe(L.Callback):
    def __init__(self) -> None:
        self.baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.start = time.perf_counter()
        self.result: dict[str, Any] = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        engines = strategy.storages
        plan = strategy.engine.unit_plan
        unit_bytes: dict[int, int] = {}
        for p in {id(p): p for e in engines for p in e.params}.values():
            unit_bytes[plan.unit(p)] = unit_bytes.get(plan.unit(p), 0) + p.numel() * 4
        self.result = {
            "growth": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.baseline) * 1024,
            "setup": time.perf_counter() - self.start,
            "params": sum(p.numel() for e in engines for p in e.params),
            "full": sum(p.numel() * 4 for e in engines for p in e.params),
            "shard": sum(_shard_bytes(e) for e in engines),
            "unit": max(unit_bytes.values(), default=0),  # the root unit (tied embedding) included
        }
        torch.save(self.result, Path(sys.argv[1]) / f"rank{trainer.global_rank}.pt")
        raise SystemExit(0)  # setup is what is measured


def _shard_bytes(engine: Any) -> int:
    """This rank's master and working shards (one tensor in fp32, where they are the same)."""
    tensors = {id(t): t for t in (engine.master_storage, engine.working_shard)
               if t is not None}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def main() -> None:
    layers, width = int(sys.argv[2]), int(sys.argv[3])
    L.seed_everything(0, verbose=False)
    probe = Probe()
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[probe])
    try:
        trainer.fit(Build(layers, width))
    except SystemExit:
        pass


if __name__ == "__main__":
    main()
