"""One rank of the stuck-rank test: at its third step rank 1 receives SIGTERM and then hangs inside
``training_step`` (as in a hung data loader), away from any step boundary; ``shutdown_timeout=2`` must end it.
``argv``: output directory.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from tests.models import TinyGPT

warnings.filterwarnings("ignore")


class StuckGPT(TinyGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and self.global_step == 2:
            print(f"SIGTERM sent at {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            while True:  # stuck here: the handler only records the signal
                time.sleep(0.1)
        return super().training_step(batch, batch_idx)


def main() -> None:
    out = Path(sys.argv[1])
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=2, shutdown_timeout=2), accelerator="cpu", devices=2,
                        max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out)
    trainer.fit(StuckGPT())
    print("finished", flush=True)


if __name__ == "__main__":
    main()
