"""Interleaved A/B launches of ``benchmarks._worker`` on a shared machine: variants of zero3 (options, environment)
against DDP, each variant once per round, the rounds rotating their order; medians and ranges at the end.

    python -m benchmarks.zero3_ab --rounds 3 --variants ddp zero3 zero3:prefetch_size=0 zero3:overlap_comm=False \\
        zero3+OMP_NUM_THREADS=2

A variant is ``strategy[:option=value,...][+ENV=value,...]``; option values are Python literals.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import time
from contextlib import contextmanager
from typing import Any, Iterator


from benchmarks.compare import run_config
from benchmarks._model import SIZES


def parse_variant(text: str) -> tuple[str, dict[str, Any], dict[str, str]]:
    """``zero3:prefetch_size=0+FOO=1`` to ``("zero3", {"prefetch_size": 0}, {"FOO": "1"})``."""
    head, _, env_text = text.partition("+")
    strategy, _, opt_text = head.partition(":")
    options = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in opt_text.split(",") if o)}
    env = dict(e.split("=", 1) for e in env_text.split(",") if e)
    return strategy, options, env


def run_variant(text: str, size: str, steps: int, warmup: int) -> dict[str, Any]:
    """One launch of one variant on two ranks; the environment additions apply to this launch only."""
    strategy, options, env = parse_variant(text)
    with environment(env):
        cfg = {"strategy": strategy, "size": SIZES[size].__dict__, "steps": steps, "warmup": warmup,
               "bucket": None, "gpu": False, "precision": "32-true", "options": options}
        return run_config(cfg, 2, timeout=900)


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` set, as it was again afterwards (the launched ranks inherit it)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["ddp", "zero3"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="medium", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    medians: dict[str, list[float]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        shift = r % len(args.variants)
        for variant in args.variants[shift:] + args.variants[:shift]:
            t0 = time.perf_counter()
            rec = run_variant(variant, args.size, args.steps, args.warmup)
            if "error" in rec:
                print(f"[{r}] {variant}: {rec['error']}", flush=True)
                continue
            med = statistics.median(rec["step_times"]) * 1e3
            medians[variant].append(med)
            cpu = ", ".join(f"{c:.1f}" for c in rec["cpu_seconds"] if c is not None)
            print(f"[{r}] {variant}: median step {med:.0f} ms, steps {[round(t * 1e3) for t in rec['step_times']]}, "
                  f"loss {rec['loss']:.6f}, calls {rec['comm_calls']}, rank cpu s [{cpu}] ({time.perf_counter() - t0:.0f}s)", flush=True)
    base = statistics.median(medians[args.variants[0]]) if medians[args.variants[0]] else float("nan")
    print(f"\n| variant | median of launch medians (ms) | range (ms) | vs {args.variants[0]} | launches |")
    print("|---|---|---|---|---|")
    for variant, values in medians.items():
        if values:
            m = statistics.median(values)
            print(f"| {variant} | {m:,.0f} | {min(values):,.0f}–{max(values):,.0f} | {m / base:.2f} | {len(values)} |")


if __name__ == "__main__":
    main()
