"""One rank of the shared-optimizer suite: ``SharedOptimizers`` under ddp, zero1, zero2 and zero3 in the same processes.

Usage (through ``lightning_zero.testing.launch``): ``shared_optimizers.py OUT``. Saves, per scenario and strategy, the losses, final
weights, learning rates, call counts, logged metrics, or the error Lightning raised.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from tests.models import SharedOptimizers

warnings.filterwarnings("ignore")

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def strategy(name: str) -> Any:
    if name == "ddp":
        return "ddp"
    # 40-element buckets: parameters span buckets; the counting optimizers are elementwise (SGD and Adam)
    return ZeroStrategy(stage=int(name[-1]), reduce_bucket_size=40, persistence_threshold=0,
                        elementwise_optimizers=("CountingSGD", "CountingAdam"))


def trainer(name: str, **kwargs: Any) -> L.Trainer:
    return L.Trainer(strategy=strategy(name), accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


def run_manual(name: str, third: str) -> dict[str, Any]:
    model = SharedOptimizers(third=third)
    fit = trainer(name, max_epochs=2)
    fit.fit(model)
    optimizers = [getattr(o, "_optimizer", o) for o in fit.optimizers]
    return {
        "losses": list(model.losses),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "lr": [[g["lr"] for g in o.param_groups] for o in optimizers],
        "calls": [dict(getattr(o, "calls", {})) for o in optimizers],
        "global_step": fit.global_step,
        "metrics": {k: float(v) for k, v in fit.callback_metrics.items()},
    }


def run_automatic(name: str) -> dict[str, Any]:
    try:
        trainer(name, max_steps=2).fit(SharedOptimizers(automatic=True))
    except Exception as error:  # what ddp raises, every strategy must raise
        return {"error": (type(error).__name__, str(error))}
    return {"error": None}


def resume(name: str, ckpt: Path) -> SharedOptimizers:
    L.seed_everything(0, verbose=False)
    model = SharedOptimizers()
    trainer(name, max_epochs=3).fit(model, ckpt_path=ckpt)
    return model


def run_checkpoint(name: str, out: Path) -> dict[str, Any]:
    """Two epochs and a save under ``name``; the third epoch resumed under another stage, and (ZeRO) from ddp's
    checkpoint file; three straight epochs. ddp runs first, so its file is there for the stages."""
    ckpt = out / f"shared-{name}.ckpt"
    L.seed_everything(0, verbose=False)
    first = trainer(name, max_epochs=2)
    first.fit(SharedOptimizers())
    first.save_checkpoint(ckpt)
    L.seed_everything(0, verbose=False)
    straight = SharedOptimizers()
    trainer(name, max_epochs=3).fit(straight)
    result = {"ckpt": str(ckpt), "straight": straight.losses[-8:],
              "straight_params": {n: p.detach().clone() for n, p in straight.named_parameters()}}
    if name != "ddp":
        resumed = resume(f"zero{int(name[-1]) % 3 + 1}", ckpt)
        from_ddp = resume(name, out / "shared-ddp.ckpt")
        result.update(resumed=resumed.losses, from_ddp=from_ddp.losses,
                      resumed_params={n: p.detach().clone() for n, p in resumed.named_parameters()})
    return result


def main() -> None:
    out = Path(sys.argv[1])
    scenarios = {
        "manual": lambda s: run_manual(s, "adamw"),
        "manual_whole": lambda s: run_manual(s, "adafactor"),
        "automatic": run_automatic,
        "checkpoint": lambda s: run_checkpoint(s, out),
    }
    results: dict[str, dict[str, Any]] = {}
    for scenario, run in scenarios.items():
        for name in STRATEGIES:
            L.seed_everything(0, verbose=False)
            results.setdefault(scenario, {})[name] = run(name)
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
