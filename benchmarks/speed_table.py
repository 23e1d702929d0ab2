"""The speed and memory table of the stages against DDP and FSDP2, in one command (about 32 minutes on 2 idle cores):

    python -m benchmarks.speed_table --out /tmp/speed_table       # the whole table
    python -m benchmarks.speed_table --sizes gpt19m --steps 4 --repeats 1 --no-memory   # one piece, to check it runs

Step time at N = 2 on GPTs of 5.3M, 18.2M, 44.7M and 84.3M parameters (``small``, ``gpt19m``, ``gpt45m``,
``gpt85m`` of ``benchmarks/_model.py``), fp32 AdamW, clipping 1.0; peak resident memory at N = 4 on the 25.5M GPT
whose activations are negligible (``states``, built in ``configure_model``). Every (size, strategy) is its own
launch of N gloo ranks (``benchmarks.compare``); the strategies of a repeat run back to back and three repeats rotate
their order, so a slow phase of the machine spreads over all of them. Every strategy runs as a user runs it: no
allocator variable or setting of ours in any process (DDP and FSDP2 are Lightning's own strategies). Printed per
row: the median step against DDP's in the same run (and the range of that ratio over the repeats, each repeat's
median against DDP's in the same repeat; and the fastest step against DDP's fastest, the figure a busy machine
moves least: see [Note: what one row says] in ``_report.py``), peak resident memory per rank against DDP's (the
high-water mark, and its growth in ``fit`` above the process's level before it), minor page faults per step (and
against DDP's), and, for the ZeRO stages, the engine's large allocations per step and the bytes it copied per step
in units of 4Ψ (``ZeroEngine.step_costs``, see ``lightning_zero/memory/costs.py``). Wall times are only worth
comparing on an idle machine; the counts hold on a busy one too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks import _report as report
from benchmarks._model import SIZES
from benchmarks.compare import arguments as compare_arguments
from benchmarks.compare import compare, machine

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp2"]
STEP_SIZES = ["small", "gpt19m", "gpt45m", "gpt85m"]
MEMORY_SIZE = "states"


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=STEP_SIZES, choices=list(SIZES), help="sizes timed at N = 2")
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES)
    parser.add_argument("--steps", type=int, default=8, help="steps per launch at N = 2, warm-up included")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="leave out the N = 4 memory runs")
    parser.add_argument("--out", default="/tmp/lightning_zero_speed_table")
    return parser.parse_args(argv)


def _run(args: argparse.Namespace, world_size: int, sizes: list[str], steps: int, warmup: int) -> list[dict[str, Any]]:
    compare_args = compare_arguments().parse_args([
        "--world-sizes", str(world_size), "--sizes", *sizes, "--strategies", *args.strategies, "--steps", str(steps),
        "--warmup", str(warmup), "--repeats", str(args.repeats), "--clip", "1.0", "--out", args.out])
    return compare(compare_args, {name: SIZES[name] for name in sizes})


def table(rows: list[dict[str, Any]]) -> str:
    """One line per (N, size, strategy): the ratios to DDP and the counts per step."""
    out = ["| N | model | strategy | step (ms) | step vs ddp | per repeat | best step vs ddp | peak vs ddp | "
           "growth vs ddp | faults / step | faults vs ddp | allocs / step | copied / 4Ψ |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["world_size"], r.get("params") or 0)):
        model = f"{r['size']} ({(r.get('params') or 0) / 1e6:.1f}M)"
        if "error" in r:
            out.append(f"| {r['world_size']} | {model} | {r['strategy']} | {str(r['error'])[:120]} |" + " |" * 9)
            continue
        psi = r.get("params") or 0
        copied = "–" if r.get("copied") is None or not psi else f"{r['copied'] / (4 * psi):.2f}"
        allocs = "–" if r.get("allocations") is None else f"{r['allocations']:.0f}"
        out.append(f"| {r['world_size']} | {model} | {r['strategy']} | {r['step_median'] * 1e3:.0f} | "
                   f"{_ratio(r, 'step_median')} | {_repeats(r)} | {_ratio(r, 'step_best')} | "
                   f"{_ratio(r, 'peak_memory')} | {_ratio(r, 'peak_growth')} | "
                   f"{r.get('faults', 0):.0f} | {_ratio(r, 'faults')} | {allocs} | {copied} |")
    return "\n".join(out)


def _ratio(row: dict[str, Any], key: str) -> str:
    value = row.get(f"{key}_vs_ddp")
    return "–" if value is None else f"{value:.2f}"


def _repeats(row: dict[str, Any]) -> str:
    """The lowest and highest of the repeats' step ratios to DDP (each repeat against DDP in the same repeat)."""
    if row.get("repeat_ratio_min") is None:
        return "–"
    return f"{row['repeat_ratio_min']:.2f}–{row['repeat_ratio_max']:.2f}"


def main(argv: list[str]) -> int:
    args = _arguments(argv)
    records = _run(args, 2, args.sizes, args.steps, args.warmup)
    if not args.no_memory:
        records += _run(args, 4, [MEMORY_SIZE], 3, 1)
    rows = report.summarize(records)
    text = f"Machine: {machine()}\n\n{table(rows)}\n"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "speed_table.md").write_text(text)
    report.write_json(Path(args.out) / "speed_table.json", {"machine": machine(), "rows": rows, "records": records})
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
