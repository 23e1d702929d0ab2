"""Where the peak resident memory of ``fit`` goes, per phase of a step, for variants of the strategies.

    python benchmarks/memory_breakdown.py --world-size 4 --size states \\
        --variants ddp zero1 zero2 zero3 fsdp2 zero3:reduce_bucket_size=1000000

Each variant (``strategy[:option=value,...][+ENV=value,...]``, as in ``zero3_ab.py``) is one launch of
``compare_worker.py`` with its ``PhaseProbe``: the resident high-water mark is read and reset at the Lightning hooks
between the phases of every step (see [Note: phases] in ``probes.py``), so each phase's peak above the level before
``fit`` is known separately. ``setup`` is everything before the first step (``configure_model``, sharding, the
engines); ``idle`` the level between steps; ``reduce`` the end-of-backward flush and gradient clipping.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compare import run_config  # noqa: E402
from benchmarks.gpt import SIZES  # noqa: E402
from benchmarks.zero3_ab import environment, parse_variant  # noqa: E402

PHASES = ("setup", "forward", "backward", "reduce", "step")
MiB = 2**20


def run(text: str, size: str, world_size: int, steps: int) -> dict[str, Any]:
    """One launch of one variant with the phase probe on."""
    strategy, options, env = parse_variant(text)
    with environment(env):
        cfg = {"strategy": strategy, "size": SIZES[size].__dict__, "steps": steps, "warmup": 1, "bucket": None,
               "gpu": False, "precision": "32-true", "options": options, "phases": True}
        return run_config(cfg, world_size, timeout=900)


def row(text: str, rec: dict[str, Any], ddp: float) -> str:
    """One markdown row: model states, the level between steps, each phase's peak, the overall peak, vs ddp."""
    if "error" in rec or "skipped" in rec:
        return f"| {text} | {rec.get('error') or rec.get('skipped')} |"
    phases, levels = rec.get("phases", {}), rec.get("levels", {})
    states = rec.get("model_states") or 0
    cells = [f"{phases.get(p, 0) / MiB:,.0f}" for p in PHASES]
    growth = rec["peak_growth"] / MiB
    return (f"| {text} | {states / MiB:,.0f} | {levels.get('idle', 0) / MiB:,.0f} | " + " | ".join(cells)
            + f" | {growth:,.0f} | {growth / ddp if ddp else float('nan'):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["ddp", "zero1", "zero2", "zero3", "fsdp2"])
    parser.add_argument("--size", default="states", choices=list(SIZES))
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"size {args.size}: {SIZES[args.size]}, {SIZES[args.size].num_params():,} parameters, N={args.world_size}")
    header = ("| variant | model states | level between steps | " + " | ".join(f"peak in {p}" for p in PHASES)
              + " | peak growth in fit | vs ddp |")
    lines = [header, "|" + "---|" * (len(PHASES) + 5)]
    ddp = 0.0
    for text in args.variants:
        t0 = time.perf_counter()
        rec = run(text, args.size, args.world_size, args.steps)
        if text == "ddp" and "peak_growth" in rec:
            ddp = rec["peak_growth"] / MiB
        lines.append(row(text, rec, ddp))
        print(lines[-1], f"({time.perf_counter() - t0:.0f}s)", flush=True)
    print("\nAll figures MiB per rank (the rank with the highest peak growth), above the level before `fit`.\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
