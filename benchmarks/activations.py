"""Activation memory and step time with and without activation checkpointing (ZeRO-R), one process.

    python benchmarks/activations.py                      # 12-layer GPT, width 192, batch 8 x 128 tokens, CPU
    python benchmarks/activations.py --depth 24 --width 256 --device cuda

Every configuration runs in its own subprocess (so its peak resident memory is its own), trains the same GPT-style
model (tests/models.py's pre-norm ``Block``, untied head) with AdamW for a few steps through
``lightning_zero.activations.checkpoint_blocks`` (the code path ``ZeroStrategy(activation_checkpointing=...)`` uses)
and reports:

- activations held at the end of forward: the bytes autograd saved outside checkpointed blocks (each storage once,
  parameters excluded) plus the bytes the checkpoint store holds;
- peak RSS growth: the process's peak resident memory during the measured steps above its level after a warm-up step
  (weights, gradients and Adam states already allocated), with glibc returning freed blocks to the OS;
- on CUDA, ``torch.cuda.max_memory_allocated`` above the same baseline, and reserved minus allocated at that peak;
- the fastest step, wall-clock and CPU time of the process (on CPU with one thread, CPU time is the cost of the
  computation even when other processes share the cores; wall-clock time is not).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "none": {},
    "checkpointing": {"blocks": True},
    "checkpointing + offload": {"blocks": True, "offload": True},
    "checkpointing + contiguous": {"blocks": True, "contiguous": True},
}


def _status(field: str) -> int:
    """A ``kB`` field of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _model(args: argparse.Namespace) -> Any:
    import torch
    from torch import nn

    from tests.models import Block

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(args.vocab, args.width)
            self.pos = nn.Parameter(torch.zeros(args.seq, args.width))
            self.blocks = nn.ModuleList(Block(args.width, heads=args.heads, dropout=0.1) for _ in range(args.depth))
            self.ln_f = nn.LayerNorm(args.width)
            self.head = nn.Linear(args.width, args.vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.wte(tokens) + self.pos
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    return GPT()


def worker(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    """One configuration: warm up, then measure ``args.steps`` steps."""
    import torch
    import torch.nn.functional as F

    from lightning_zero.activations import checkpoint_blocks

    torch.manual_seed(0)
    device = torch.device(args.device)
    model = _model(args).to(device)
    store = checkpoint_blocks(model, **options).store if options else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    cuda = device.type == "cuda"

    forward_cpu = [0.0]

    def step() -> int:
        saved, seen = [0], set()
        start = time.process_time()

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in seen:
                seen.add(ptr)
                saved[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        held = saved[0] + (store.stats.live_bytes if store is not None else 0)
        forward_cpu[0] = time.process_time() - start
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return held

    step()  # warm-up: gradients and optimizer states exist from now on
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base_cuda = torch.cuda.memory_allocated() if cuda else 0
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident size to the current one
    base_rss = _status("VmRSS")
    times, cpu_times, forward_times, held = [], [], [], 0
    for _ in range(args.steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        held = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        forward_times.append(forward_cpu[0])
    # the fastest step: on a shared machine the others are slowed by other people's work, not by checkpointing
    result = {"held": held, "rss_growth": _status("VmHWM") - base_rss, "time": min(times), "cpu": min(cpu_times),
              "forward": min(forward_times),
              "checkpoint_bytes": store.stats.peak_bytes if store is not None else 0}
    if cuda:
        result["cuda_peak"] = torch.cuda.max_memory_allocated() - base_cuda
        result["fragmentation"] = torch.cuda.max_memory_reserved() - torch.cuda.max_memory_allocated()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(worker(args, CONFIGS[args.worker])))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=str(ROOT))
    rows = {}
    for name in CONFIGS:
        cmd = [sys.executable, __file__, "--worker", name] + [a for a in sys.argv[1:]]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=True).stdout
        rows[name] = json.loads(out.strip().splitlines()[-1])
    _print_table(args, rows)


def _print_table(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    mib = 2**20
    none = rows["none"]
    cuda = "cuda_peak" in none
    print(f"{args.depth} layers, width {args.width}, batch {args.batch} x {args.seq} tokens, {args.device}, "
          f"{args.threads} thread(s), fastest of {args.steps} steps\n")
    head = "| configuration | activations held after forward (MiB) | of which checkpoints | peak RSS growth (MiB) |"
    head += " peak CUDA allocated (MiB) | reserved - allocated (MiB) |" if cuda else ""
    head += " step time (s) | CPU time / step (s) | of which forward (s) | CPU time vs none |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for name, row in rows.items():
        line = (f"| {name} | {row['held'] / mib:.1f} | {row['checkpoint_bytes'] / mib:.1f} | "
                f"{row['rss_growth'] / mib:.0f} |")
        if cuda:
            line += f" {row['cuda_peak'] / mib:.0f} | {row['fragmentation'] / mib:.0f} |"
        print(line + f" {row['time']:.3f} | {row['cpu']:.3f} | {row['forward']:.3f} | {row['cpu'] / none['cpu']:.2f}x |")
    ckpt = rows["checkpointing"]
    per_layer = (none["held"] - (ckpt["held"] - ckpt["checkpoint_bytes"])) / args.depth
    print(f"\nOne layer's activations: {per_layer / mib:.1f} MiB; expected checkpointed peak ~ checkpoints + one "
          f"layer = {(ckpt['checkpoint_bytes'] + per_layer) / mib:.1f} MiB (+ what lives outside the blocks); "
          f"expected step time ~ 1.33x.")


if __name__ == "__main__":
    main()
