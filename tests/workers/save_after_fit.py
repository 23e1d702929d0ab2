"""One rank: zero3 saves a checkpoint at the end of its last epoch (``ModelCheckpoint``, before teardown), then the
user saves one after ``fit`` returned (``trainer.save_checkpoint``, after stage 3 handed the full weights back and
moved its master tensors into them: see [Note: the hand-back does not stack on the step's memory] in
``lightning_zero/stage3/partitioned.py``). Rank 0 reads both back whole and compares them, and the module's weights."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy, load_full_checkpoint
from tests.models import TinyGPT

warnings.filterwarnings("ignore")


def run(out: Path, precision: str) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    model = TinyGPT(meta_init=True)
    dirpath = out / precision
    callback = ModelCheckpoint(dirpath=dirpath, filename="during", save_on_train_epoch_end=True)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, persistence_threshold=0, reduce_bucket_size=2000),
                        accelerator="cpu", devices=2, max_epochs=1, limit_train_batches=3, limit_val_batches=0,
                        precision=precision, callbacks=[callback], logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model)
    trainer.save_checkpoint(dirpath / "after.ckpt")
    if trainer.global_rank != 0:
        return {}
    during = load_full_checkpoint(dirpath / "during.ckpt", trust_code=True)
    after = load_full_checkpoint(dirpath / "after.ckpt", trust_code=True)
    module = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"during": {"weights": during["state_dict"], "optimizer": during["optimizer_states"][0]["state"]},
            "after": {"weights": after["state_dict"], "optimizer": after["optimizer_states"][0]["state"]},
            "module": module, "steps": (during["global_step"], after["global_step"])}


def main() -> None:
    out = Path(sys.argv[1])
    results = {precision: run(out, precision) for precision in ("32-true", "bf16-mixed")}
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
