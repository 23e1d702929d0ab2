"""One rank of a zero3 fit whose ranks get different numbers of batches: an IterableDataset gives rank 1 one batch and
rank 0 two. Rank 1 ends its epoch and gathers the weights back at teardown while rank 0 waits at its second step;
both fail after the process group's timeout (5 s here). Saves each rank's error (type and message) and whether the
module's tensors could all be read after the failed fit.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from examples.tiny_gpt import token_data
from lightning_zero import ZeroStrategy
from tests.models import TinyGPT

warnings.filterwarnings("ignore")


class Uneven(IterableDataset):
    def __iter__(self) -> Iterator[Any]:
        data = token_data()
        for i in range(4 if int(os.environ["RANK"]) == 0 else 2):
            yield data[i]


class UnevenGPT(TinyGPT):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(Uneven(), batch_size=2)


def main() -> None:
    out = Path(sys.argv[1])
    L.seed_everything(0, verbose=False)
    model = UnevenGPT(width=32, depth=2)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, persistence_threshold=0, timeout=5), accelerator="cpu",
                        devices=2, max_epochs=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    error: Any = None
    try:
        trainer.fit(model)
    except BaseException as caught:  # noqa: BLE001 - the error is the result
        error = (type(caught).__name__, str(caught), type(caught.__context__).__name__)
    total = sum(float(t.float().sum()) for t in model.state_dict().values())  # a view of freed memory would crash
    torch.save({"error": error, "state_sum": total}, out / f"rank{os.environ['RANK']}.pt")
    sys.stdout.flush()
    os._exit(0)  # the process group is broken; do not wait for it at exit


if __name__ == "__main__":
    main()
