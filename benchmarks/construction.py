"""Host memory and time of zero3's sharded construction (record ``configure_model``, replay unit by unit), per rank.

    python -m benchmarks.construction                       # HF GPT-2 small (124M parameters), 2 ranks
    python -m benchmarks.construction --layers 24 --width 1024 --world-size 4

Each rank builds a Hugging Face GPT-2 (random init from a config, nothing downloaded) in ``configure_model`` under
``ZeroStrategy(stage=3)`` and reports its peak resident memory growth from before ``fit`` to the end of setup
(``on_fit_start``), next to the full model's bytes, this rank's shard bytes and the largest unit's bytes, and the
time of setup against eager construction of the same model in one process.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path


from lightning_zero.testing.launch import launch

MIB = 2**20


def eager_seconds(layers: int, width: int) -> float:
    import transformers

    from benchmarks._construction_rank import config

    start = time.perf_counter()
    transformers.AutoModelForCausalLM.from_config(config(layers, width))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        ranks = launch("../../benchmarks/_construction_rank.py", args.world_size, Path(out),
                       (str(args.layers), str(args.width)), timeout=1800)
    eager = eager_seconds(args.layers, args.width)
    print("| rank | parameters | full model (MiB) | shard (MiB) | largest unit (MiB) | peak RSS growth to end of setup "
          "(MiB) | setup (s) | eager construction, 1 process (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for r, rank in enumerate(ranks):
        print(f"| {r} | {rank['params']:,} | {rank['full'] / MIB:.0f} | {rank['shard'] / MIB:.0f} | "
              f"{rank['unit'] / MIB:.0f} | {rank['growth'] / MIB:.0f} | {rank['setup']:.1f} | {eager:.1f} |")
    print(json.dumps({"max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


if __name__ == "__main__":
    main()
