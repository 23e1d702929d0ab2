"""What the signal guard's step boundary costs (issue 26, part 4): ``GUARD.safe_point(groups)`` runs one ``agree_max``
(an all-reduce of three integers) per training step so that every rank acts on a signal at the same step.

    python -m benchmarks.safe_point [--world-size 2] [--calls 300]

Prints the median time of one ``safe_point`` with the guard installed (the all-reduce) and uninstalled (a flag
test), on gloo ranks of this machine; compare with a step's time in ``RESULTS.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world_size: int, calls: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from lightning_zero.comm.groups import ShardGroups  # noqa: PLC0415
    from lightning_zero.process.shutdown import GUARD  # noqa: PLC0415

    groups = ShardGroups()

    def median_us() -> float:
        times = []
        for _ in range(calls):
            dist.barrier()
            start = time.perf_counter()
            GUARD.safe_point(groups)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    idle = median_us()
    GUARD.install(None)
    installed = median_us()
    GUARD.remove()
    if rank == 0:
        print(f"world size {world_size}: safe_point {installed:.0f} us installed (one agree_max), "
              f"{idle:.2f} us uninstalled; load average {os.getloadavg()[0]:.1f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    from lightning_zero.testing.launch import free_port  # noqa: PLC0415

    mp.spawn(_rank, args=(args.world_size, args.calls, free_port()), nprocs=args.world_size)


if __name__ == "__main__":
    main()
