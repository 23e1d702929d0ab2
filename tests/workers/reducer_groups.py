"""One rank of the direct tests of the core's collectives under hybrid sharding (tests/test_reducer_groups.py): 4 gloo
ranks, shard groups of 2 (ranks 0-1 and 2-3), replica groups {0, 2} and {1, 3}.

- The :class:`GradientReducer` with a device shard and with a sink (``offload.HostGrads``): two backwards that
  accumulate, then ``clear`` and one backward in which parameter 1 gets no gradient. Every rank's gradients are
  :func:`grad` of its global rank, so the test recomputes the mean over the world on its own.
- :class:`ShardedParams` over the shard group: each rank holds only its shard of :func:`flat_values`; after
  gathering, every parameter must hold its whole values.

Saves, per rank, the shards, the collective payload by scope and the gathered parameters.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero.comm import collectives
from lightning_zero.shards.buckets import GradientReducer
from lightning_zero.comm.groups import ShardGroups, make_shard_groups
from lightning_zero.shards.layout import FlatLayout, plan_layout
from lightning_zero.shards.offload import HostGrads
from lightning_zero.stage3.params import ShardedParams
from tests.compare import shard_of

SHARD_GROUP_SIZE = 2
NUMELS = [13, 7, 30, 5, 21]
BUCKET_SIZE = 8
ROUNDS = 2
"""Backwards accumulated before the first ``finalize``."""
SKIPPED = 1
"""The parameter that gets no gradient in the backward after ``clear``."""
UNITS = [0, 0, 1, 1, 2]
"""The stage 3 units of the parameters for :class:`ShardedParams`."""


def grad(rank: int, param: int, backward: int) -> Tensor:
    """The gradient global rank ``rank`` produces for parameter ``param`` in backward number ``backward``."""
    generator = torch.Generator().manual_seed(10_000 * rank + 100 * param + backward)
    return torch.randn(NUMELS[param], generator=generator)


def flat_values(layout: FlatLayout) -> Tensor:
    """The whole flat working buffer of :class:`ShardedParams` (the same on every rank)."""
    return torch.randn(layout.total, generator=torch.Generator().manual_seed(7))


def reducer_layout() -> FlatLayout:
    """The layout of the reducer: sharded over one shard group."""
    return plan_layout(NUMELS, [0] * len(NUMELS), SHARD_GROUP_SIZE, BUCKET_SIZE)


def params_layout() -> FlatLayout:
    """The layout of :class:`ShardedParams`: sharded over one shard group, in :data:`UNITS`."""
    return plan_layout(NUMELS, [0] * len(NUMELS), SHARD_GROUP_SIZE, BUCKET_SIZE, units=UNITS)


def _backward(reducer: GradientReducer, rank: int, backward: int, skip: Optional[int] = None) -> None:
    """Hand one backward's gradients to ``reducer`` in backward order, then end the round."""
    for j in reversed(range(len(NUMELS))):
        if j != skip:
            reducer.add_grad(j, grad(rank, j, backward))
    reducer.flush()
    reducer.wait()


def run_reducer(groups: ShardGroups, rank: int, with_sink: bool) -> dict[str, Any]:
    """Accumulate :data:`ROUNDS` backwards, then ``clear`` and one more with :data:`SKIPPED` missing."""
    layout = reducer_layout()
    shard_rank = collectives.rank(groups.shard)
    sink = HostGrads(layout.shard_size, torch.float32, torch.device("cpu"),
                     max(b.chunk_size for b in layout.buckets)) if with_sink else None
    reducer = GradientReducer(layout, shard_rank, torch.float32, torch.device("cpu"), 2, overlap=True, groups=groups,
                              sink=sink)
    groups.traffic.reset()
    for backward in range(ROUNDS):
        _backward(reducer, rank, backward)
    accumulated = reducer.finalize(force=False).clone()
    traffic = groups.traffic.snapshot()["scopes"]
    reducer.clear()
    _backward(reducer, rank, ROUNDS, skip=SKIPPED)
    return {"accumulated": accumulated, "traffic": traffic, "after_clear": reducer.finalize(force=False).clone(),
            "device_shard": reducer.grad_shard is not None}


def run_params(groups: ShardGroups) -> dict[str, Tensor]:
    """Gather every unit of :class:`ShardedParams` whose working shard is this rank's part of :func:`flat_values`."""
    layout = params_layout()
    shard_rank = collectives.rank(groups.shard)
    shard = shard_of(layout, flat_values(layout), shard_rank)
    params = [nn.Parameter(torch.zeros(n)) for n in NUMELS]
    storage = ShardedParams(layout, params, shard_rank, shard, group=groups.shard)
    gathered = {}
    for unit in sorted(set(UNITS)):
        storage.attach_views(unit)
        for work in storage.unshard(unit):
            collectives.wait(work, f"gather unit {unit}")
        gathered.update({j: params[j].detach().clone() for j in range(len(NUMELS)) if UNITS[j] == unit})
        storage.reshard(unit)
    return gathered


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    groups = make_shard_groups(SHARD_GROUP_SIZE)
    other = make_shard_groups(SHARD_GROUP_SIZE)  # a second engine's communication object, idle while `groups` talks
    result = {"rank": rank, "shard_rank": collectives.rank(groups.shard), "replicas": groups.replicas,
              "device": run_reducer(groups, rank, with_sink=False), "sink": run_reducer(groups, rank, with_sink=True),
              "params": run_params(groups)}
    result["other"] = {"traffic": other.traffic.snapshot()["scopes"],
                       "same_process_groups": (other.shard.process_group is groups.shard.process_group
                                               and other.replicate.process_group is groups.replicate.process_group)}
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
