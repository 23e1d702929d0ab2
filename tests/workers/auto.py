"""One rank of the ``zero_auto`` runs: several fits of one GPT in one launch, each with its own memory budget.

Usage (through ``lightning_zero.testing.launch``): ``auto.py OUT SIZE PRECISION FITS [STEPS]`` with SIZE ``test``
(:data:`TEST_SIZE`) or a name of ``benchmarks._model.SIZES``, and FITS a comma-separated list of
``BUDGET:CONSTRUCTION``: BUDGET ``default`` (no ``memory_budget``), ``zero2`` / ``zero3`` (halfway between what that
candidate needs, its predicted peak and the headroom, and what the next cheaper one needs, from the latest fit before), ``nothing`` (half the smallest
prediction) or ``only-zeroK`` (the one candidate zeroK, whatever the budget: for the benchmark's table), and
CONSTRUCTION ``init`` (built in ``__init__``) or ``configure`` (``configure_model``). A first fit, ``cold``, is the
process's first run (see ``FIRST_RUN_BYTES`` in ``lightning_zero/engine/auto/choice.py``). Each fit saves the choice,
every prediction and the measured peak; a fit refused for its budget saves the error and how many training steps ran.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks._model import SIZES, BenchGPT, GPTSize
from lightning_zero import ZeroAutoStrategy
from lightning_zero.engine.auto import choice

warnings.filterwarnings("ignore")
ORDER = ("zero1", "zero2", "zero3")
#: A GPT whose blocks outweigh its embedding (zero3 saves more than its gathered units cost), 6.4M parameters, on
#: micro-batches whose activations weigh less than the gradients (so that zero2 saves something over zero1).
TEST_SIZE = GPTSize(width=256, depth=8, vocab=512, seq=64, batch=1)
#: Micro-batches per step: stage 1 then holds full gradients (zero2 saves them; without accumulation stage 1 reduces
#: into a gradient shard in backward as stage 2 does, and the two predictions are the same).
ACCUMULATE = 2
#: Stage 3's prefetch in the tests: one block ahead, so that zero3's predicted peak falls below zero2's.
OPTIONS = {"prefetch_size": 800_000}


def budget_for(spec: str, predictions: dict[str, float]) -> Any:
    """The ``memory_budget`` of one fit (see the module docstring)."""
    if spec == "default":
        return None
    if spec == "nothing":
        return 0.5 * min(predictions.values())
    if spec.startswith("only-"):
        return None
    cheaper = ORDER[ORDER.index(spec) - 1]
    return (predictions[spec] + predictions[cheaper]) / 2 * (1 + choice.HEADROOM)  # between what each needs


def fit(size: GPTSize, precision: str, construction: str, budget: Any, steps: int) -> dict[str, Any]:
    """One fit under ``zero_auto``; the strategy's record of it."""
    L.seed_everything(0, verbose=False)
    model = BenchGPT(size, samples=64, meta_init=construction == "configure")
    strategy = ZeroAutoStrategy(memory_budget=budget, **OPTIONS)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, precision=precision, max_steps=steps,
                        accumulate_grad_batches=ACCUMULATE,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(model)
    except ValueError as error:
        return {"error": str(error), "steps": trainer.global_step}
    run = strategy.auto_run
    assert run is not None
    chosen = run.choice.chosen
    return {"chosen": chosen.candidate.name, "predictions": run.choice.by_name(), "budget": run.choice.budget,
            "measured": run.measured, "parts": vars(chosen) | {"candidate": chosen.candidate.name}}


def main() -> None:
    out, precision, fits = Path(sys.argv[1]), sys.argv[3], sys.argv[4].split(",")
    size = TEST_SIZE if sys.argv[2] == "test" else SIZES[sys.argv[2]]
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 4
    first = fit(size, precision, "configure", None, steps)
    records: list[dict[str, Any]] = [{"spec": "cold", "construction": "configure", **first}]
    every = choice.CANDIDATES
    for text in fits:
        spec, construction = text.split(":")
        choice.CANDIDATES = tuple(c for c in every if c.name == spec[5:]) if spec.startswith("only-") else every
        # budgets from the latest fit that predicted every stage: a warm one after the first (see FIRST_RUN_BYTES)
        latest = next(r["predictions"] for r in reversed(records) if set(ORDER) <= set(r.get("predictions", {})))
        record = fit(size, precision, construction, budget_for(spec, latest), steps)
        records.append({"spec": spec, "construction": construction, **record})
    torch.save(records, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
