"""One rank: zero3 with ``nonfinite=<mode>`` (argument 2: ``raise``, ``skip`` or ``none``; ``skip-clip``: ``skip``
with ``gradient_clip_val=0.5``, where the guard reads clipping's norm) on TinyLM whose loss is
NaN on rank 1 at step 2, then the same steps as DDP does them by hand (gradients all-reduced and averaged, AdamW),
skipping the step where the averaged gradients are not finite when the mode is ``skip``. Saves both models' final
weights, the losses and the run summary. Under ``raise`` the error ends the script (the test reads the log).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_zero import ZeroStrategy
from tests.models import VOCAB, TinyLM

warnings.filterwarnings("ignore")
STEPS, NAN_STEP = 4, 2


class NaNOnRank1(TinyLM):
    """Rank 1's loss is NaN at step ``NAN_STEP``: the averaged gradients are NaN on every rank. Keeps its batches."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batches.append([t.clone() for t in batch])
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == NAN_STEP and self.global_rank == 1 else loss


def ddp_reference(rank: int, batches: list[list[torch.Tensor]], skip: bool, clip: Optional[float]) -> dict[str, Any]:
    """The same steps as DDP: this rank's ``batches``, gradients averaged over the ranks, clipped to a norm of
    ``clip``, one AdamW step per batch; ``skip``: no step where the averaged gradients are not finite."""
    L.seed_everything(0, verbose=False)
    model = TinyLM(scheduler=False)
    optimizer = model.configure_optimizers()
    for step, (tokens, targets) in enumerate(batches):
        loss = F.cross_entropy(model(tokens).float().reshape(-1, VOCAB), targets.reshape(-1))
        (loss * float("nan") if step == NAN_STEP and rank == 1 else loss).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= 2
        if not skip or all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    L.seed_everything(0, verbose=False)
    model = NaNOnRank1(scheduler=False)
    model.batches = []
    clip = 0.5 if mode == "skip-clip" else None
    nonfinite = {"none": None, "skip-clip": "skip"}.get(mode, mode)
    strategy = ZeroStrategy(stage=3, persistence_threshold=0, nonfinite=nonfinite)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
                        gradient_clip_val=clip,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=out)
    trainer.fit(model)
    summary = trainer.strategy.engine.summary()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    reference = ddp_reference(trainer.global_rank, model.batches, skip=nonfinite == "skip", clip=clip)
    torch.save({"weights": weights, "reference": reference, "summary": summary, "losses": model.losses},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
