"""One rank of the failed-save test: train a step, then save with ``LIGHTNING_ZERO_FAULT`` making one rank's save
fail (a read-only directory on rank 0, a full disk on rank 1). Every rank must get the same ``CheckpointError``
(an ``Exception``) naming the failing rank and the errno, stay in step with the others, and save again afterwards.
``argv``: output directory, stage.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoints.storage import read_meta
from tests.models import TinyGPT

warnings.filterwarnings("ignore")


def main() -> None:
    out, stage = Path(sys.argv[1]), int(sys.argv[2])
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=stage, persistence_threshold=0), accelerator="cpu", devices=2,
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(TinyGPT())
    rank = trainer.global_rank
    report: dict = {}
    started = time.monotonic()
    try:
        trainer.save_checkpoint(out / "ckpts" / "failed.ckpt")
    except Exception as error:  # what a user's script writes: DCP's CheckpointException is a BaseException
        report = {"type": type(error).__name__, "message": str(error), "rank": getattr(error, "rank", None),
                  "errno": getattr(error, "errno", None)}
    report["seconds"] = time.monotonic() - started
    trainer.save_checkpoint(out / "ckpts" / "after.ckpt")  # the ranks are still in step: the next save works
    report["after"] = read_meta(out / "ckpts" / "after.ckpt")["global_step"]
    report["left"] = sorted(p.name for p in (out / "ckpts").iterdir())
    torch.save(report, out / f"rank{rank}.pt")
    os.environ.pop("LIGHTNING_ZERO_FAULT", None)


if __name__ == "__main__":
    main()
