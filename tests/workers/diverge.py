"""One rank: rank 1's control flow differs at step 2 (data-dependent control flow). zero3 must fail at once on every
rank, under the default 30-minute process-group timeout, and name the unit rank 1 skipped. Saves the error message
and how many lockstep checks each step waited for where it sent them.

The mode (argument 2): ``forward``, rank 1 skips block 1's forward; ``unprefetched``, it skips blocks 1 and 2 with
one block prefetched, so that rank 1 waits for its check at once while rank 0 waits one unit later (see [Note: a
check is waited for one unit late]); ``backward``, block 3's output reaches rank 1's loss detached, so that only
its backward skips the block; ``strict``, ``forward`` with ``lockstep_check="strict"``; ``recompute``, ``forward``
with every block under ``torch.utils.checkpoint`` in the model's forward, so that backward alternates between
recomputed forwards and backwards, each pass starting with a check waited for where it is sent."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.checkpoint import checkpoint

from lightning_zero import ZeroStrategy
from tests.models import TinyGPT

warnings.filterwarnings("ignore")


class Divergent(TinyGPT):
    def __init__(self, mode: str) -> None:
        super().__init__(width=32, depth=4)
        self.mode = mode

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.pos[: tokens.shape[1]]
        diverging = self.global_rank == 1 and self.global_step == 2
        skipped = {1, 2} if self.mode == "unprefetched" else {1}
        for i, block in enumerate(self.blocks):
            if diverging and self.mode == "backward" and i == 3:
                x = x + 0 * block(x).detach()
            elif not (diverging and self.mode != "backward" and i in skipped):
                x = checkpoint(block, x, use_reentrant=False) if self.mode == "recompute" else block(x)
        return self.lm_head(self.ln_f(x))


class CountChecks(L.Callback):
    """The lockstep checks each training step waited for at the hook that sent them."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._before = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        waited = trainer.strategy.runtime.checks_waited_at_once
        self.per_step.append(waited - self._before)
        self._before = waited


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    L.seed_everything(0, verbose=False)
    model = Divergent(mode)
    options: dict[str, Any] = {"lockstep_check": "strict"} if mode == "strict" else {}
    if mode == "unprefetched":
        options["prefetch_size"] = sum(p.numel() for p in model.blocks[0].parameters())
    # the default timeout (30 minutes), in plain seconds as a YAML file gives it: ZeroStrategy hands torch the
    # timedelta it requires. The test's own bound is far shorter: only the lockstep check can end the job in time.
    counter = CountChecks()
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, persistence_threshold=0, timeout=1800, **options),
                        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[counter])
    message: Any = None
    try:
        trainer.fit(model)
    except Exception as error:  # noqa: BLE001 - the error is the result
        message = f"{type(error).__name__}: {error}"
    # teardown after the error ran no collective and left no view of freed storage: reading every tensor is safe
    # (reading a view of freed storage would crash this process)
    total = sum(float(t.float().sum()) for t in model.state_dict().values())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    torch.save({"error": message, "state_sum": total, "elements_left": trained, "checks_at_once": counter.per_step},
               out / f"rank{os.environ['RANK']}.pt")
    sys.stdout.flush()
    os._exit(0)  # the process group is broken; do not wait for it at exit


if __name__ == "__main__":
    main()
