"""Regression check of step time against DDP, to run before merging (not a timed test of the suite).

    python -m benchmarks.check_speed                  # idle machine: zero1 <= 1.05x, zero2 <= 1.00x, zero3 <= 1.00x
    python -m benchmarks.check_speed --loaded         # two busy loops beside the run: 1.10x / 1.10x / 1.30x
    python -m benchmarks.check_speed --repeats 3 --metric cpu --out /tmp/speed

Runs ``benchmarks.compare`` for ``ddp`` and ``zero1``-``zero3`` at N = 2 on the ``small`` GPT (5.3M parameters, fp32
AdamW, gradient clipping 1.0, the strategies' default options), interleaved over ``--repeats`` rounds, in the conditions
a user's run has: glibc's own allocator settings (no ``MALLOC_MMAP_THRESHOLD_`` in the environment, see
[Note: no allocator setting decides speed or memory] in ``lightning_zero/memory/host_memory.py``). It prints each
strategy's median step time (``--metric wall``, the slowest rank's) or CPU time per step (``--metric cpu``, less
sensitive to a shared machine), its ratio to DDP's, the ratio repeat by repeat (each repeat's median against DDP's in
the same repeat: how far the machine's slow phases move it) and the page faults per step, and exits with status 1 when a
ratio exceeds its limit (``--limit zero2=1.02`` overrides one). The machine's load average is printed: the idle limits
assume an idle one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

from benchmarks._model import SIZES
from benchmarks._report import paired_ratios as report_paired_ratios
from benchmarks.compare import arguments as compare_arguments
from benchmarks.compare import compare, environment, machine

#: Ratio to DDP's step that each stage may not exceed (issue 23), on an idle machine and with two busy loops beside.
LIMITS = {"idle": {"zero1": 1.05, "zero2": 1.00, "zero3": 1.00},
          "loaded": {"zero1": 1.10, "zero2": 1.10, "zero3": 1.30}}


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loaded", action="store_true", help="the limits of a loaded machine")
    parser.add_argument("--metric", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--size", default="small", choices=list(SIZES))
    parser.add_argument("--limit", action="append", default=[], metavar="STRATEGY=RATIO")
    parser.add_argument("--out", default="/tmp/lightning_zero_check_speed")
    return parser.parse_args(argv)


def _compare_args(args: argparse.Namespace) -> argparse.Namespace:
    """``benchmarks.compare``'s command line for this check (its other options at their defaults)."""
    return compare_arguments().parse_args([
        "--world-sizes", "2", "--strategies", "ddp", "zero1", "zero2", "zero3", "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--clip", "1.0", "--out", args.out])


def medians(records: list[dict[str, Any]], metric: str) -> dict[str, dict[str, float]]:
    """Per strategy: the median over every measured step of every repeat, and the median page faults per step."""
    key = "step_times" if metric == "wall" else "step_cpu"
    out: dict[str, dict[str, float]] = {}
    for name in sorted({r["strategy"] for r in records}):
        ok = [r for r in records if r["strategy"] == name and key in r]
        if not ok:
            reason = next((r.get("error") or r.get("skipped") for r in records if r["strategy"] == name), "?")
            raise SystemExit(f"{name} did not run: {reason}")
        out[name] = {"step": statistics.median(v for r in ok for v in r[key]),
                     "faults": statistics.median(v for r in ok for v in r.get("step_faults", [0]))}
    return out


def paired_ratios(records: list[dict[str, Any]], metric: str) -> dict[str, list[float]]:
    """Per strategy: its median step over DDP's median step *of the same repeat*, one ratio per repeat
    (:func:`benchmarks._report.paired_ratios` for the one size timed). The repeats run close together in time, so
    these show how far a shared machine's slow phases move the ratio (the verdict stays on the pooled medians of
    :func:`medians`, the issue's measure)."""
    key = "step_times" if metric == "wall" else "step_cpu"
    return {strategy: ratios for (_, _, strategy), ratios in report_paired_ratios(records, key).items()}


def main(argv: list[str]) -> int:
    args = _arguments(argv)
    limits = dict(LIMITS["loaded" if args.loaded else "idle"])
    limits.update({k: float(v) for k, v in (item.split("=", 1) for item in args.limit)})
    load = os.getloadavg()[0]
    with environment({"BENCH_GLIBC_DEFAULTS": "1"}):
        records = compare(_compare_args(args), {args.size: SIZES[args.size]})
    stats = medians(records, args.metric)
    paired = paired_ratios(records, args.metric)
    ddp = stats["ddp"]["step"]
    print(f"\n{machine()}; load average {load:.2f} before, {os.getloadavg()[0]:.2f} after; metric {args.metric}")
    print("| strategy | step (ms) | vs ddp | limit | repeat by repeat: median (min-max) | page faults / step |\n"
          "|---|---|---|---|---|---|")
    failed = []
    for name, s in stats.items():
        ratio, limit = s["step"] / ddp, limits.get(name)
        verdict = "" if limit is None else (" ok" if ratio <= limit else " OVER")
        if limit is not None and ratio > limit:
            failed.append(f"{name} {ratio:.2f}x > {limit:.2f}x")
        each = paired.get(name) or [ratio]
        spread = f"{statistics.median(each):.2f} ({min(each):.2f}-{max(each):.2f})"
        print(f"| {name} | {s['step'] * 1e3:.1f} | {ratio:.2f}{verdict} | {limit or '-'} | {spread} | "
              f"{s['faults']:.0f} |")
    if failed:
        print("\nslower than the limits: " + ", ".join(failed) + " (on a busy machine, rerun or use --loaded)")
        return 1
    print("\nwithin the limits")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
