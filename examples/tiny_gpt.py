"""The project's GPT (``gpt.py``) at toy size on a fixed token task: what the tests and the benchmarks train when
the model's size matters less than its shape (tied embeddings, blocks, norms) and speed matters more."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from examples.gpt import GPT

VOCAB = 37  # odd sizes on purpose: shards and buckets must pad


def token_data(n: int = 96, seq: int = 8, seed: int = 1234) -> TensorDataset:
    """A fixed, learnable token task: predict the next token of noisy arithmetic sequences."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    seqs = (start + step * torch.arange(seq + 1)) % VOCAB
    return TensorDataset(seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous())


class TinyGPT(GPT):
    """The project's GPT (examples/gpt.py) on the tests' token task: vocabulary 37, two heads, 8 positions.

    ``meta_init`` builds the network in ``configure_model`` (the way to train models larger than one rank);
    ``dropout`` adds dropout in every block; ``frozen`` freezes the first block's attention norm.
    """

    def __init__(self, width: int = 32, depth: int = 3, context: int = 8, lr: float = 3e-3,
                 meta_init: bool = False, checkpointing: bool = False, dropout: float = 0.0,
                 frozen: bool = False) -> None:
        super().__init__(n_layer=depth, n_head=2, n_embd=width, context=context, dropout=dropout, lr=lr,
                         vocab_size=VOCAB, meta_init=meta_init, checkpointing=checkpointing,
                         gpt2_init=False)
        self.hparams.clear()  # GPT saved its own arguments too: keep this class's, which load_from_checkpoint passes
        self.save_hyperparameters()
        self.losses: list[float] = []

    def _build(self) -> None:
        super()._build()
        if self.hparams.get("frozen", False):
            self.blocks[0].ln1.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(), batch_size=4, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(token_data(n=24, seed=99), batch_size=4)
