"""ZeRO++'s quantized collectives against the exact run: the demo's GPT under zero3 on CPU gloo ranks, exact and
with qwZ, qgZ and both, the same seed and data; prints the per-step training loss difference, the validation loss
after the last step (twice: with the forward's gathers as in training, so qwZ's int8 weights, and with the exact fp32
masters after ``teardown``, as a checkpoint loaded for inference holds them) and the bytes per step of each
collective kind (see the Notes of ``comm/quantize.py``).

    python -m benchmarks.zeropp_loss --steps 300 --world-size 2 [--block 64] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from lightning_zero.testing.launch import launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--val-batches", type=int, default=20, help="validation batches per rank after the last step")
    parser.add_argument("--block", type=int, default=256, help="quantization_block_size of the quantized runs")
    parser.add_argument("--seed", type=int, default=0, help="initialization and data order of every run")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default=None, help="write the summary as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = launch("../../benchmarks/_zeropp_rank.py", args.world_size, Path(tmp),
                       (str(args.steps), str(args.val_batches), str(args.block), str(args.seed)), timeout=args.timeout)
    runs = ranks[0]
    exact = runs["exact"]
    summary = {}
    print(f"GPT of {exact['params']:,} parameters, zero3 on {args.world_size} gloo ranks, {args.steps} steps, "
          f"quantization blocks of {args.block}, seed {args.seed}")
    for mode, run in runs.items():
        diffs = [abs(a - e) / abs(e) for a, e in zip(run["losses"], exact["losses"])]
        val = (run["val_loss"] - exact["val_loss"]) / exact["val_loss"]
        val_exact_weights = ((run["exact_weights_val_loss"] - exact["exact_weights_val_loss"])
                             / exact["exact_weights_val_loss"])
        summary[mode] = {"val_loss": run["val_loss"], "val_rel_diff": val, "max_step_rel_diff": max(diffs),
                         "mean_step_rel_diff": sum(diffs) / len(diffs),
                         "exact_weights_val_loss": run["exact_weights_val_loss"],
                         "exact_weights_val_rel_diff": val_exact_weights, "final_loss": run["losses"][-1],
                         "bytes_per_step": run["bytes"], "seconds_per_step": run["seconds_per_step"]}
        print(f"{mode:8s} val {run['val_loss']:.4f} ({100 * val:+.2f}%), with the exact weights "
              f"{run['exact_weights_val_loss']:.4f} ({100 * val_exact_weights:+.2f}%)  per-step loss diff max "
              f"{100 * max(diffs):.2f}% mean {100 * sum(diffs) / len(diffs):.2f}%  {run['seconds_per_step']:.3f} s/step"
              f"  bytes/step {run['bytes']}")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
