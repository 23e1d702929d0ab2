"""A user's script that trains a few zero3 steps at 2 ranks, saves a checkpoint after ``fit`` and exits: the run must
end with exit code 0 on every rank, every time (no native thread or process group left alive at interpreter shutdown).
Started like a user's ``python train.py`` (Lightning's launcher starts rank 1 as a fresh interpreter).
``argv``: output directory. As cheap as a run that still does what the failing runs did (a zero3 setup, a step, a
sharded save after ``fit``, the interpreter's shutdown): one block of width 16, one step, no logger, no progress bar,
no checkpoint callback, so that the test can afford enough runs.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L

from lightning_zero import ZeroStrategy
from tests.models import TinyGPT

warnings.filterwarnings("ignore")


def main() -> None:
    out = Path(sys.argv[1])
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=2, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=out)
    trainer.fit(TinyGPT(width=16, depth=1, meta_init=True))
    trainer.save_checkpoint(out / "final.ckpt")
    print(f"saved on rank {trainer.global_rank}", flush=True)


if __name__ == "__main__":
    main()
