"""Measured model-state bytes and peak memory per rank, and traffic per step, for ddp and zero1-3, next to
DESIGN.md's table.

    python benchmarks/model_states.py                     # MLP LM, width 768 (~4.8M params), world sizes 2 and 4
    python benchmarks/model_states.py --model gpt --width 512 --depth 6     # GPT, ~19M params, tied embeddings
    python benchmarks/model_states.py --width 256 --world-sizes 2 3 --precision bf16-mixed

Every (world size, strategy) is its own launch of gloo ranks on this machine (tests/workers/measure.py), so that
the peak resident memory of each run is its own; same seed, same data.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_zero import expected_model_state_bytes  # noqa: E402
from tests.launch import launch  # noqa: E402

STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--model", choices=["lm", "gpt"], default="lm")
    parser.add_argument("--depth", type=int, default=6, help="blocks of the gpt model")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
