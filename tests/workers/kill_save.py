"""One rank of the kill-during-save test: save a checkpoint, then start overwriting it and hang mid-save.

The second save stops after every rank wrote its shard file (before ``meta.pt`` and the rename), announces that in
a line on the FIFO ``saving.fifo`` (the test made it), and waits to be killed by the test.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch

import lightning_zero.checkpoints.storage as checkpoint
from lightning_zero import ZeroStrategy
from tests.models import TinyGPT

warnings.filterwarnings("ignore")


def main() -> None:
    out = Path(sys.argv[1])
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, persistence_threshold=0), accelerator="cpu", devices=2,
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(TinyGPT())
    trainer.save_checkpoint(out / "last.ckpt")
    if trainer.is_global_zero:  # what the test must find intact after the kill
        torch.save(checkpoint.read_meta(out / "last.ckpt")["lightning_zero"]["files"], out / "first.pt")

    describe = checkpoint._describe

    def hang(path: Path) -> tuple[int, int]:
        if path.name.endswith(".distcp"):
            with open(out / "saving.fifo", "w") as fifo:
                fifo.write(f"{torch.distributed.get_rank()}\n")
            time.sleep(600)
        return describe(path)

    checkpoint._describe = hang
    trainer.save_checkpoint(out / "last.ckpt")


if __name__ == "__main__":
    main()
