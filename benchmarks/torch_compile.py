"""Step time of a GPT compiled with torch.compile against eager, under ddp and each ZeRO stage (CPU, gloo).

    python -m benchmarks.torch_compile                          # 2 ranks, inductor, width 256, depth 4
    python -m benchmarks.torch_compile --backend aot_eager --steps 6 --strategies zero3

For each strategy, one launch of ``--world-size`` ranks builds three copies of the same model (same seed): eager,
``per-block`` (``model.blocks[i] = torch.compile(block)``, what a LightningModule does in ``configure_model``) and
``whole`` (``model.forward = torch.compile(model.forward)``), sets each up (``DistributedDataParallel`` for ddp,
:class:`lightning_zero.ZeroEngine` otherwise) and trains them on the same batches, one step of each in turn, so that
load from other processes slows all three alike. The first ``--warmup`` steps (compilation) are not timed; the table
gives the median of the timed steps (slowest rank), the ratio compiled / eager, the graphs dynamo compiled during
warm-up and during the timed steps (0 there: no recompilation), and the largest relative loss difference to eager.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

VARIANTS = ("eager", "per-block", "whole")


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(attn)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.ModuleList(Block(width, heads=max(1, width // 64)) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _make(variant: str, args: argparse.Namespace) -> tuple[nn.Module, Any]:
    """The model of ``variant``, compiled as asked and set up for ``args.strategy``; returns it and a step fn."""
    from lightning_zero import ZeroEngine

    torch.manual_seed(0)
    model = GPT(args.vocab, args.width, args.depth, args.seq)
    if variant == "per-block":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=args.backend)
    elif variant == "whole":
        model.forward = torch.compile(model.forward, backend=args.backend)
    if args.strategy == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def ddp_step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = F.cross_entropy(wrapped(x).flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.item()

        return model, ddp_step
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [optimizer], stage=int(args.strategy[-1]))

    def zero_step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        return loss.item()

    return model, zero_step


def _rank(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    steps = {v: _make(v, args)[1] for v in VARIANTS}
    g = torch.Generator().manual_seed(1 + rank)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    losses: dict[str, list[float]] = {v: [] for v in VARIANTS}
    graphs: dict[str, list[int]] = {v: [0, 0] for v in VARIANTS}
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        for v in VARIANTS:
            dist.barrier()
            before, t0 = _graphs(), time.perf_counter()
            losses[v].append(steps[v](x[:, :-1], x[:, 1:]))
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
            graphs[v][i >= args.warmup] += _graphs() - before
            if i >= args.warmup:
                times[v].append(elapsed.item())
    if rank == 0:
        torch.save({"times": times, "losses": losses, "graphs": graphs}, out)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.pt")
        mp.start_processes(_rank, args=(args, port, out), nprocs=args.world_size, start_method="spawn")
        return torch.load(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["ddp", "zero1", "zero2", "zero3"])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    params = sum(p.numel() for p in GPT(args.vocab, args.width, args.depth, args.seq).parameters())
    print(f"GPT {params / 1e6:.2f}M parameters (width {args.width}, depth {args.depth}), batch {args.batch} x "
          f"{args.seq} tokens per rank, {args.world_size} ranks x {args.threads} thread(s), backend {args.backend}, "
          f"median of {args.steps} steps after {args.warmup} warm-up steps\n")
    print("| strategy | compiled | step (ms) | vs eager | graphs compiled in warm-up / timed steps | "
          "max loss diff vs eager |")
    print("|---|---|---|---|---|---|")
    for strategy in args.strategies:
        args.strategy = strategy
        result = run(args)
        eager = statistics.median(result["times"]["eager"])
        for v in VARIANTS:
            median = statistics.median(result["times"][v])
            diff = max(abs(a - e) / abs(e) for a, e in zip(result["losses"][v], result["losses"]["eager"]))
            warm, timed = result["graphs"][v]
            print(f"| {strategy} | {v} | {median * 1e3:.1f} | {median / eager:.2f}x | {warm} / {timed} | "
                  f"{diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
