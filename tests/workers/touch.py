"""One rank of the "touched around the step" suite (tests/test_touch.py): what client code does to a model outside
forward and backward, under Fabric's ``ddp`` (the oracle) and ``zero1/2/3``.

- ``pretrain``: LitGPT's ``pretrain.py`` sequence: ``init_module(empty_init=True)``, then ``initialize_weights``
  (``reset_parameters`` of every module replaced by a seeded ``normal_``/``zeros_`` init, the model's own rebuilding
  its RoPE cache as new buffers), then ``setup``; weights right after setup and after 3 AdamW steps.
- ``load``: LitGPT's ``load_checkpoint`` sequence: ``setup`` then ``model.load_state_dict(sd)``, 2 steps.
- ``read``: a weight read between steps (an error under zero3, the value elsewhere), the same read inside
  ``gathered_parameters()``, and ``grad_norms()`` after a backward against Lightning's ``grad_norm`` under ddp.
"""

from __future__ import annotations

import math
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import grad_norm
from torch import nn

import lightning_zero  # noqa: F401  (registers the strategies)
from lightning_zero.stage3.guard import ParameterNotGatheredError

warnings.filterwarnings("ignore")
WIDTH, BLOCKS, VOCAB, SEQ = 16, 2, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(self.norm(x) * cos)))


class GPT(nn.Module):
    """LitGPT's shape of model: blocks in a ModuleList, a RoPE-like cache rebuilt by ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("cos", torch.empty(0), persistent=False)

    def reset_parameters(self) -> None:
        self.cos = torch.arange(WIDTH, device=self.cos.device).float().div(WIDTH).cos()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, self.cos)
        return self.head(x)


def initialize_weights(model: nn.Module) -> None:
    """LitGPT's ``initialize_weights`` for every non-FSDP strategy."""
    def init_weights(module: nn.Module, std: float) -> None:
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)

    for mod in model.modules():
        if isinstance(mod, (nn.Embedding, nn.Linear)):
            mod.reset_parameters = partial(init_weights, mod, std=math.sqrt(2.0 / 5 / WIDTH))
    for mod in model.modules():
        if isinstance(mod, Block):
            mod.proj.reset_parameters = partial(init_weights, mod.proj, std=1 / math.sqrt(WIDTH) / BLOCKS)
    for mod in model.modules():
        if callable(getattr(mod, "reset_parameters", None)):
            mod.reset_parameters()


def batches(rank: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (2, SEQ + 1), generator=g) for _ in range(n)]


def make_fabric(strategy: str) -> L.Fabric:
    options = {"persistence_threshold": 0} if strategy == "zero3" else {}
    chosen: Any = strategy
    if options:
        chosen = lightning_zero.ZeroFabricStrategy(stage=3, **options)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=chosen)
    fabric.launch()
    return fabric


def train(fabric: L.Fabric, model: Any, opt: Any, steps: int) -> list[float]:
    losses = []
    for idx in batches(fabric.global_rank, steps):
        logits = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def pretrain(strategy: str) -> dict[str, Any]:
    fabric = make_fabric(strategy)
    fabric.seed_everything(7, verbose=False)
    with fabric.init_module(empty_init=True):
        model = GPT()
    initialize_weights(model)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    start = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    losses = train(fabric, model, opt, 3)
    return {"start": start, "losses": losses, "end": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}


def load(strategy: str, source: dict[str, torch.Tensor]) -> dict[str, Any]:
    fabric = make_fabric(strategy)
    fabric.seed_everything(3, verbose=False)
    with fabric.init_module(empty_init=False):
        model = GPT()
    model.reset_parameters()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    result = model.load_state_dict(source)
    loaded = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    losses = train(fabric, model, opt, 2)
    return {"result": (result.missing_keys, result.unexpected_keys), "loaded": loaded, "losses": losses}


def read(strategy: str, source: dict[str, torch.Tensor]) -> dict[str, Any]:
    fabric = make_fabric(strategy)
    with fabric.init_module(empty_init=False):
        model = GPT()
    model.reset_parameters()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model.load_state_dict(source)
    train(fabric, model, opt, 1)
    weight = model.module.head.weight
    try:
        outside: Any = weight.norm().item()
    except ParameterNotGatheredError as error:
        outside = f"error: {error}"
    with fabric.strategy.gathered_parameters() if strategy != "ddp" else _null():
        inside = weight.norm().item()
    idx = batches(fabric.global_rank, 1)[0]
    logits = model(idx[:, :-1])
    fabric.backward(nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1)))
    if strategy == "ddp":
        norms = {k: v.item() for k, v in grad_norm(model.module, 2).items()}
    else:
        norms = {k: v.item() for k, v in fabric.strategy.grad_norms(2).items()}
    return {"outside": outside, "inside": inside, "norms": norms}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def main() -> None:
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    torch.manual_seed(11)
    source = {k: torch.randn(v.shape) for k, v in GPT().state_dict().items()}
    result = {"pretrain": pretrain(strategy), "load": load(strategy, source), "read": read(strategy, source)}
    rank = int(__import__("os").environ["RANK"])
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
