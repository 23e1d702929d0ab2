"""Memory per rank, stage by stage, against DDP, the paper's table and the peers: three measurements.

    python -m benchmarks.memory account                  # every byte of a rank at its peak: 25.5M and 85.4M, N = 2, 4
    python -m benchmarks.memory account --sizes states --world-sizes 4 --json account.json

    python -m benchmarks.memory states                   # MLP LM, width 768 (~4.8M params), world sizes 2 and 4
    python -m benchmarks.memory states --model gpt --width 512 --depth 6     # GPT, ~19M params, tied embeddings
    python -m benchmarks.memory states --width 256 --world-sizes 2 3 --precision bf16-mixed
    python -m benchmarks.memory phases --world-size 4 --size states \\
        --variants ddp zero1 zero2 zero3 fsdp2 zero3:reduce_bucket_size=1000000

``states``: measured model-state bytes and peak memory per rank, and traffic per step, for ddp and zero1-3, next to
the table in docs/stages.md. Every (world size, strategy) is its own launch of gloo ranks on this machine
(tests/workers/measure.py), so that the peak resident memory of each run is its own; same seed, same data.

``account``: each strategy run as a user runs it (no allocator variable or setting in any process; one launch of
gloo ranks per strategy, ``benchmarks._worker``, whose Trainer has no logger, checkpoint callback or progress bar), the whole process's peak resident memory per
rank above its level after imports, teardown included (stage 3 hands the full weights back there), against DDP's,
and the account of the rank with the highest peak at its highest reading, part by part (see [Note: the account of a
rank's memory] in ``lightning_zero/memory/account.py``): model states by kind, stage 3's gathered units, bucket
buffers, activations and other live heap, the allocator's free heap with the interpreter and stacks, files mapped,
and an optimizer step's temporaries where the peak lies inside a step (see ``_worker.AccountProbe``).
The last column is the sum of the parts against the peak: the parts are read at chosen points of a step, so a peak
between two readings shows there.

``phases``: where the peak resident memory of ``fit`` goes, per phase of a step, for variants of the strategies.
Each variant (``strategy[:option=value,...][+ENV=value,...]``, as in ``benchmarks.compare``) is one launch of
``benchmarks._worker`` with its ``PhaseProbe``: the resident high-water mark is read and reset at the Lightning hooks
between the phases of every step (see [Note: phases] in ``_probes.py``), so each phase's peak above the level before
``fit`` is known separately. ``setup`` is everything before the first step (``configure_model``, sharding, the
engines); ``idle`` the level between steps; ``reduce`` the end-of-backward flush and gradient clipping.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._model import SIZES
from benchmarks.compare import environment, parse_variant, run_config
from lightning_zero import expected_model_state_bytes
from lightning_zero.testing.launch import launch

STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
PHASES = ("setup", "forward", "backward", "reduce", "step")
MiB = 2**20


def launch_probed(text: str, size: str, world_size: int, steps: int, probe: str, timeout: float) -> dict[str, Any]:
    """One launch of one variant with a probe of ``benchmarks._worker`` on: ``"phases"`` (each phase's peak) or
    ``"account"`` (``AccountProbe``: the account of the rank's memory)."""
    strategy, options, env = parse_variant(text)
    with environment(env):
        cfg = {"strategy": strategy, "size": SIZES[size].__dict__, "steps": steps, "warmup": 1, "bucket": None,
               "gpu": False, "precision": "32-true", "options": options, probe: True}
        return run_config(cfg, world_size, timeout=timeout)


def row(text: str, rec: dict[str, Any], ddp: float) -> str:
    """One markdown row: model states, the level between steps, each phase's peak, the overall peak, vs ddp."""
    if "error" in rec or "skipped" in rec:
        return f"| {text} | {rec.get('error') or rec.get('skipped')} |"
    peaks, levels = rec.get("phases", {}), rec.get("levels", {})
    states = rec.get("model_states") or 0
    cells = [f"{peaks.get(p, 0) / MiB:,.0f}" for p in PHASES]
    growth = rec["peak_growth"] / MiB
    return (f"| {text} | {states / MiB:,.0f} | {levels.get('idle', 0) / MiB:,.0f} | " + " | ".join(cells)
            + f" | {growth:,.0f} | {growth / ddp if ddp else float('nan'):.2f} |")


TIMED = ("forward", "backward", "reduce", "step", "idle")


def timing_row(text: str, rec: dict[str, Any], ddp: float) -> tuple[str, float]:
    """One markdown row of each phase's median wall and process-CPU milliseconds and minor page faults per step (the
    first step left out: warm-up), and the sum of the wall medians against ddp's; returns the row and that sum."""
    seconds = rec.get("phase_seconds") or {}
    if not seconds:
        return f"| {text} | {rec.get('error') or rec.get('skipped') or 'no timings'} |", 0.0
    medians = {p: [statistics.median(t[i] if i < len(t) else 0.0 for t in seconds.get(p, [(0.0, 0.0)])[1:]
                                     or [(0.0, 0.0)]) * (1e3 if i < 2 else 1) for i in (0, 1, 2)] for p in TIMED}
    total = sum(wall for wall, _, _ in medians.values())
    cells = " | ".join(f"{wall:,.0f} / {cpu:,.0f} / {faults:,.0f}" for wall, cpu, faults in medians.values())
    return f"| {text} | {cells} | {total:,.0f} | {total / ddp if ddp else float('nan'):.2f} |", total


def states(args: argparse.Namespace) -> None:
    """Print the model-state table: one launch per (world size, stage)."""
    print("| N | strategy | Ψ | model states / rank (MiB) | table (MiB) | measured / table | vs DDP | "
          "reduce-scatter / Ψ | all-gather / Ψ | all-reduce elems | bucket buffers (MiB) | peak RSS growth (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for world_size in args.world_sizes:
        runs = {}
        for name in STAGES:
            with tempfile.TemporaryDirectory() as tmp:
                ranks = launch("measure.py", world_size, Path(tmp),
                               (str(args.width), args.precision, name, "4", args.model, str(args.depth)), timeout=900)
            runs[name] = max((r[name] for r in ranks), key=lambda r: r["peak_rss_growth"])
        ddp_bytes = runs["ddp"]["states"]["model_states"]
        for name, stage in STAGES.items():
            run = runs[name]
            psi = run["numel"]
            measured = run["states"]["model_states"]
            table = expected_model_state_bytes(psi, world_size, stage, args.precision)
            traffic = run["traffic"][-1]["elements"]
            rs, ag, ar = (traffic.get(k, 0) for k in ("reduce_scatter", "all_gather", "all_reduce"))
            rs_text = f"{rs / psi:.4f}" if name != "ddp" else "(DDP: one all-reduce of Ψ, not counted here)"
            print(f"| {world_size} | {name} | {psi:,} | {measured / 2**20:.2f} | {table / 2**20:.2f} | "
                  f"{measured / table:.3f} | {measured / ddp_bytes:.3f} | {rs_text} | {ag / psi:.4f} | {ar} | "
                  f"{run['states']['comm_buffers'] / 2**20:.2f} | {run['peak_rss_growth'] / 2**20:.0f} |", flush=True)


ACCOUNT_PARTS = {
    "parameters": "params",
    "gradients": "grads",
    "fp32 masters": "masters",
    "optimizer states": "opt. states",
    "gathered units (pool)": "units",
    "bucket buffers": "buckets",
    "activations and other live heap": "other live",
    "allocator's free heap, interpreter, stacks": "free heap etc.",
    "files mapped": "files",
    "the optimizer step's temporaries": "step temps",
}


def account(args: argparse.Namespace) -> None:
    """Print, per world size and size, each strategy's whole peak against DDP's and its account, part by part."""
    records: list[dict[str, Any]] = []
    for world_size in args.world_sizes:
        for size in args.sizes:
            print(f"\n### {size}: {SIZES[size].num_params():,} parameters, N = {world_size} (MiB per rank above the "
                  "level after imports; the rank with the highest peak)\n")
            print("| strategy | whole peak | vs DDP | highest reading at | " + " | ".join(ACCOUNT_PARTS.values())
                  + " | parts / peak |")
            print("|---|---|---|---|" + "---|" * (len(ACCOUNT_PARTS) + 1))
            ddp = 0.0
            for text in args.strategies:
                rec = launch_probed(text, size, world_size, args.steps, "account", timeout=1800)
                records.append({"strategy": text, "size": size, "world_size": world_size, **rec})
                if "error" in rec:
                    print(f"| {text} | {rec['error']} |", flush=True)
                    continue
                top = max(rec["accounts"], key=lambda a: a["whole_peak"])
                peak = top["whole_peak"] / MiB
                ddp = peak if text == "ddp" else ddp
                parts = top.get("parts", {})
                cells = " | ".join(f"{parts.get(name, 0) / MiB:,.1f}" for name in ACCOUNT_PARTS)
                total = sum(parts.values()) / MiB
                print(f"| {text} | {peak:,.0f} | {peak / ddp if ddp else float('nan'):.2f} | {top.get('at', '-')} | "
                      f"{cells} | {total / peak if peak else float('nan'):.2f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))


def phases(args: argparse.Namespace) -> None:
    """Print the per-phase peak table: one launch per variant."""
    print(f"size {args.size}: {SIZES[args.size]}, {SIZES[args.size].num_params():,} parameters, N={args.world_size}")
    header = ("| variant | model states | level between steps | " + " | ".join(f"peak in {p}" for p in PHASES)
              + " | peak growth in fit | vs ddp |")
    lines = [header, "|" + "---|" * (len(PHASES) + 5)]
    timings = ["| variant | " + " | ".join(f"{p} (ms wall / CPU / faults)" for p in TIMED) + " | sum of walls | vs ddp |",
               "|" + "---|" * (len(TIMED) + 3)]
    ddp, ddp_time = 0.0, 0.0
    for text in args.variants:
        t0 = time.perf_counter()
        rec = launch_probed(text, args.size, args.world_size, args.steps, "phases", timeout=900)
        if text == "ddp" and "peak_growth" in rec:
            ddp = rec["peak_growth"] / MiB
        lines.append(row(text, rec, ddp))
        timing, total = timing_row(text, rec, ddp_time)
        if text == "ddp":
            ddp_time = total
            timing, _ = timing_row(text, rec, ddp_time)
        timings.append(timing)
        print(lines[-1], f"({time.perf_counter() - t0:.0f}s)", flush=True)
    print("\nAll figures MiB per rank (the rank with the highest peak growth), above the level before `fit`.\n")
    print("\n".join(lines))
    print("\nTime per phase, median over the steps after the first, of the same rank (``reduce``: the end-of-backward "
          "flush and wait; ``step``: clipping, what a step reduces late, the optimizer step, the parameters' gather; "
          "``idle``: between steps, data loading included).\n")
    print("\n".join(timings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    table = commands.add_parser("states", help="model-state bytes, traffic and peak memory against the table")
    table.add_argument("--width", type=int, default=768)
    table.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    table.add_argument("--precision", default="32-true")
    table.add_argument("--model", choices=["lm", "gpt"], default="lm")
    table.add_argument("--depth", type=int, default=6, help="blocks of the gpt model")
    table.set_defaults(run=states)
    accounts = commands.add_parser("account", help="each strategy's whole peak and its account, part by part")
    accounts.add_argument("--strategies", nargs="+", default=["ddp", "zero1", "zero2", "zero3", "fsdp2"])
    accounts.add_argument("--sizes", nargs="+", default=["states", "states85m"], choices=list(SIZES))
    accounts.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    accounts.add_argument("--steps", type=int, default=2)
    accounts.add_argument("--json", help="write every launch's record to this file")
    accounts.set_defaults(run=account)
    breakdown = commands.add_parser("phases", help="the peak of each phase of a step, per variant")
    breakdown.add_argument("--variants", nargs="+", default=["ddp", "zero1", "zero2", "zero3", "fsdp2"])
    breakdown.add_argument("--size", default="states", choices=list(SIZES))
    breakdown.add_argument("--world-size", type=int, default=4)
    breakdown.add_argument("--steps", type=int, default=3)
    breakdown.set_defaults(run=phases)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
