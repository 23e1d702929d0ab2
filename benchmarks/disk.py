"""Disk offload (ZeRO-Infinity, ``offload_optimizer="disk"`` + ``offload_params="disk"``) against stage 3 in memory
and stage 3 offloaded to host memory: peak resident memory per rank, step time, and the disk tier's bytes per step.

    python -m benchmarks.disk --widths 512 1024 --depth 12 --steps 4 --warmup 1

Each (model, variant) is its own launch of 2 gloo ranks (``benchmarks._worker``), so each peak (``VmHWM``: anonymous
and file-mapped pages alike) is its own. The models are GPTs with a small vocabulary and short sequences, so that
activations are negligible and the model states dominate. What the disk tier takes out of a rank's memory is its
fp32 master shard and the two Adam states (the working shard *is* the master file in fp32: [Note: what lives on
disk] in ``lightning_zero/shards/disk.py``), 12Ψ/N bytes; the gradient shard (4Ψ/N) stays in host memory. The window
traffic per step and rank is, by [Note: the step one window at a time]: written 12Ψ/N (each window's master and
states once), read 12Ψ/N by the step plus 4Ψ/N per gather of the parameter shard (at most 8Ψ/N: forward, and
backward again; the table's read column holds the measured bytes against that bound).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks._model import GPTSize
from benchmarks.compare import _median, run_config

MiB = 2**20
VARIANTS = {
    "zero3": {},
    "zero3+host": {"offload_optimizer": True, "offload_params": True},
    "zero3+disk": {"offload_optimizer": "disk", "offload_params": "disk"},
}


def measure(size: GPTSize, steps: int, warmup: int, world_size: int) -> dict[str, dict[str, Any]]:
    """One launch per variant: ``{variant: record of benchmarks.compare.run_config}``."""
    out = {}
    for name, options in VARIANTS.items():
        cfg = {"strategy": "zero3", "size": size.__dict__, "steps": steps, "warmup": warmup, "bucket": None,
               "gpu": False, "precision": "32-true", "options": options, "fused": True}
        start = time.perf_counter()
        out[name] = run_config(cfg, world_size, timeout=1800)
        out[name]["wall"] = time.perf_counter() - start
    return out


def report(size: GPTSize, runs: dict[str, dict[str, Any]], world_size: int, steps: int) -> list[str]:
    """Markdown rows for one model size."""
    psi = size.num_params()
    moved = 12 * psi / world_size
    rows = []
    base = runs["zero3"]
    for name, rec in runs.items():
        if "error" in rec:
            rows.append(f"| {psi / 1e6:.0f}M | {name} | error: {rec['error'][:200]} |")
            continue
        io = rec["disk_io"][0] or {"read": 0, "written": 0}
        fall = base.get("peak_growth", 0) - rec["peak_growth"]
        rows.append(
            f"| {psi / 1e6:.1f}M | {name} | {rec['peak_growth'] / MiB:.0f} | {fall / MiB:.0f} | {moved / MiB:.0f} | "
            f"{(moved - fall) / MiB:.0f} | {_median(rec['step_times']) * 1e3:.0f} | "
            f"{io['read'] / steps / MiB:.1f} / {20 * psi / world_size / MiB:.1f} | "
            f"{io['written'] / steps / MiB:.1f} / {moved / MiB:.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the raw records here (JSON)")
    args = parser.parse_args()
    print("| params | variant | peak RSS growth (MiB) | fall vs zero3 (MiB) | 12Ψ/N (MiB) | 12Ψ/N - fall (MiB) | "
          "median step (ms) | disk read/step: measured / 20Ψ/N (MiB) | written/step: measured / 12Ψ/N (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    raw = {}
    for width in args.widths:
        size = GPTSize(width=width, depth=args.depth, vocab=512, seq=32, batch=2)
        runs = measure(size, args.steps, args.warmup, args.world_size)
        raw[width] = runs
        for line in report(size, runs, args.world_size, args.steps):
            print(line, flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(raw, default=str))


if __name__ == "__main__":
    main()
