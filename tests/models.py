"""Small LightningModules for the tests: ordinary user code that knows nothing about ZeRO."""

from __future__ import annotations

from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from examples.gpt import Block
from examples.tiny_gpt import VOCAB, TinyGPT, token_data

__all__ = ["Block", "TinyGPT"]  # re-exported: configs name tests.models.Block and tests.models.TinyGPT

class TinyLM(L.LightningModule):
    """Embedding, two residual MLP blocks with LayerNorm, a head; AdamW with decay and no-decay groups.

    ``optimizer`` picks the optimizer; ``frozen`` freezes the first block's LayerNorm and adds a parameter that is in
    no optimizer, as fine-tuning code does.
    """

    def __init__(self, optimizer: str = "adamw", width: int = 24, lr: float = 3e-3, frozen: bool = False,
                 batch_size: int = 4, scheduler: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(2)
        )
        self.head = nn.Linear(width, VOCAB)
        if frozen:
            self.unused_scale = nn.Parameter(torch.ones(3))  # trainable, but in no optimizer
            for p in self.blocks[0][0].parameters():
                p.requires_grad_(False)
        self.losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens).float().reshape(-1, VOCAB), targets.reshape(-1))
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = [p for n, p in self.named_parameters() if not (hp.frozen and n == "unused_scale")]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        optimizer = _make_optimizer(hp.optimizer, decay, no_decay, hp.lr)
        if not hp.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(), batch_size=self.hparams.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(token_data(n=24, seed=99), batch_size=self.hparams.batch_size)


class OverflowOnRank1(TinyLM):
    """Rank 1 produces an infinite gradient at step 2: every rank must skip that step together."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 2 and self.global_rank == 1:
            loss = loss * torch.tensor(float("inf"))
        return loss


def _make_optimizer(name: str, decay: list, no_decay: list, lr: float) -> torch.optim.Optimizer:
    makers: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "adamw": lambda: torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": lr * 2}], lr=lr
        ),
        "sgd": lambda: torch.optim.SGD(
            [{"params": decay}, {"params": no_decay, "momentum": 0.5}], lr=lr * 10, momentum=0.9, weight_decay=1e-3
        ),
        "adafactor": lambda: torch.optim.Adafactor([{"params": decay}, {"params": no_decay, "lr": lr}], lr=lr * 3),
        "adam": lambda: torch.optim.Adam(decay + no_decay, lr=lr),
    }
    return makers[name]()


class TinyGAN(L.LightningModule):
    """Manual optimization with two optimizers, as in Lightning's GAN example."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))
        self.discriminator = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        fake = self.generator(noise)
        g_loss = F.softplus(-self.discriminator(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        d_loss = F.softplus(-self.discriminator(real)).mean() + F.softplus(self.discriminator(fake.detach())).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
        opt_d.step()
        self.losses += [g_loss.item(), d_loss.item()]

    def configure_optimizers(self) -> Any:
        return (torch.optim.Adam(self.generator.parameters(), lr=1e-2, betas=(0.5, 0.9)),
                torch.optim.SGD(self.discriminator.parameters(), lr=5e-2, momentum=0.8))

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(7)
        real = torch.randn(48, 4, generator=g) * 0.5 + 1.0
        return DataLoader(TensorDataset(real, torch.randn(48, 8, generator=g)), batch_size=4)


class _Counted:
    """Counts ``step`` and ``zero_grad`` calls (the counts dict is shared with Lightning's wrapper of the optimizer)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = {"step": 0, "zero_grad": 0}

    def step(self, closure: Any = None) -> Any:
        self.calls["step"] += 1
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls["zero_grad"] += 1
        super().zero_grad(set_to_none)  # type: ignore[misc]


class CountingSGD(_Counted, torch.optim.SGD):
    """SGD that counts its calls."""


class CountingAdam(_Counted, torch.optim.Adam):
    """Adam that counts its calls."""


class SharedOptimizers(L.LightningModule):
    """Three optimizers over shared parameters, stepped by manual optimization in three ways.

    SGD (two param groups) and Adam hold every parameter of ``layer``; a third optimizer (AdamW, or Adafactor with
    ``third="adafactor"``) holds the last Linear only. Batches cycle through: SGD steps with a closure; Adam steps
    after gradient clipping; all three step on one backward; Adam steps on two backwards between which the third
    optimizer's ``zero_grad`` cleared the last Linear's gradients only. SGD and Adam have their own LR schedulers.
    ``automatic=True`` keeps automatic optimization, which Lightning refuses with several optimizers.
    """

    def __init__(self, third: str = "adamw", automatic: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = automatic
        self.layer = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.losses: list[float] = []

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.automatic_optimization:
            return self._loss(batch)
        sgd, adam, third = self.optimizers()
        phase = batch_idx % 4
        if phase == 0:
            def closure() -> torch.Tensor:
                loss = self._loss(batch)
                sgd.zero_grad()
                self.manual_backward(loss)
                return loss

            loss = sgd.step(closure=closure)
        elif phase == 1:
            loss = self._loss(batch)
            adam.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(adam, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            adam.step()
        elif phase == 2:  # one backward, three steps: each steps on the same gradients, from the last one's weights
            for opt in (sgd, adam, third):
                opt.zero_grad()
            loss = self._loss(batch)
            self.manual_backward(loss)
            for opt in (sgd, adam, third):
                opt.step()
        else:  # the first Linear accumulates two backwards, the last Linear keeps the second one's gradient only
            adam.zero_grad()
            self.manual_backward(self._loss(batch) * 0.5)
            third.zero_grad()
            loss = self._loss(batch)
            self.manual_backward(loss)
            adam.step()
        sgd_schedule, adam_schedule = self.lr_schedulers()
        sgd_schedule.step()
        if phase == 1:
            adam_schedule.step()
        self.log(f"loss_phase{phase}", loss)
        self.losses.append(loss.item())

    def configure_optimizers(self) -> Any:
        weights = [p for p in self.layer.parameters() if p.dim() == 2]
        biases = [p for p in self.layer.parameters() if p.dim() == 1]
        sgd = CountingSGD([{"params": weights, "momentum": 0.9}, {"params": biases, "lr": 0.1}], lr=0.05)
        adam = CountingAdam(self.layer.parameters(), lr=1e-2)
        last = self.layer[2].parameters()
        third = (torch.optim.Adafactor(last, lr=1e-2) if self.hparams.third == "adafactor"
                 else torch.optim.AdamW(last, lr=5e-3, weight_decay=0.1))
        schedulers = [torch.optim.lr_scheduler.StepLR(sgd, step_size=2, gamma=0.5),
                      torch.optim.lr_scheduler.ExponentialLR(adam, gamma=0.9)]
        return [sgd, adam, third], schedulers

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(64, 6, generator=g)
        return DataLoader(TensorDataset(x, torch.sin(x[:, :3]) + 0.1 * torch.randn(64, 3, generator=g)),
                          batch_size=4)

