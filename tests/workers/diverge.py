"""One rank: rank 1 skips block 1 at step 2 (data-dependent control flow). zero3 must fail at once on every rank, under
the default 30-minute process-group timeout, and name the unit rank 1 skipped. Saves the error message."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from tests.models import TinyGPT

warnings.filterwarnings("ignore")


class Divergent(TinyGPT):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.pos[: tokens.shape[1]]
        for i, block in enumerate(self.blocks):
            if not (self.global_rank == 1 and self.global_step == 2 and i == 1):
                x = block(x)
        return self.lm_head(self.ln_f(x))


def main() -> None:
    out = Path(sys.argv[1])
    L.seed_everything(0, verbose=False)
    # the default timeout (30 minutes), in plain seconds as a YAML file gives it: ZeroStrategy hands torch the
    # timedelta it requires. The test's own bound is far shorter: only the lockstep check can end the job in time.
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, persistence_threshold=0, timeout=1800),
                        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    message: Any = None
    model = Divergent(width=32, depth=4)
    try:
        trainer.fit(model)
    except Exception as error:  # noqa: BLE001 - the error is the result
        message = f"{type(error).__name__}: {error}"
    # teardown after the error ran no collective and left no view of freed storage: reading every tensor is safe
    # (reading a view of freed storage would crash this process)
    total = sum(float(t.float().sum()) for t in model.state_dict().values())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    torch.save({"error": message, "state_sum": total, "elements_left": trained},
               out / f"rank{os.environ['RANK']}.pt")
    sys.stdout.flush()
    os._exit(0)  # the process group is broken; do not wait for it at exit


if __name__ == "__main__":
    main()
