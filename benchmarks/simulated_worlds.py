"""Rank 0 of the paper's worlds, measured on one machine: the 7.5B GPT under zero3 at N = 8 to 1024.

    python -m benchmarks.simulated_worlds                         # N = 64 and 1024, the paper's 7.5B shape
    python -m benchmarks.simulated_worlds --world-sizes 8 64 256 1024 --out bench-out
    python -m benchmarks.simulated_worlds --width 512 --depth 4 --vocab 8192 --world-sizes 64   # in seconds

Each world size runs in a process of its own (a fresh process group and a fresh high-water mark):
``lightning-zero estimate --measure --json`` on :class:`PaperGPT` (width 4096, 36 blocks, 32 heads, vocabulary
50,304: 7.45B parameters, built in ``configure_model``), zero3, bf16-mixed, one micro-batch of 1 x 32 tokens, one
optimizer step. The table puts rank 0's measured model states, peak resident memory (above the level after
imports) and traffic beside the formula (16Ψ/N, 3Ψ). Writes ``simulated_worlds.json`` and ``simulated_worlds.md``
under ``--out``. The docs' "Plan a cluster run on one machine" shows the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._model import BenchGPT, GPTSize

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


class PaperSize(GPTSize):
    """The paper's GPT shapes have 32 heads (``GPTSize`` gives one per 64 channels)."""

    @property
    def heads(self) -> int:
        return 32 if self.width % 32 == 0 else 1


class PaperGPT(BenchGPT):
    """The project's GPT at the paper's 7.5B shape by default, one micro-batch of ``batch x seq`` tokens."""

    def __init__(
        self, width: int = 4096, depth: int = 36, vocab: int = 50304, seq: int = 32, batch: int = 1, samples: int = 64
    ) -> None:
        super().__init__(PaperSize(width=width, depth=depth, vocab=vocab, seq=seq, batch=batch), samples)


def measure(world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """One world size in a process of its own: the ``--json`` object, with the wall time."""
    init = {"width": args.width, "depth": args.depth, "vocab": args.vocab, "samples": world_size}
    cmd = [sys.executable, "-m", "lightning_zero", "estimate", "--measure", "--json",
           "--model", "benchmarks.simulated_worlds.PaperGPT", "--init-args", json.dumps(init),
           "-n", str(world_size), "--stage", "3", "--precision", "bf16-mixed"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return {"world_size": world_size, "error": done.stderr[-3000:], "seconds": seconds}
    text = done.stdout
    return {**json.loads(text[text.index("{"):]), "seconds": seconds}


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: measured vs formula, per part, one row per world size."""
    lines = [
        "| N | Ψ | model states (measured) | 16Ψ/N | ratio | peak above imports | peak - model states | "
        "gathered units | buckets | activations and other live heap | traffic (elements) | 3Ψ | ratio | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['world_size']} | failed: see the JSON | | | | | | | | | | | | {r['seconds']:.0f} |")
            continue
        states, formula, peak = r["model_states_bytes"], r["expected_model_states_bytes"], r["peak_rss_bytes"]
        parts = r["peak_parts"]
        traffic, expected = r["traffic_elements_per_step"], r["expected_traffic_elements"]
        lines.append(
            f"| {r['world_size']} | {r['params'] / 1e9:.2f}B | {states / GB:.3f} GB | {formula / GB:.3f} GB | "
            f"{states / formula:.3f} | {peak / GB:.2f} GB | {(peak - states) / GB:.2f} GB | "
            f"{parts['gathered units (pool)'] / GB:.2f} GB | {parts['bucket buffers'] / GB:.3f} GB | "
            f"{parts['activations and other live heap'] / GB:.2f} GB | {traffic / 1e9:.2f}B | {expected / 1e9:.2f}B | "
            f"{traffic / expected:.3f} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=36)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per world size")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.world_sizes:
        rows.append(measure(n, args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "peak_parts"}), flush=True)
        (args.out / "simulated_worlds.json").write_text(json.dumps({"rows": rows}, indent=2))
    markdown = table(rows)
    (args.out / "simulated_worlds.md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
