"""One rank of the construction suite: models built in ``configure_model`` (Hugging Face GPT-2 and Llama from tiny
configs, the test GPT, a module tied the other way) trained under ddp and every ZeRO stage on the same seed.

Saves, per model and strategy, the per-step losses and the initial state (gathered in full on rank 0).
Usage: ``construction.py OUT MODELS STRATEGIES`` (comma-separated names).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoints.full import full_model_state_dict
from tests.models import VOCAB, TinyGPT, token_data

warnings.filterwarnings("ignore")


def hf_config(kind: str) -> Any:
    import transformers

    if kind == "gpt2":
        return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                       bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
                                    tie_word_embeddings=kind == "llama_tied", bos_token_id=0, eos_token_id=0,
                                    pad_token_id=0)


class HFCausalLM(L.LightningModule):
    """A user's fine-tuning module: the Hugging Face model is made in ``configure_model`` from a config."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.losses: list[float] = []

    def configure_model(self) -> None:
        import transformers

        if not hasattr(self, "lm"):
            self.lm = transformers.AutoModelForCausalLM.from_config(hf_config(self.kind))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self.lm(input_ids=tokens).logits
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(), batch_size=4)


class ReverseTied(HFCausalLM):
    """Tied the other way: the embedding takes the head's weight (eagerly, the head's initialization wins)."""

    def configure_model(self) -> None:
        if hasattr(self, "wte"):
            return
        self.wte = nn.Embedding(VOCAB, 24)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 24), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(24, VOCAB, bias=False)
        self.wte.weight = self.head.weight
        nn.init.trunc_normal_(self.blocks[1][1].weight, std=0.02)  # data-dependent (rejection sampling) in torch
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 24), persistent=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        x = self.wte(tokens)
        for block in self.blocks:
            x = x + block(x) * self.scale
        loss = F.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))
        self.losses.append(loss.item())
        return loss


class RandomFactories(HFCausalLM):
    """Weights drawn by torch's random factories inside ``configure_model`` (``nn.Parameter(torch.randn(...))``,
    ``torch.rand``, ``torch.randperm``, a generator of the module's own) and dropout in training: the draws after
    construction are ddp's only if construction left the generator where eager construction leaves it."""

    def configure_model(self) -> None:
        if hasattr(self, "wte"):
            return
        generator = torch.Generator().manual_seed(5)
        self.wte = nn.Embedding(VOCAB, 24)
        self.mix = nn.Parameter(torch.randn(24, 24) * 0.1)
        self.gate = nn.Parameter(torch.rand(24))
        self.fixed = nn.Parameter(torch.randn(24, 24, generator=generator) * 0.05)
        self.head = nn.Linear(24, VOCAB)
        self.register_buffer("order", torch.randperm(24))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        x = self.wte(tokens)[..., self.order]
        x = F.dropout(torch.tanh(x @ self.mix + x @ self.fixed) * self.gate, p=0.2, training=True)
        loss = F.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))
        self.losses.append(loss.item())
        return loss


MODELS: dict[str, Callable[[], L.LightningModule]] = {
    "gpt2": lambda: HFCausalLM("gpt2"),
    "llama_tied": lambda: HFCausalLM("llama_tied"),
    "llama": lambda: HFCausalLM("llama"),
    "gpt": lambda: TinyGPT(meta_init=True, dropout=0.1),
    "reverse_tied": lambda: ReverseTied("reverse"),
    "random_factories": lambda: RandomFactories("random"),
}


class InitialState(L.Callback):
    """The full model state as training starts (gathered to rank 0 under zero3)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.config.stage == 3:
            state = full_model_state_dict(pl_module, trainer.strategy.storages)
        else:
            state = pl_module.state_dict()
        self.state = {k: v.detach().cpu().clone() for k, v in state.items()}
        self.state |= {f"buffer:{k}": v.detach().cpu().clone() for k, v in pl_module.named_buffers()}


def run(model_name: str, strategy_name: str, world_size: int) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    model = MODELS[model_name]()
    strategy: Any = "ddp" if strategy_name == "ddp" else ZeroStrategy(stage=int(strategy_name[-1]),
                                                                        persistence_threshold=0)
    initial = InitialState()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[initial])
    trainer.fit(model)
    return {"losses": model.losses, "initial": initial.state}


def main() -> None:
    out, models, strategies = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3].split(",")
    world_size = int(__import__("os").environ["WORLD_SIZE"])
    results = {m: {s: run(m, s, world_size) for s in strategies} for m in models}
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
