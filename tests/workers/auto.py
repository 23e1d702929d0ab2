"""One rank of the ``zero_auto`` runs: several fits of one GPT in one launch, each with its own memory budget.

Usage (through ``lightning_zero.testing.launch``): ``auto.py OUT SIZE PRECISION CONSTRUCTION BUDGETS [STEPS]`` with
SIZE a name of ``benchmarks._model.SIZES``, CONSTRUCTION ``init`` (built in ``__init__``) or ``configure``
(``configure_model``), BUDGETS a comma-separated list of ``default`` (no ``memory_budget``), ``zero2`` / ``zero3``
(halfway between that candidate's predicted peak and the next cheaper one's, from the ``default`` fit, which must
come first) or ``nothing`` (half the smallest prediction). Each fit saves the choice, every prediction and the
measured peak; a fit refused for its budget saves the error and whether any training step ran.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks._model import SIZES, BenchGPT
from lightning_zero import ZeroStrategy

warnings.filterwarnings("ignore")
ORDER = ("zero1", "zero2", "zero3")


def budget_for(spec: str, predictions: dict[str, float]) -> Any:
    """The ``memory_budget`` of one fit (see the module docstring)."""
    if spec == "default":
        return None
    if spec == "nothing":
        return 0.5 * min(predictions.values())
    cheaper = ORDER[ORDER.index(spec) - 1]
    return (predictions[spec] + predictions[cheaper]) / 2


def fit(size: str, precision: str, construction: str, budget: Any, steps: int) -> dict[str, Any]:
    """One fit under ``zero_auto``; the strategy's record of it."""
    L.seed_everything(0, verbose=False)
    model = BenchGPT(SIZES[size], samples=64, meta_init=construction == "configure")
    strategy = ZeroStrategy(stage="auto", memory_budget=budget)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, precision=precision, max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(model)
    except ValueError as error:
        return {"error": str(error), "steps": trainer.global_step}
    run = strategy.auto_run
    assert run is not None
    return {"chosen": run.choice.chosen.candidate.name, "predictions": run.choice.by_name(), "budget": run.choice.budget,
            "measured": run.measured, "parts": vars(run.choice.chosen) | {"candidate": run.choice.chosen.candidate.name}}


def main() -> None:
    out, size, precision, construction = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    specs = sys.argv[5].split(",")
    steps = int(sys.argv[6]) if len(sys.argv) > 6 else 4
    records: list[dict[str, Any]] = []
    predictions: dict[str, float] = {}
    for spec in specs:
        record = fit(size, precision, construction, budget_for(spec, predictions), steps)
        predictions = predictions or record.get("predictions", {})
        records.append({"spec": spec, **record})
    torch.save(records, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
