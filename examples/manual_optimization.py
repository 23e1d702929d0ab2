"""Manual optimization with two optimizers under ZeRO: a small GAN learns points on a circle.

    python examples/manual_optimization.py                        # zero2 on 2 CPU processes
    python examples/manual_optimization.py --stage 3 --devices 3 --max-steps 2000

``training_step`` drives both optimizers itself (``automatic_optimization = False``), as in Lightning's GAN example:
``manual_backward``, ``clip_gradients`` and ``optimizer.step()`` are Lightning's own calls, and each optimizer's
state is sharded across the processes by the strategy. At the end rank 0 prints how far the generated points are
from the circle (the generator starts at about 0.9 and should end well below 0.2).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy

NOISE = 8


class CircleGAN(L.LightningModule):
    """Generator: noise to a 2-D point. Discriminator: a 2-D point to a logit (real or generated)."""

    def __init__(self, width: int = 128, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(NOISE, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                       nn.Linear(width, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, width), nn.LeakyReLU(0.2), nn.Linear(width, width),
                                           nn.LeakyReLU(0.2), nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        noise = torch.randn(real.shape[0], NOISE, device=self.device)

        fake = self.generator(noise)
        d_loss = (F.softplus(-self.discriminator(real)).mean() + F.softplus(self.discriminator(fake.detach())).mean())
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt_d.step()

        g_loss = F.softplus(-self.discriminator(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)

    def configure_optimizers(self) -> Any:
        betas = (0.5, 0.99)
        return (torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=betas),
                torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=betas))

    @torch.no_grad()
    def distance_to_circle(self, samples: int = 2000) -> float:
        """Mean distance of generated points to the unit circle."""
        points = self.generator(torch.randn(samples, NOISE, generator=torch.Generator().manual_seed(0)))
        return (points.norm(dim=1) - 1.0).abs().mean().item()


def circle_points(n: int, seed: int = 0) -> TensorDataset:
    """Points on the unit circle, with a little noise."""
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(n, generator=g) * 2 * math.pi
    points = torch.stack([angle.cos(), angle.sin()], dim=1) + 0.02 * torch.randn(n, 2, generator=g)
    return TensorDataset(points)


def main() -> None:
    parser = argparse.ArgumentParser(description="A GAN with two optimizers, trained with ZeRO.")
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=1200)
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()

    L.seed_everything(0)
    model = CircleGAN()
    before = model.distance_to_circle()
    trainer = L.Trainer(strategy=ZeroStrategy(stage=args.stage), accelerator="cpu", devices=args.devices,
                        precision=args.precision, max_steps=args.max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = DataLoader(circle_points(8192), batch_size=64, shuffle=True, drop_last=True)
    trainer.fit(model, data)
    after = model.distance_to_circle()  # after `fit` every rank holds the full trained parameters again (any stage)
    if trainer.is_global_zero:
        print(f"distance of generated points to the circle: {before:.3f} before training, {after:.3f} after "
              f"{trainer.global_step // 2} steps of each optimizer (zero{args.stage}, {trainer.world_size} processes)")


if __name__ == "__main__":
    main()
