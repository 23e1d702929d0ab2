"""A small GPT trained from scratch on Shakespeare with ZeRO, through LightningCLI and a YAML config.

    python examples/gpt.py fit --config examples/configs/zero3.yaml                   # 2 CPU processes, zero3
    python examples/gpt.py fit --config examples/configs/zero3.yaml --trainer.devices 3 \\
        --trainer.max_steps 400 --ckpt_path checkpoints/gpt-zero3/last.ckpt            # resume on 3 processes
    python examples/generate.py checkpoints/gpt-zero3/last.ckpt --prompt "ROMEO:"     # sample from it

The model and the data module are ordinary Lightning code: nothing in them knows about ZeRO. The only line that does
is ``import lightning_zero``, which registers ``strategy: zero1 | zero2 | zero3`` for the YAML file. (Without it,
``lightning-zero fit --model examples.gpt.GPT --data examples.gpt.ShakespeareData ...`` runs the same.) One thing is
optional: when the strategy gives ``configure_model`` a device mesh (``tensor_parallel_size`` in
``examples/configs/zero3_tp.yaml``, 4 processes), each block cuts itself over its ``"tensor_parallel"`` dimension with
``lightning_zero.tensor_parallel``'s layers (``Block.parallelize``); under any other strategy the blocks stay whole.

Tokens are the text's UTF-8 bytes, so the model needs no vocabulary file and any text file can be the corpus.

:class:`GPT` is also the one GPT of the tests (``tests/models.py``) and the benchmarks (``benchmarks/_model.py``),
which import it as ``examples.gpt`` from the repository root.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_zero  # noqa: F401  (registers the strategy names used in examples/configs/*.yaml)
from lightning_zero.tensor_parallel import ColumnParallelLinear, RowParallelLinear

CORPUS = Path(__file__).resolve().parent / "data" / "shakespeare.txt"
VOCAB_SIZE = 256  # byte-level tokens


def encode(text: str) -> torch.Tensor:
    """Text to a 1-D tensor of byte tokens."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    """Byte tokens back to text (a cut multi-byte character becomes U+FFFD)."""
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


class Windows(Dataset):
    """Every ``context + 1``-token window of a token stream, starting each ``stride`` tokens: (inputs, targets)."""

    def __init__(self, tokens: torch.Tensor, context: int, stride: int) -> None:
        self.tokens, self.context, self.stride = tokens, context, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.context - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[index * self.stride: index * self.stride + self.context + 1]
        return window[:-1], window[1:]


class ShakespeareData(L.LightningDataModule):
    """A text file (by default the Shakespeare shipped in ``examples/data``), 90% to train on and 10% to validate."""

    def __init__(self, path: str = str(CORPUS), context: int = 64, batch_size: int = 16, stride: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        text = Path(self.hparams.path).read_text(encoding="utf-8")
        tokens = encode(text)
        split = int(0.9 * len(tokens))
        context, stride = self.hparams.context, self.hparams.stride
        self.train_set = Windows(tokens[:split], context, stride)
        self.val_set = Windows(tokens[split:], context, context)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention (dropout on its weights), then an MLP (dropout on its
    output)."""

    def __init__(self, width: int, heads: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.drop = nn.Dropout(dropout)  # no parameters: the state-dict keys do not depend on it
        self.ln1 = nn.LayerNorm(width)
        # No qkv bias: the key bias has an exactly zero gradient (softmax ignores a constant added to every score),
        # so Adam would turn pure rounding noise into lr-sized steps.
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def parallelize(self, group: Any) -> None:
        """Cut this block over the tensor-parallel group ``group`` (Megatron's layout): each rank keeps its share of
        the heads (q, k and v) and of the MLP's hidden units; the norms stay whole. The same function of the input."""
        self.heads //= torch.distributed.get_world_size(group)
        self.qkv = ColumnParallelLinear.from_linear(self.qkv, group, parts=3)
        self.proj = RowParallelLinear.from_linear(self.proj, group)
        self.mlp[0] = ColumnParallelLinear.from_linear(self.mlp[0], group)
        self.mlp[2] = RowParallelLinear.from_linear(self.mlp[2], group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)  # this rank's heads only, once parallelized
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in (q, k, v))
        p = self.drop.p if self.training else 0.0
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(attn)
        return x + self.drop(self.mlp(self.ln2(x)))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialization of a linear layer: small normal weights, zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


@dataclass(frozen=True)
class Architecture:
    """The network's shape; kept apart from ``hparams``, which a subclass may replace with its own arguments."""

    vocab_size: int
    context: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float
    checkpointing: bool
    tied: bool
    gpt2_init: bool


def lr_factor(step: int, warmup: int, total: int) -> float:
    """The learning rate's factor at ``step``: linear warm-up over ``warmup`` steps, then cosine decay to a tenth of
    the peak at step ``total`` (the trainer's ``max_steps``)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (total - warmup))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


class GPT(L.LightningModule):
    """A GPT: a token embedding tied to the head (by default), a position table of its own, ``n_layer`` blocks.

    The one GPT of the project: the tests and the benchmarks subclass it (their data, optimizer and sizes).
    ``meta_init`` builds the network in ``configure_model`` instead of ``__init__`` (the way to train models larger
    than one process holds: under zero3 no process ever holds all of it); ``checkpointing`` recomputes each block's
    activations in backward (``torch.utils.checkpoint``); ``tied=False`` gives the head weights of its own;
    ``gpt2_init`` initializes the linear layers as GPT-2 does (``False``: PyTorch's defaults; the embedding and
    position tables are always GPT-2's); ``vocab_size`` is 256 for byte tokens.
    """

    def __init__(self, n_layer: int = 4, n_head: int = 4, n_embd: int = 128, context: int = 64, dropout: float = 0.1,
                 lr: float = 3e-3, weight_decay: float = 0.1, warmup_steps: int = 30, vocab_size: int = VOCAB_SIZE,
                 meta_init: bool = False, checkpointing: bool = False, tied: bool = True,
                 gpt2_init: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.arch = Architecture(vocab_size, context, n_layer, n_head, n_embd, dropout, checkpointing, tied,
                                 gpt2_init)
        if not meta_init:
            self._build()

    def configure_model(self) -> None:
        if not hasattr(self, "blocks"):
            self._build()
        mesh = self.device_mesh  # ZeroStrategy(tensor_parallel_size=t): cut the blocks over the tensor dimension
        if mesh is not None and "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
            if not isinstance(self.blocks[0].proj, RowParallelLinear):
                for block in self.blocks:
                    block.parallelize(mesh["tensor_parallel"].get_group())

    def _build(self) -> None:
        s = self.arch
        self.wte = nn.Embedding(s.vocab_size, s.n_embd)
        self.pos = nn.Parameter(torch.zeros(s.context, s.n_embd))
        self.drop = nn.Dropout(s.dropout)
        self.blocks = nn.ModuleList(Block(s.n_embd, s.n_head, s.dropout) for _ in range(s.n_layer))
        self.ln_f = nn.LayerNorm(s.n_embd)
        self.lm_head = nn.Linear(s.n_embd, s.vocab_size, bias=False)
        if s.tied:
            self.lm_head.weight = self.wte.weight
        if s.gpt2_init:
            self.apply(_init_weights)
        nn.init.normal_(self.wte.weight, std=0.02)  # GPT-2's initialization (zero3 replays it when built on meta)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(tokens) + self.pos[: tokens.shape[1]])
        for block in self.blocks:
            if self.arch.checkpointing:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Next-token cross-entropy of a batch of (inputs, targets), in fp32."""
        inputs, targets = batch
        return F.cross_entropy(self(inputs).float().flatten(0, 1), targets.flatten())

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(self(inputs).float().flatten(0, 1), targets.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def param_groups(self) -> list[dict[str, Any]]:
        """Weight decay on the matrices, none on biases and norms: the optimizer's groups (``examples/engine_gpt.py``
        makes the same, so that the Trainer resumes its checkpoint)."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.param_groups(), lr=self.hparams.lr)
        warmup, total = self.hparams.warmup_steps, max(self.trainer.max_steps, self.hparams.warmup_steps + 1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, warmup=warmup,
                                                                                   total=total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @torch.no_grad()
    def generate(self, prompt: str, new_tokens: int, temperature: float = 0.8, top_k: Optional[int] = 40,
                 generator: Optional[torch.Generator] = None) -> str:
        """Sample ``new_tokens`` bytes after ``prompt`` and return the whole text."""
        tokens = encode(prompt).to(self.device)[None]
        for _ in range(new_tokens):
            logits = self(tokens[:, -self.arch.context:])[0, -1].float() / max(temperature, 1e-5)
            if top_k:
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, -math.inf)
            probs = torch.softmax(logits, dim=-1).cpu()
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator).to(tokens.device)[None]], 1)
        return decode(tokens[0].cpu())


def main() -> None:
    LightningCLI(GPT, ShakespeareData)


if __name__ == "__main__":
    main()
