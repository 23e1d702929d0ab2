"""Pa on a plain PyTorch tensor-parallel block, 2 gloo ranks (no Lightning).

The block is Megatron's MLP: a column-parallel Linear (each rank half of the hidden units), GELU, a row-parallel
Linear and an all-reduce of the partial outputs. Its input is replicated on both ranks, which is the case Pa is for.
Four blocks are checkpointed with and without ``partition_group``; the worker saves the losses, the gradients and the
checkpoint bytes this rank kept, and the error a group of ranks with different inputs gets.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.comm.collectives import Group
from lightning_zero.comm.traffic import Traffic
from lightning_zero.activations.checkpointing import checkpoint_blocks, resolve_partition_group

WIDTH, HIDDEN, DEPTH = 16, 64, 4


class _CopyToParallel(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over the TP ranks (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _ReduceFromParallel(torch.autograd.Function):
    """All-reduce forward; identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ParallelMLP(nn.Module):
    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN // world)  # column-parallel: this rank's rows of the full weight
        self.down = nn.Linear(HIDDEN // world, WIDTH, bias=rank == 0)  # row-parallel: the bias added once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.up(_CopyToParallel.apply(self.norm(x))))
        return _ReduceFromParallel.apply(self.down(h))


class Net(nn.Module):
    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # norms identical on every rank
        self.blocks = nn.ModuleList(ParallelMLP(rank, world) for _ in range(DEPTH))
        torch.manual_seed(100 + rank)  # each rank its own shard of the parallel weights
        for block in self.blocks:
            block.up.reset_parameters()
            block.down.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def train(net: Net, x: torch.Tensor, group: Any, offload: bool = False) -> dict:
    traffic = Traffic()  # the partition group's collectives count here (a counted group, as an engine's are)
    counted = Group(group, "partition", traffic) if group is not None else None
    ac = checkpoint_blocks(net, offload=offload, partition_group=counted)
    loss = net(x).pow(2).mean()
    kept = ac.stats.live_bytes  # after forward: what this rank holds for the checkpoints
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in net.named_parameters()},
            "kept": kept, "full": ac.stats.peak_full_bytes, "stats": vars(ac.stats).copy(),
            "all_gathers": traffic.snapshot()["calls"].get("all_gather", 0)}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = Net(rank, world)
    x = torch.randn(6, 5, WIDTH, generator=torch.Generator().manual_seed(7))  # replicated input
    group = resolve_partition_group(list(range(world)))
    results = {
        "plain": train(copy.deepcopy(base), x, None),
        "partitioned": train(copy.deepcopy(base), x, group),
        "partitioned_offload": train(copy.deepcopy(base), x, group, offload=True),
    }
    try:  # data-parallel style: each rank a different input; Pa must refuse
        train(copy.deepcopy(base), x + rank, group)
        results["error"] = ""
    except RuntimeError as error:
        results["error"] = str(error)
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
