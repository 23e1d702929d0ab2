"""Small checkpoints of every kind the project writes, for the tests that load them (``test_untrusted_checkpoints.py``).

The module imports only torch, Lightning and ``lightning_zero``'s public names that every version of the package had,
so that an older copy of the package can write the same checkpoints: ``tests/fixtures/checkpoints/<commit>/`` were
written by ``python -m tests.checkpoint_fixtures OUT`` with ``PYTHONPATH=<that commit's tree>:<this tree>`` (see the
README.md there). The current package writes them anew in the tests.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: Hyperparameters of :class:`Regressor` with the kinds of values Lightning keeps: a path, a tuple, a nested dict.
HPARAMS: dict[str, Any] = {"width": 4, "lr": 0.05, "data_dir": Path("data") / "train", "sizes": (4, 4),
                           "extra": {"gamma": 0.5, "note": None}}


class Regressor(L.LightningModule):
    """Two linear layers trained on a fixed batch, with Adam, a StepLR schedule and ``save_hyperparameters``."""

    def __init__(self, width: int = 4, lr: float = 0.05, data_dir: Path = Path("."), sizes: tuple[int, int] = (4, 4),
                 extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(width, sizes[0]), nn.Tanh(), nn.Linear(sizes[1], 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(8, self.hparams.width, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def write_trainer_checkpoint(out: Path, stage: int = 3) -> Path:
    """``trainer.save_checkpoint`` of a :class:`Regressor` after 2 steps under ``zero<stage>`` on one device, with a
    ``ModelCheckpoint`` callback's state."""
    L.seed_everything(0)
    trainer = L.Trainer(strategy=f"zero{stage}", accelerator="cpu", devices=1, max_steps=2, logger=False,
                        callbacks=[ModelCheckpoint(dirpath=out / "callback", monitor="loss")],
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(**HPARAMS))
    path = out / f"trainer-zero{stage}.ckpt"
    trainer.save_checkpoint(path)
    return path


def write_fabric_checkpoint(out: Path, stage: int = 2) -> Path:
    """``fabric.save`` of a :class:`Regressor` after one step under ``zero<stage>``, with user entries: a step count,
    the hyperparameters and a path."""
    L.seed_everything(0)
    fabric = L.Fabric(strategy=f"zero{stage}", accelerator="cpu", devices=1)
    fabric.launch()
    model = Regressor(**HPARAMS)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = next(iter(model.train_dataloader()))
    fabric.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    path = out / f"fabric-zero{stage}.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1, "hparams": dict(HPARAMS),
                       "data_dir": Path("data")})
    return path


if __name__ == "__main__":
    import lightning_zero  # noqa: F401 - registers the strategy names

    target = Path(sys.argv[1])
    write_trainer_checkpoint(target)
    write_fabric_checkpoint(target)
