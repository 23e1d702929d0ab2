"""The sizes, data and optimizer every GPT benchmark uses, and the LightningModules the strategies train.

[Note: one network, four wrappers]
The network is the project's one GPT (``examples/gpt.py``: tied token embedding and head, a position table owned by
the module, pre-norm blocks). :class:`BenchGPT` is the LightningModule that ``ddp`` and ``zero1``-``zero3`` train;
it builds the network in ``configure_model``, so zero3 materializes it unit by unit and never holds it in full.
:class:`FSDP2GPT` only adds ``fully_shard`` per block and at the root, as Lightning's ``ModelParallelStrategy``
expects. DeepSpeed gets the same :class:`BenchGPT`, built eagerly, as a plain module (its engine is not a Lightning
strategy on CPU). The data is a fixed random token stream; every rank reads its own slice of it through a
``DistributedSampler``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from examples.gpt import GPT


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
    "states": GPTSize(width=512, depth=8, vocab=512, seq=32, batch=2),  # 25.5M; small activations
    "states85m": GPTSize(width=768, depth=12, vocab=512, seq=32, batch=2),  # 85.4M, the same small activations
    # the sizes of the speed table (benchmarks/speed_table.py): 18.2M, 44.7M, 84.3M
    "gpt19m": GPTSize(width=448, depth=6),
    "gpt45m": GPTSize(width=640, depth=8),
    "gpt85m": GPTSize(width=768, depth=11),
    # GPU sizes (issue 27): GPT-2-medium-shaped 336M and a 1B model, at sequence 1024
    "gpt336m": GPTSize(width=1024, depth=24, vocab=32768, seq=1024, batch=8),
    "gpt1b": GPTSize(width=2048, depth=18, vocab=32768, seq=1024, batch=4),
}


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


class BenchGPT(GPT):
    """The project's GPT at one of :data:`SIZES`, on :func:`token_data`, with :func:`make_optimizer`; built in
    ``configure_model`` unless ``meta_init`` is false; ``compile_blocks`` compiles each block there
    (``torch.compile``, inductor), as a LightningModule does."""

    def __init__(self, size: GPTSize, samples: int, fused: bool = False, meta_init: bool = True,
                 compile_blocks: bool = False) -> None:
        super().__init__(n_layer=size.depth, n_head=size.heads, n_embd=size.width, context=size.seq, dropout=0.0,
                         vocab_size=size.vocab, meta_init=meta_init, gpt2_init=False)
        self.compile_blocks = compile_blocks
        self.size = size
        self.samples = samples
        self.fused = fused
        self.last_loss = float("nan")

    def configure_model(self) -> None:
        super().configure_model()
        if self.compile_blocks:
            for i, block in enumerate(self.blocks):
                self.blocks[i] = torch.compile(block)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters(), fused=self.fused)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(self.size, self.samples), batch_size=self.size.batch, shuffle=False)


class FSDP2GPT(BenchGPT):
    """The same module for Lightning's ``ModelParallelStrategy``: ``fully_shard`` each block, then the root (blocks
    compiled after sharding, as FSDP2 recommends)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        GPT.configure_model(self)
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)
        if self.compile_blocks:
            for i, block in enumerate(self.blocks):
                self.blocks[i] = torch.compile(block)
