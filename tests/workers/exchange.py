"""One rank of the direct tests of the pairwise exchanges on gloo (tests/test_collectives.py): reduce-scatter and
all-gather, several in flight at once over two process groups and waited for in another order than issued, beside
gloo's own all-reduce and all-gather of the same inputs.

Every rank's input is :func:`values` of its rank, so the test recomputes every expected result on its own. Saves,
per rank, what each collective produced.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.comm import collectives

CHUNK = 1_000
"""Elements of one rank's chunk (large enough that the exchanges overlap in the transport)."""
ROUNDS = 3
"""Collectives of each kind in flight at once."""


def values(rank: int, round_: int, world_size: int) -> Tensor:
    """Rank ``rank``'s input of reduce-scatter number ``round_`` (``world_size`` chunks)."""
    generator = torch.Generator().manual_seed(1_000 * rank + round_)
    return torch.randn(world_size * CHUNK, generator=generator)


def exchange(rank: int, size: int) -> dict[str, Any]:
    """Run the collectives; what each produced on this rank."""
    second = dist.new_group(list(range(size)))
    works, chunks, gathers, in_place = [], [], [], []
    for round_ in range(ROUNDS):  # issued interleaved over two groups, waited for in reverse
        chunk = torch.empty(CHUNK)
        works.append(collectives.reduce_scatter(chunk, values(rank, round_, size), async_op=True))
        gathered = torch.empty(size * CHUNK)
        works.append(collectives.all_gather(gathered, values(rank, round_, size)[:CHUNK], group=second,
                                            async_op=True))
        full = torch.zeros(size * CHUNK)  # the input is this rank's slice of the output
        full[rank * CHUNK : (rank + 1) * CHUNK] = values(rank, round_, size)[CHUNK : 2 * CHUNK]
        works.append(collectives.all_gather(full, full[rank * CHUNK : (rank + 1) * CHUNK], async_op=True))
        chunks.append(chunk)
        gathers.append(gathered)
        in_place.append(full)
    for work in reversed(works):
        collectives.wait(work, "exchange")
    summed = values(rank, 0, size)
    dist.all_reduce(summed)  # gloo's own sum, for the bit-identity at N = 2
    native = torch.empty(size * CHUNK)
    collectives.all_gather(native, values(rank, 0, size)[:CHUNK], verified=False)
    return {"rank": rank, "chunks": chunks, "gathers": gathers, "in_place": in_place,
            "all_reduce": summed[rank * CHUNK : (rank + 1) * CHUNK].clone(), "native": native}


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.save(exchange(dist.get_rank(), dist.get_world_size()), Path(sys.argv[1]) / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()
