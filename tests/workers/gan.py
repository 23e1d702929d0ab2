"""One rank of the several-models suite (tests/test_carry.py): a small GAN on one Fabric, the generator set up with
``fabric.setup(g, opt_g)`` and the discriminator with ``setup_module`` + ``setup_optimizers``, under ``ddp`` (the
oracle) and ``zero1/2/3``. Each step: the generator's loss through the discriminator, then the discriminator's loss
with its gradients clipped by norm. After step ``SAVE`` one checkpoint of both models, both optimizers and the step;
a second Fabric with fresh models loads it and runs the remaining steps; and the first run's models load it too,
right after their last step and again after an evaluation forward (a rollback into models that trained), each time
running the remaining steps again.

Saves per strategy the losses, the clipping norms (and their shapes), the weights at the save and at the end, and the
resumed and the rolled-back runs' steps, losses and end weights.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_zero import ZeroFabricStrategy

warnings.filterwarnings("ignore")
STEPS, SAVE = 4, 2


class Scaled(nn.Sequential):
    """Layers and a gain of the model's own: under zero3 the gain is the root unit, which an optimizer step gathers
    ahead of the next forward (so a load finds it gathered)."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain


def models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    g = Scaled(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    d = Scaled(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    return g, d


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 4, generator=generator) * 0.5 + 1.0, torch.randn(4, 8, generator=generator)


def weights(fabric: Fabric, strategy: str, *modules: nn.Module) -> dict[str, torch.Tensor]:
    with fabric.strategy.gathered_parameters() if strategy != "ddp" else torch.no_grad():
        return {f"{i}.{k}": v.detach().clone() for i, m in enumerate(modules) for k, v in m.state_dict().items()}


def make(strategy: str) -> tuple[Fabric, Any, Any, Any, Any]:
    if strategy != "ddp":
        stage = int(strategy[-1])
        strategy = ZeroFabricStrategy(stage=stage, **({"persistence_threshold": 0} if stage == 3 else {}))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    g, d = models()
    g, opt_g = fabric.setup(g, torch.optim.Adam(g.parameters(), lr=1e-2, betas=(0.5, 0.9)))
    d = fabric.setup_module(d)
    opt_d = fabric.setup_optimizers(torch.optim.SGD(d.parameters(), lr=5e-2, momentum=0.8))
    return fabric, g, d, opt_g, opt_d


def train(fabric: Fabric, g: Any, d: Any, opt_g: Any, opt_d: Any, steps: range, out: dict[str, Any],
          save: Optional[Path] = None, strategy: str = "") -> None:
    for step in steps:
        real, noise = batch(fabric.global_rank, step)
        fake = g(noise)
        g_loss = F.softplus(-d(fake)).mean()
        opt_g.zero_grad()
        fabric.backward(g_loss)
        opt_g.step()
        d_loss = F.softplus(-d(real)).mean() + F.softplus(d(fake.detach())).mean()
        opt_d.zero_grad()
        fabric.backward(d_loss)
        norm = fabric.clip_gradients(d, opt_d, max_norm=0.3)
        opt_d.step()
        out["losses"] += [g_loss.item(), d_loss.item()]
        out["norms"].append((norm.item(), tuple(norm.shape)))
        if save is not None and step + 1 == SAVE:
            fabric.save(save, {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d, "step": step + 1})
            out["saved"] = weights(fabric, strategy, g, d)


def run(strategy: str, out_dir: Path) -> dict[str, Any]:
    path = out_dir / f"{strategy}.ckpt"
    fabric, g, d, opt_g, opt_d = make(strategy)
    out: dict[str, Any] = {"losses": [], "norms": [], "ckpt": str(path)}
    train(fabric, g, d, opt_g, opt_d, range(STEPS), out, save=path, strategy=strategy)
    out["end"] = weights(fabric, strategy, g, d)
    out["rolled_back"] = resume(fabric, path, g, d, opt_g, opt_d, strategy)  # right after their last step
    out["after_eval"] = resume(fabric, path, g, d, opt_g, opt_d, strategy, evaluate=True)
    fabric, g, d, opt_g, opt_d = make(strategy)  # fresh models and optimizers, then the checkpoint
    out["resumed"] = resume(fabric, path, g, d, opt_g, opt_d, strategy)
    return out


def resume(fabric: Fabric, path: Path, g: Any, d: Any, opt_g: Any, opt_d: Any, strategy: str,
           evaluate: bool = False) -> dict[str, Any]:
    """Load the checkpoint into these models and optimizers (after an evaluation forward of both models with
    ``evaluate``) and train the remaining steps."""
    if evaluate:
        with torch.no_grad():
            d(g(batch(fabric.global_rank, 99)[1]))
    state: dict[str, Any] = {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d, "step": 0}
    fabric.load(path, state)
    resumed: dict[str, Any] = {"losses": [], "norms": [], "step": state["step"]}
    train(fabric, g, d, opt_g, opt_d, range(state["step"], STEPS), resumed)
    resumed["end"] = weights(fabric, strategy, g, d)
    return resumed


def main() -> None:
    out = Path(sys.argv[1])
    runs = {strategy: run(strategy, out) for strategy in ("ddp", "zero1", "zero2", "zero3")}
    torch.save(runs, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
