"""gloo's collectives on one buffer: why ``lightning_zero.comm.collectives`` runs reduce-scatter and all-gather as
pairwise exchanges on CPU, and a larger group's reduce-scatter as an all-reduce (see its [Note: reduce-scatter and
all-gather on gloo]).

    python -m benchmarks.gloo_collectives --elements 23000000 --world-size 2 --repeats 5
    python -m benchmarks.gloo_collectives --elements 25000000 --world-size 4 --repeats 3 --bucket-sweep

``--bucket-sweep`` instead times the all-reduce of the whole buffer cut into buckets of 25M, 4M, 1M, 500K, 250K and
100K elements (all launched asynchronously, then waited for, as the gradient reducer does): the per-call cost that
sets the lower end of the default bucket size (see [Note: the default bucket size] in ``lightning_zero/shards/policy.py``).

Prints the median and the lowest time of each operation on rank 0, interleaved over the repeats: the all-reduce,
reduce-scatter and all-gather of gloo, the same two done as all-reduces, and the memory passes a bucket costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_zero.comm import collectives


def _ops(n: int, world_size: int, rank: int) -> dict[str, object]:
    x, full = torch.randn(n), torch.empty(n)
    chunk = torch.empty(n // world_size)
    mine = slice(rank * (n // world_size), (rank + 1) * (n // world_size))

    def gather_as_all_reduce() -> None:
        full[: mine.start].zero_()
        full[mine.stop :].zero_()
        dist.all_reduce(full)

    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(chunk, x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, chunk),
        "reduce-scatter as all-reduce + copy": lambda: (dist.all_reduce(x), chunk.copy_(x[mine])),
        "all-gather as zero + all-reduce": gather_as_all_reduce,
        "lightning_zero reduce-scatter (pairwise exchange at N = 2)": lambda: collectives.reduce_scatter(chunk, x),
        "lightning_zero all-gather (pairwise exchange)": lambda: collectives.all_gather(full, chunk),
        "copy (one pass)": lambda: full.copy_(x),
        "zero_": lambda: full.zero_(),
        "div_": lambda: full.div_(world_size),
        "torch.div(out=)": lambda: torch.div(x, world_size, out=full),
    }


def _bucket_ops(n: int) -> dict[str, object]:
    x = torch.randn(n)

    def bucketed(size: int) -> object:
        def run() -> None:
            works = [dist.all_reduce(x[i : i + size], async_op=True) for i in range(0, n, size)]
            for work in works:
                work.wait()

        return run

    sizes = [25_000_000, 4_000_000, 1_000_000, 500_000, 250_000, 100_000]
    return {f"all_reduce in buckets of {s:,} ({-(-n // s)} calls)": bucketed(s) for s in sizes}


def _worker(rank: int, world_size: int, n: int, repeats: int, port: int, sweep: bool = False) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ops = _bucket_ops(n) if sweep else _ops(n, world_size, rank)
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeats):
        for name, op in ops.items():
            dist.barrier()
            t0 = time.perf_counter()
            op()  # type: ignore[operator]
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        print(f"| operation ({n:,} fp32 elements, {world_size} gloo ranks, 1 thread each) | median (ms) | min (ms) |")
        print("|---|---|---|")
        for name, values in times.items():
            print(f"| {name} | {statistics.median(values) * 1e3:.0f} | {min(values) * 1e3:.0f} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=23_000_000)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-sweep", action="store_true", help="time the all-reduce in buckets of each size")
    args = parser.parse_args()
    from lightning_zero.testing.launch import free_port  # noqa: PLC0415

    mp.spawn(_worker, args=(args.world_size, args.elements, args.repeats, free_port(), args.bucket_sweep), nprocs=args.world_size)


if __name__ == "__main__":
    main()
