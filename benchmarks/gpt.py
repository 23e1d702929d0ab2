"""The model every strategy of ``compare.py`` trains: a GPT-style network, the same LightningModule around it, and
the same data.

[Note: one network, four wrappers]
:class:`GPT` is a plain ``nn.Module`` (tied token embedding and head, a learned position table, pre-norm blocks
from ``tests/models.py``). :class:`BenchGPT` is the LightningModule that ``ddp`` and ``zero1``-``zero3`` train; it
builds the network in ``configure_model``, so zero3 materializes it unit by unit and never holds it in full.
:class:`FSDP2GPT` only adds ``fully_shard`` per block and at the root, as Lightning's ``ModelParallelStrategy``
expects. DeepSpeed gets the same :class:`GPT` directly (its engine is not a Lightning strategy on CPU). The data is
a fixed random token stream; every rank reads its own slice of it through a ``DistributedSampler``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.models import Block


@dataclass(frozen=True)
class GPTSize:
    """Shape of the network and of one rank's batch."""

    width: int
    depth: int
    vocab: int = 8192
    seq: int = 128
    batch: int = 4
    """Sequences per rank per step."""

    @property
    def heads(self) -> int:
        return max(1, self.width // 64)

    def num_params(self) -> int:
        """Trainable parameters (the head is tied to the embedding): Ψ of the paper."""
        w = self.width
        block = 3 * w * w + (w * w + w) + 2 * 2 * w + (4 * w * w + 4 * w) + (4 * w * w + w)
        return self.vocab * w + self.seq * w + self.depth * block + 2 * w

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "params": self.num_params()}


#: Named sizes for ``--sizes``; ``medium`` is the ~20M-parameter model of the speed targets.
SIZES = {
    "tiny": GPTSize(width=64, depth=2, vocab=512, seq=32, batch=2),
    "small": GPTSize(width=256, depth=4),
    "medium": GPTSize(width=512, depth=6),
    "large": GPTSize(width=768, depth=12),
    "states": GPTSize(width=512, depth=8, vocab=512, seq=32, batch=2),  # 25.3M; activations negligible (issue 12)
}


class GPT(nn.Module):
    """Token embedding tied to the head, a position table, pre-norm transformer blocks, a final norm."""

    def __init__(self, size: GPTSize) -> None:
        super().__init__()
        self.wte = nn.Embedding(size.vocab, size.width)
        self.pos = nn.Parameter(torch.empty(size.seq, size.width))
        self.blocks = nn.ModuleList(Block(size.width, heads=size.heads) for _ in range(size.depth))
        self.ln_f = nn.LayerNorm(size.width)
        self.lm_head = nn.Linear(size.width, size.vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialization for the tables this module owns (also used to materialize them from meta)."""
        if not self.pos.is_meta:
            nn.init.normal_(self.pos, std=0.02)
            nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def token_data(size: GPTSize, samples: int, seed: int = 1234) -> TensorDataset:
    """``samples`` random sequences of ``size.seq + 1`` tokens (inputs and next-token targets), fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, size.vocab, (samples, size.seq + 1), generator=g)
    return TensorDataset(seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous())


def make_optimizer(params: Any, lr: float = 3e-4, fused: bool = False) -> torch.optim.Optimizer:
    """The one optimizer of every run: AdamW, fp32, the foreach kernels (``fused``: the fused ones, what an
    offloaded run's CPU step should use)."""
    if fused:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, foreach=True)


class BenchGPT(L.LightningModule):
    """:class:`GPT` as an ordinary LightningModule, built in ``configure_model``."""

    def __init__(self, size: GPTSize, samples: int, fused: bool = False) -> None:
        super().__init__()
        self.size = size
        self.samples = samples
        self.fused = fused
        self.last_loss = float("nan")

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = GPT(self.size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.net.loss(*batch)
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters(), fused=self.fused)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(self.size, self.samples), batch_size=self.size.batch, shuffle=False)


class FSDP2GPT(BenchGPT):
    """The same module for Lightning's ``ModelParallelStrategy``: ``fully_shard`` each block, then the root."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)
