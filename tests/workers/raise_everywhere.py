"""A user's script under zero2 at 2 ranks whose ``training_step`` raises at the second step: on every rank
(``argv``: output directory, then ``all``) the same error, or on rank 1 another one (``differ``). Every rank reaches
the raise at the same step, whatever the load: the report each prints is decided by what the ranks raised.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L

from lightning_zero import ZeroStrategy
from tests.models import TinyGPT

warnings.filterwarnings("ignore")


class RaisesAtStepOne(TinyGPT):
    def __init__(self, mode: str) -> None:
        super().__init__(width=16, depth=1)
        self.mode = mode

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == 1:
            if self.mode == "differ" and self.global_rank == 1:
                raise KeyError("rank one's own problem")
            raise ValueError("the batch has the wrong shape: fix the data module")
        return super().training_step(batch, batch_idx)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=2), accelerator="cpu", devices=2, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=out)
    trainer.fit(RaisesAtStepOne(mode))


if __name__ == "__main__":
    main()
