"""The speed and memory table of the stages against DDP and FSDP2, in one command (about 32 minutes on 2 idle cores):

    python -m benchmarks.speed_table --out /tmp/speed_table       # the whole table
    python -m benchmarks.speed_table --sizes gpt19m --steps 4 --repeats 1 --no-memory   # one piece, to check it runs
    python -m benchmarks.speed_table --record benchmarks/records/speed.json    # and the results page's record of it

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
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import _report as report
from benchmarks._model import SIZES
from benchmarks.compare import arguments as compare_arguments
from benchmarks.compare import compare, machine
from benchmarks.results import dumps_record

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
    parser.add_argument("--record", type=Path, help="also write the table as this results record (JSON; an existing "
                        "record keeps its title, place and first paragraph, the rest is replaced)")
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


RECORD_COLUMNS = ["N", "model", "Ψ (M)", "strategy", "step (ms)", "step vs ddp", "per repeat", "best step vs ddp",
                  "peak vs ddp", "growth vs ddp", "faults / step", "faults vs ddp", "allocs / step", "copied / 4Ψ"]
RECORD_FORMATS = {"N": "{:.0f}", "Ψ (M)": "{:.1f}", "step (ms)": "{:.0f}", "faults / step": "{:.0f}",
                  "allocs / step": "{:.0f}", **{c: "{:.2f}" for c in RECORD_COLUMNS if "vs" in c or "/ 4Ψ" in c},
                  "per repeat": "{:.2f}"}


def _number(row: dict[str, Any], key: str) -> Any:
    value = row.get(key)
    return None if value is None else round(value, 2)


def record_row(r: dict[str, Any]) -> list[Any]:
    """One summary row as the numbers of a results record's table (``RECORD_COLUMNS``; ``None``: not applicable)."""
    psi = r.get("params") or 0
    spread = None if r.get("repeat_ratio_min") is None else [_number(r, "repeat_ratio_min"),
                                                             _number(r, "repeat_ratio_max")]
    return [r["world_size"], r["size"], round(psi / 1e6, 1), r["strategy"], round(r["step_median"] * 1e3),
            _number(r, "step_median_vs_ddp"), spread, _number(r, "step_best_vs_ddp"), _number(r, "peak_memory_vs_ddp"),
            _number(r, "peak_growth_vs_ddp"), round(r.get("faults", 0)), _number(r, "faults_vs_ddp"),
            None if r.get("allocations") is None else round(r["allocations"]),
            None if r.get("copied") is None or not psi else round(r["copied"] / (4 * psi), 2)]


def run_header(args: argparse.Namespace, argv: list[str]) -> dict[str, str]:
    """This run's record header: the commit checked out, today, this machine and torch, the command, the repeats."""
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip() or "not recorded"
    return {"commit": commit, "date": time.strftime("%Y-%m-%d"), "machine": machine(), "torch": torch.__version__,
            "command": " ".join(["python -m benchmarks.speed_table", *argv]),
            "repeats": f"{args.repeats} interleaved repeats of {args.steps} steps ({args.warmup} of warm-up) per "
                       "launch at N = 2"}


def record(rows: list[dict[str, Any]], raw: list[dict[str, Any]], header: dict[str, str],
           previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The results record of this run (see ``benchmarks/results.py``): its header, the table, and the raw launches."""
    ok = sorted((r for r in rows if "error" not in r), key=lambda r: (r["world_size"], r.get("params") or 0))
    failed = [f"{r['strategy']} at N = {r['world_size']}, {r['size']}: {str(r['error'])[:200]}" for r in rows
              if "error" in r]
    first = (previous or {}).get("parts", [{}])[0].get("text", [])
    return {
        "id": (previous or {}).get("id", "speed"),
        "title": (previous or {}).get("title", "Step time and peak memory against DDP and FSDP2"),
        "order": (previous or {}).get("order", 1),
        "kind": (previous or {}).get("kind", "current"),
        "header": header,
        "source": "written by `python -m benchmarks.speed_table --record`; `raw` holds every launch's step times",
        "parts": [{"text": first + [f"Failed: {line}." for line in failed],
                   "table": {"columns": RECORD_COLUMNS, "formats": RECORD_FORMATS,
                             "rows": [record_row(r) for r in ok]}}],
        "raw": [{k: r.get(k) for k in ("world_size", "size_name", "strategy", "repeat", "params", "step_times",
                                        "peak_memory", "peak_growth", "loss")} for r in raw],
    }


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
    if args.record:
        previous = json.loads(args.record.read_text(encoding="utf-8")) if args.record.exists() else None
        args.record.write_text(dumps_record(record(rows, records, run_header(args, argv), previous)), encoding="utf-8")
        print(f"wrote {args.record}; now run `python -m benchmarks.results`")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
