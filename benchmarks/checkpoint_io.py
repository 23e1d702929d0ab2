"""Checkpoint save/resume/consolidate/inference-load times and peak memory: Lightning's ``ddp`` file against
lightning-zero's sharded directories, for a ~20M-parameter GPT on gloo ranks of this machine.

    python -m benchmarks.checkpoint_io                        # width 512, depth 6 (~19M params), 2 ranks
    python -m benchmarks.checkpoint_io --world-size 4 --width 384

Each strategy is its own launch (``_checkpoint_rank.py``), so peak memory is its own. Save and resume are
measured on every rank (the slowest rank and the largest growth are reported); loading for inference and
consolidation run in a fresh single process each, and report the growth of the peak resident set over the
process after imports.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from lightning_zero.testing.launch import launch

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
SINGLE = r"""
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
import torch, lightning_zero
from examples.tiny_gpt import TinyGPT
what, path, width, depth = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if what == "lightning":
    model = TinyGPT.load_from_checkpoint(path, map_location="cpu")
elif what == "zero":
    model = lightning_zero.load_from_checkpoint(TinyGPT, path, map_location="cpu")
else:
    lightning_zero.consolidate(path, path + ".consolidated", weights_only=(what == "consolidate-weights"))
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "rss": (peak - base) * 1024}))
"""


def single(what: str, path: str, width: int, depth: int) -> dict:
    result = subprocess.run([sys.executable, "-c", SINGLE, what, path, str(width), str(depth)], cwd=ROOT,
                            capture_output=True, text=True, check=True, env={"PYTHONPATH": str(ROOT),
                                                                              "OMP_NUM_THREADS": "1",
                                                                              "MALLOC_MMAP_THRESHOLD_": "131072",
                                                                              "PATH": "/usr/bin:/bin"})
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        rows = {}
        for name in STRATEGIES:
            out = Path(tmp) / name
            out.mkdir()
            ranks = launch("../../benchmarks/_checkpoint_rank.py", args.world_size, out, (name, str(args.width), str(args.depth)),
                           timeout=900)
            path = ranks[0]["path"]
            files = [Path(path)] if Path(path).is_file() else list(Path(path).iterdir())
            rows[name] = {
                "save_s": max(r["save_s"] for r in ranks), "save_rss": max(r["save_rss"] for r in ranks),
                "load_s": max(r["load_s"] for r in ranks), "load_rss": max(r["load_rss"] for r in ranks),
                "bytes": sum(f.stat().st_size for f in files),
                "inference": single("lightning" if name == "ddp" else "zero", path, args.width, args.depth),
                "consolidate": None if name == "ddp" else single("consolidate", path, args.width, args.depth),
            }
    import torch

    from examples.tiny_gpt import TinyGPT

    psi = sum(p.numel() for p in TinyGPT(width=args.width, depth=args.depth).parameters())
    print(f"GPT width {args.width} depth {args.depth}: {psi:,} parameters (fp32 weights {psi * 4 / mib:.1f} MiB, "
          f"AdamW states {psi * 8 / mib:.1f} MiB), {args.world_size} gloo ranks, torch {torch.__version__}\n")
    print("| strategy | on disk (MiB) | save (s) | save peak RSS growth / rank (MiB) | resume load (s) | "
          "resume peak RSS growth / rank (MiB) | inference load (s) | inference peak growth (MiB) | "
          "consolidate (s) | consolidate peak growth (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        c = r["consolidate"]
        print(f"| {name} | {r['bytes'] / mib:.1f} | {r['save_s']:.2f} | {r['save_rss'] / mib:.0f} | {r['load_s']:.2f} | "
              f"{r['load_rss'] / mib:.0f} | {r['inference']['seconds']:.2f} | {r['inference']['rss'] / mib:.0f} | "
              + (f"{c['seconds']:.2f} | {c['rss'] / mib:.0f} |" if c else "– | – |"))


if __name__ == "__main__":
    main()
