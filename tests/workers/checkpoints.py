"""One rank of the sharded-checkpoint suite.

``write``: for each stage, 3 epochs with ``ModelCheckpoint`` (top 2 by step, ``last``), then a resume from the
checkpoint of the second epoch, whose third epoch must reproduce the first run's bit for bit.
``reshard SRC``: load SRC (written at another world size) under zero1/zero2/zero3 and ``ddp``; save it again right
away (the test compares the two), test with it, and train one more epoch from it.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroCheckpointIO, ZeroStrategy
from tests.models import TinyGPT, token_data

warnings.filterwarnings("ignore")

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))  # read once: Lightning's teardown clears it
FIXED_INPUT = token_data(n=4, seed=3).tensors[0]


class GPT(TinyGPT):
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def test_dataloader(self) -> Any:
        return self.val_dataloader()


def make_strategy(name: str) -> Any:
    if name == "ddp":
        return "ddp"
    # ~10 buckets for the 39k-parameter GPT: each collective of 3 ranks on 2 cores costs a few ms of scheduling
    return ZeroStrategy(stage=int(name[-1]), reduce_bucket_size=4000, persistence_threshold=0)


def trainer(name: str, epochs: int, **kwargs: Any) -> L.Trainer:
    defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    plugins = [ZeroCheckpointIO()] if name == "ddp" else None
    return L.Trainer(strategy=make_strategy(name), accelerator="cpu", devices=WORLD_SIZE, max_epochs=epochs,
                     limit_train_batches=4, accumulate_grad_batches=2, gradient_clip_val=0.05, limit_val_batches=0,
                     plugins=plugins, **{**defaults, **kwargs})


def write(out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for stage in ("zero1", "zero2", "zero3"):
        L.seed_everything(0, verbose=False)
        first = GPT()
        dirpath = out / f"{stage}-ckpts"
        callback = ModelCheckpoint(dirpath=dirpath, monitor="step", mode="max", save_top_k=2, save_last=True)
        trainer(stage, 3, enable_checkpointing=True, callbacks=[callback]).fit(first)
        L.seed_everything(0, verbose=False)
        resumed = GPT()
        trainer(stage, 3).fit(resumed, ckpt_path=dirpath / "epoch=1-step=4.ckpt")
        results[stage] = {"first": first.losses, "resumed": resumed.losses,
                          "dir": str(dirpath), "listing": sorted(p.name for p in dirpath.iterdir())}
    return results


def reshard(out: Path, source: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in ("zero1", "zero2", "zero3", "ddp"):
        epochs = torch.load(source / "meta.pt", weights_only=False)["epoch"] + 1
        model = GPT()
        t = trainer(name, epochs)
        t.fit(model, ckpt_path=source)  # restores, and has nothing left to train
        again = out / f"again-{name}.ckpt"
        t.save_checkpoint(again)
        tested = GPT()
        metrics = trainer(name, 1).test(tested, ckpt_path=source, verbose=False)
        with torch.no_grad():
            logits = tested(FIXED_INPUT)
        L.seed_everything(1, verbose=False)
        more = GPT()
        trainer(name, epochs + 1).fit(more, ckpt_path=source)
        results[name] = {"again": str(again), "test": metrics, "logits": logits, "more": more.losses}
    return results


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    result = write(out) if mode == "write" else reshard(out, Path(sys.argv[3]))
    torch.save(result, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
