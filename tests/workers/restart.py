"""One rank of the torchrun restart test (tests/test_restart.py): a small GPT under zero3, one step per epoch, a
sharded checkpoint at the end of every epoch, resumed from the last one when there is one.

Usage: ``restart.py OUT KILL_AT`` under ``torchrun`` (or ``lightning_zero.testing.launch``). With ``KILL_AT`` > 0, in
the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0 or unset) rank 1 kills itself with SIGKILL at the start of epoch
``KILL_AT``, once every rank has passed the end of the epoch before (and with it the checkpoint of step
``KILL_AT``): a chosen point, not a time. Every rank appends one JSON line per training step to
``OUT/losses-rank<r>.jsonl``: the attempt, the global step after it and the loss. At the start of training each
rank writes the timeout of every process group of the process, by torch's own account, to
``OUT/timeouts-rank<r>-attempt<a>.json`` (the strategy's ``timeout`` is :data:`TIMEOUT` seconds). Each process
leaves its id as ``OUT/pid-<id>``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from examples.tiny_gpt import token_data
from lightning_zero import ZeroStrategy
from tests.models import TinyGPT

warnings.filterwarnings("ignore")
STEPS = 10
TIMEOUT = 600  # seconds: not torch's default (30 minutes), which a group made without the default's would get


class OneBatchPerEpoch(TinyGPT):
    """Eight samples per rank, one batch per epoch: a resume always starts at an epoch's beginning."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(n=16), batch_size=8, shuffle=True)


class Record(L.Callback):
    """Writes each step's loss; rank 1 ends itself at the chosen epoch of the first attempt."""

    def __init__(self, out: Path, kill_at: int) -> None:
        self.out, self.kill_at = out, kill_at
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pgs = torch.distributed.distributed_c10d._world.pg_map
        timeouts = {
            f"{torch.distributed.distributed_c10d._get_process_group_name(pg)} {pg.group_desc}":
                pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for pg in pgs
        }
        name = f"timeouts-rank{trainer.global_rank}-attempt{self.attempt}.json"
        (self.out / name).write_text(json.dumps(timeouts))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.kill_at and self.attempt == 0 and trainer.current_epoch == self.kill_at:
            trainer.strategy.barrier()  # every rank ended the epoch before: its checkpoint is complete
            if trainer.global_rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        line = {"attempt": self.attempt, "step": trainer.global_step, "loss": float(outputs["loss"])}
        with open(self.out / f"losses-rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


def main() -> None:
    out, kill_at = Path(sys.argv[1]), int(sys.argv[2])
    (out / f"pid-{os.getpid()}").touch()  # torchrun starts each worker in a session of its own: the test ends them
    L.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    model = OneBatchPerEpoch(width=32, depth=2)
    checkpoints = ModelCheckpoint(dirpath=out / "ckpts", save_last=True, every_n_epochs=1, save_on_train_epoch_end=True)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, persistence_threshold=0, timeout=TIMEOUT), accelerator="cpu", devices=2,
                        max_steps=STEPS, max_epochs=STEPS, callbacks=[Record(out, kill_at), checkpoints],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    last = out / "ckpts" / "last.ckpt"
    trainer.fit(model, ckpt_path=last if last.exists() else None)
    print(f"rank {trainer.global_rank}: finished at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
