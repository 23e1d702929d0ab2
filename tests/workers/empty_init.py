"""One rank of the ``empty_init`` suite (tests/test_carry.py): a LitGPT-shaped model (tests/litgpt_shaped.py) built
the way LitGPT's scripts build it for sharded strategies, ``init_module(empty_init=True)`` and no initialization after,
and trained, against ``ddp`` building it eagerly on the same seed.

- ``fabric_<strategy>``: a Fabric loop (AdamW, clipping by norm, 3 steps); ``ddp`` builds under ``init_module()``,
  ``zero3`` under ``init_module(empty_init=True)``. Saves the weights right after setup, the losses, the gradient
  norms ``clip_gradients`` returned and the final weights.
- ``trainer_<strategy>``: the same model in a LightningModule built under ``trainer.init_module(empty_init=...)``
  (``True`` for zero3), fitted 2 steps; saves the losses and the final weights.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401  (registers the strategies)
from tests.litgpt_shaped import GPT, Config

warnings.filterwarnings("ignore")
CONFIG = Config()
STEPS, SEQ = 3, 16


def data(rank: int, steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, CONFIG.vocab_size, (2, SEQ + 1), generator=generator) for _ in range(steps)]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state | {f"buffer:{k}": v.detach().clone() for k, v in model.named_buffers()}  # the RoPE cache too


def fabric_run(strategy: str) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    with fabric.init_module(empty_init=strategy == "zero3"):
        model = GPT(CONFIG)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))
    with fabric.strategy.gathered_parameters() if strategy != "ddp" else torch.no_grad():
        start = weights(model.module)
    losses, norms = [], []
    for idx in data(fabric.global_rank, STEPS):
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, CONFIG.padded_vocab_size), idx[:, 1:].reshape(-1))
        fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=1.0))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if strategy != "ddp":
        fabric.strategy.teardown()  # the whole weights back in the module (a collective)
    return {"start": start, "losses": losses, "norms": norms, "end": weights(model.module)}


class LitModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(CONFIG)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (idx,) = batch
        logits = self.model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, CONFIG.padded_vocab_size), idx[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.cat(data(0, 4))), batch_size=2)


def trainer_run(strategy: str) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with trainer.init_module(empty_init=strategy == "zero3"):
        module = LitModel()
    trainer.fit(module)
    return {"losses": module.losses, "end": weights(module.model)}


def main() -> None:
    out = Path(sys.argv[1])
    runs = {f"fabric_{s}": fabric_run(s) for s in ("ddp", "zero3")}
    runs |= {f"trainer_{s}": trainer_run(s) for s in ("ddp", "zero3")}
    torch.save(runs, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
