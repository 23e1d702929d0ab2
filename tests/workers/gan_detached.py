"""One rank of the GAN loop in the order of Fabric's DCGAN example (tests/test_carry.py): ``fake = g(z)``; the
discriminator's step on ``fake.detach()``; then the generator's loss through the discriminator on the same ``fake``,
whose graph the discriminator's backward left pending. Under ``ddp`` (the oracle), ``zero1/2``, ``zero3`` with the
default units (each model one root unit) and ``zero3`` with every layer a unit (``persistence_threshold=0``).

Saves per strategy the losses and the weights of both models after every step.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_zero import ZeroFabricStrategy

warnings.filterwarnings("ignore")
STEPS = 3
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero3-units")


def make(name: str) -> tuple[Fabric, Any, Any, Any, Any]:
    strategy: Any = name
    if name != "ddp":
        options = {"persistence_threshold": 0} if name.endswith("units") else {}
        strategy = ZeroFabricStrategy(stage=int(name[4]), **options)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    d = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    g, opt_g = fabric.setup(g, torch.optim.Adam(g.parameters(), lr=1e-2, betas=(0.5, 0.9)))
    d, opt_d = fabric.setup(d, torch.optim.Adam(d.parameters(), lr=1e-2, betas=(0.5, 0.9)))
    return fabric, g, d, opt_g, opt_d


def run(name: str) -> dict[str, Any]:
    fabric, g, d, opt_g, opt_d = make(name)
    losses: list[float] = []
    weights: list[dict[str, torch.Tensor]] = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(1000 * fabric.global_rank + step)
        real, noise = torch.randn(4, 4, generator=generator) + 1.0, torch.randn(4, 8, generator=generator)
        fake = g(noise)
        d_loss = F.softplus(-d(real)).mean() + F.softplus(d(fake.detach())).mean()
        opt_d.zero_grad()
        fabric.backward(d_loss)
        opt_d.step()
        g_loss = F.softplus(-d(fake)).mean()
        opt_g.zero_grad()
        fabric.backward(g_loss)
        opt_g.step()
        losses += [d_loss.item(), g_loss.item()]
        weights.append(gathered_weights(fabric, name, g, d))
    return {"losses": losses, "weights": weights}


def gathered_weights(fabric: Fabric, name: str, *models: Any) -> dict[str, torch.Tensor]:
    with fabric.strategy.gathered_parameters() if name != "ddp" else torch.no_grad():
        return {f"{i}.{k}": v.detach().clone() for i, m in enumerate(models) for k, v in m.state_dict().items()}


def main() -> None:
    out = Path(sys.argv[1])
    runs = {name: run(name) for name in STRATEGIES}
    torch.save(runs, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
