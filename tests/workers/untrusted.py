"""One rank of the untrusted-checkpoint test at 2 ranks: resume a zero3 Trainer from each checkpoint directory given
(payloads planted by the test, read by DCP's coordinator and sent to the other rank) and report what each rank
raised. ``argv``: output directory, then the checkpoint directories.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L
import torch

import lightning_zero  # noqa: F401 - registers the strategy names
from tests.checkpoint_fixtures import HPARAMS, Regressor

warnings.filterwarnings("ignore")


def main() -> None:
    out, paths = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    reports = {}
    for path in paths:
        trainer = L.Trainer(strategy="zero3", accelerator="cpu", devices=2, max_steps=3, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        try:
            trainer.fit(Regressor(**HPARAMS), ckpt_path=path)
            reports[path.name] = {"type": None, "message": ""}
        except BaseException as error:  # noqa: BLE001 - DCP's own errors are BaseExceptions: report any
            reports[path.name] = {"type": type(error).__name__, "message": str(error)}
    torch.save(reports, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
