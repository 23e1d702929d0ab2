"""A small demo: train a tiny language model with ZeRO on CPU processes and print what each rank holds.

    python examples/train_tiny.py                      # zero2, 2 CPU processes
    python examples/train_tiny.py --strategy zero1 --devices 3 --precision bf16-mixed

The LightningModule below is ordinary Lightning code; only ``strategy=`` names ZeRO.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # registers "zero1", "zero2"
from lightning_zero import expected_model_state_bytes, measure_model_states

TEXT = (
    "ZeRO removes the memory redundancies across data-parallel processes by partitioning the model states "
    "(parameters, gradients and optimizer state) instead of replicating them, while keeping the computational "
    "granularity and communication volume of data parallelism. "
) * 8


class CharLM(L.LightningModule):
    """A character-level model: embedding, a few residual MLP blocks, a head."""

    def __init__(self, vocab: int, width: int = 256, depth: int = 4, context: int = 32, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(self(inputs).float().flatten(0, 1), targets.flatten())
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class MemoryReport(L.Callback):
    """After the third backward, print the model-state bytes of each rank next to the formula in docs/stages.md."""

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != 2 or getattr(self, "done", False):
            return
        self.done = True
        measured = measure_model_states(pl_module, trainer.optimizers)
        psi = sum(p.numel() for p in pl_module.parameters())
        stage = getattr(trainer.strategy, "config", None)
        stage_number = stage.stage if stage else 0
        precision = trainer.precision
        expected = expected_model_state_bytes(psi, trainer.world_size, stage_number, precision)
        ddp = expected_model_state_bytes(psi, trainer.world_size, 0, precision)
        print(f"[rank {trainer.global_rank}] Ψ={psi:,} params; model states {measured.model_states / 2**20:.2f} MiB "
              f"(formula {expected / 2**20:.2f} MiB, DDP would hold {ddp / 2**20:.2f} MiB); "
              f"bucket buffers {measured.comm_buffers / 2**20:.2f} MiB", flush=True)


def char_dataset(context: int) -> tuple[TensorDataset, int]:
    chars = sorted(set(TEXT))
    ids = torch.tensor([chars.index(c) for c in TEXT])
    windows = ids.unfold(0, context + 1, 4)
    return TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous()), len(chars)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero2", help="zero1, zero2, zero3 or ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=30)
    args = parser.parse_args()

    L.seed_everything(0)
    data, vocab = char_dataset(context=32)
    model = CharLM(vocab)
    trainer = L.Trainer(strategy=args.strategy, accelerator="cpu", devices=args.devices, precision=args.precision,
                        max_steps=args.max_steps, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        callbacks=[MemoryReport()], enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=16, shuffle=True))
    if trainer.is_global_zero:
        print(f"final loss {trainer.callback_metrics['loss']:.3f} after {trainer.global_step} steps "
              f"with strategy={args.strategy} on {trainer.world_size} processes")


if __name__ == "__main__":
    assert lightning_zero.__version__
    main()
