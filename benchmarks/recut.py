"""Universal checkpoints (issue 25 part 3): the cost of reading a tensor-parallel slice at another size.

    python -m benchmarks.recut [--size 4096] [--repeats 3]

One ``size x size`` fp32 weight, saved with ``torch.distributed.checkpoint`` as its stacked slices at t = 2 (the
form of a sharded checkpoint), read by one process as one rank's slice (rank 1) at t' = 1, 2 and 4, column-parallel
(cut along dimension 0) and row-parallel (along 1): the time to map the slice onto the saved runs and windows
(``to_saved_layout``) and to read and place it (DCP's read and ``finish``), best of ``--repeats``; t' = 2 is the
read without a re-cut. Every read is checked against ``tensor_parallel.cut``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from lightning_zero.checkpoints.recut import finish, to_saved_layout
from lightning_zero.checkpoints.shards import Shard
from lightning_zero.checkpoints.storage import _ShardSavePlanner, load_sharded
from lightning_zero.tensor_parallel import cut


def _save(root: Path, whole: torch.Tensor, dim: int, t: int) -> dict:
    """Write ``whole`` as its ``t`` stacked slices (one piece per slice, as t writing ranks would); the metadata."""
    slices = cut(whole, t, dim)
    stacked = torch.stack(slices).reshape(-1).clone()
    shape = (t, *slices[0].shape)
    n = slices[0].numel()
    shard = Shard(shape, torch.float32, [(j * n, stacked[j * n : (j + 1) * n]) for j in range(t)])
    dcp.save({}, storage_writer=dcp.FileSystemWriter(root), planner=_ShardSavePlanner({"w": shard}), no_dist=True)
    return {"tensor_parallel": {"w": (dim, 1)}, "tensors": {"w": (shape, "float32")}}


def _read(root: Path, info: dict, whole: torch.Tensor, dim: int, t: int, repeats: int) -> tuple[float, float, int]:
    """(map seconds, read seconds, windows read) for rank 1 (rank 0 at t = 1) of size ``t``, best of ``repeats``."""
    rank = min(1, t - 1)
    local = cut(whole, t, dim)[rank] if t > 1 else whole
    best = (float("inf"), float("inf"), 0)
    for _ in range(repeats):
        dest = torch.empty(local.numel())
        shard = (Shard((t, *local.shape), torch.float32, [(rank * local.numel(), dest)], local_shape=tuple(local.shape),
                       joins_along=dim) if t > 1 else Shard(tuple(whole.shape), torch.float32, [(0, dest)]))
        start = time.perf_counter()
        read, copies = to_saved_layout("w", shard, info)
        mapped = time.perf_counter()
        load_sharded(root, {"w": read}, None, collective=False)
        finish(copies)
        done = time.perf_counter()
        if not torch.equal(dest, local.reshape(-1)):
            raise AssertionError(f"the re-cut read of rank {rank} at t={t} is wrong")
        if (mapped - start) + (done - mapped) < sum(best[:2]):
            best = (mapped - start, done - mapped, len(read.pieces))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    whole = torch.randn(args.size, args.size)
    print("| layout | t -> t' | windows | map ms | read ms | MiB read into |\n|---|---|---|---|---|---|")
    for dim, name in ((0, "column-parallel"), (1, "row-parallel")):
        root = Path(tempfile.mkdtemp(prefix="recut_"))
        try:
            info = _save(root, whole, dim, 2)
            for t in (2, 4, 1):
                mapped, read, windows = _read(root, info, whole, dim, t, args.repeats)
                mib = whole.numel() * 4 / t / 2**20
                print(f"| {name} | 2 -> {t} | {windows} | {mapped * 1e3:.1f} | {read * 1e3:.1f} | {mib:.0f} |")
        finally:
            shutil.rmtree(root)


if __name__ == "__main__":
    main()
