"""``zero_auto``'s predicted peak against the measured one, stage by stage, on the project's GPT.

    python -m benchmarks.auto                                   # sizes small and gpt19m, fp32 and bf16-mixed, N = 2
    python -m benchmarks.auto --sizes small --precisions 32-true

One launch of ``tests/workers/auto.py`` per (size, precision): a first fit (``cold``: it also shows what a process's
first fit grows by once, which no prediction covers), then one fit per stage with ``zero_auto`` held to that one
candidate. Peaks are measured as [Note: what peak means] in ``lightning_zero/engine/auto/budget.py`` says (CPU: the
rank's resident growth from the start of setup), the highest over the ranks.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from lightning_zero.testing.launch import launch

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["small", "gpt19m"])
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    fits = ",".join(f"only-zero{stage}:configure" for stage in (1, 2, 3))
    print("| size | precision | fit | chosen | predicted (MiB) | measured (MiB) | error |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for precision in args.precisions:
            with tempfile.TemporaryDirectory() as tmp:
                ranks = launch("auto.py", args.world_size, Path(tmp), (size, precision, fits), timeout=1800)
            for record in ranks[0]:
                predicted = record["predictions"][record["chosen"]]
                measured = record["measured"]
                print(f"| {size} | {precision} | {record['spec']} | {record['chosen']} | {predicted / MiB:.1f} | "
                      f"{measured / MiB:.1f} | {(predicted - measured) / measured:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
