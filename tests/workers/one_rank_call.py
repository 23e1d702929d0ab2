"""A user's script under zero3 at 2 ranks whose callback calls a collective on rank 0 only, at the end of the first
training batch: ``argv``: output directory, then ``state_dict`` (``pl_module.state_dict()``) or ``save``
(``trainer.save_checkpoint``). Rank 1 goes on to the next step and never makes the call, so rank 0's check is
never answered: both ranks must end with the one-line error, well before the process group's timeout.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.process import user_calls
from tests.models import TinyGPT

warnings.filterwarnings("ignore")
user_calls.CALL_TIMEOUT = 3.0  # rank 1 never calls: the check's wait ends at this bound, whatever the load


class OnRankZeroOnly(L.Callback):
    def __init__(self, out: Path, call: str) -> None:
        self.out, self.call = out, call

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.is_global_zero and trainer.global_step == 1:
            if self.call == "state_dict":
                torch.save(pl_module.state_dict(), self.out / "model.pt")
            else:
                trainer.save_checkpoint(self.out / "model.ckpt")


def main() -> None:
    out, call = Path(sys.argv[1]), sys.argv[2]
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=2, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=out, callbacks=[OnRankZeroOnly(out, call)])
    trainer.fit(TinyGPT(width=16, depth=1))


if __name__ == "__main__":
    main()
