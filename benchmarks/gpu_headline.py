"""ZeRO-Offload's headline on one GPU: the largest GPT that trains with zero3 alone, and with the optimizer and the
parameters offloaded to the host, at the same sequence length and batch (bf16-mixed, AdamW ``fused=True``).

    python -m benchmarks.gpu_headline --width 4096 --zero3-depths 16 20 24 --offload-depths 28 32 36 \\
        --seq 1024 --batch 1 --out /tmp/headline

Each (strategy, depth) is one launch (``benchmarks.compare.run_config``: a fresh process, so one run's peak and
fragmentation do not reach the next). The depths of each strategy are tried in the given order until one fails (out
of GPU or host memory, or past ``--timeout``); the largest that trained gives the ratio. Both use activation
checkpointing per block, so activations bound neither. Printed and written to ``headline.json``: for every launch
its parameters, median step time, model TFLOPS (``6 * params * tokens / step``, the convention of the MFU figures;
checkpointing's recomputation not counted), peak ``max_memory_allocated`` and the host's resident peak.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks._model import GPTSize
from benchmarks.compare import _median, run_config

STRATEGIES = {
    "zero3": {"activation_checkpointing": True},
    "zero3+offload": {"activation_checkpointing": True, "offload_optimizer": True, "offload_params": True},
}


def launch(strategy: str, size: GPTSize, args: argparse.Namespace) -> dict[str, Any]:
    """One training launch of ``size`` under ``strategy``; its record (``error`` when it did not train)."""
    cfg = {"strategy": "zero3", "size": size.__dict__, "steps": args.steps, "warmup": args.warmup, "bucket": None,
           "gpu": True, "precision": args.precision, "profile": False, "options": STRATEGIES[strategy],
           "clip": None, "fused": True, "compile": False}
    t0 = time.perf_counter()
    rec = run_config(cfg, 1, args.timeout)
    rec.update(strategy=strategy, depth=size.depth, width=size.width, params=size.num_params(),
               seconds=time.perf_counter() - t0)
    if "step_times" in rec:
        step = _median(rec["step_times"])
        rec["median_step"] = step
        rec["tflops"] = 6 * size.num_params() * size.seq * size.batch / step / 1e12
    return rec


def line(rec: dict[str, Any]) -> str:
    head = f"{rec['strategy']:>14} depth {rec['depth']:>3}  {rec['params'] / 1e9:6.2f}B"
    if "error" in rec or "median_step" not in rec:
        return f"{head}  did not train: {str(rec.get('error', rec))[:300]}"
    return (f"{head}  step {rec['median_step'] * 1e3:8.0f} ms  {rec['tflops']:6.1f} TFLOPS  "
            f"GPU peak {rec['peak_memory'] / 2**30:6.1f} GiB  host peak {rec['host_peak'] / 2**30:6.1f} GiB  "
            f"loss {rec['loss']:.3f}  ({rec['seconds']:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--zero3-depths", type=int, nargs="*", default=[16, 20, 24])
    parser.add_argument("--offload-depths", type=int, nargs="*", default=[28, 32, 36])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    records = []
    for strategy, depths in (("zero3", args.zero3_depths), ("zero3+offload", args.offload_depths)):
        for depth in depths:
            size = GPTSize(width=args.width, depth=depth, vocab=args.vocab, seq=args.seq, batch=args.batch)
            rec = launch(strategy, size, args)
            records.append(rec)
            print(line(rec), flush=True)
            if "median_step" not in rec:
                break
    largest = {s: max((r["params"] for r in records if r["strategy"] == s and "median_step" in r), default=0)
               for s in STRATEGIES}
    ratio = largest["zero3+offload"] / largest["zero3"] if largest["zero3"] else float("nan")
    print(f"largest trained: zero3 {largest['zero3'] / 1e9:.2f}B, zero3+offload {largest['zero3+offload'] / 1e9:.2f}B"
          f" -> {ratio:.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "headline.json").write_text(json.dumps({"args": vars(args), "records": records, "ratio": ratio},
                                                  default=str))


if __name__ == "__main__":
    main()
