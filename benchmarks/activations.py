"""Activation memory and step time with and without activation checkpointing (ZeRO-R), one process.

    python -m benchmarks.activations                      # 12-layer GPT, width 192, batch 8 x 128 tokens, CPU
    python -m benchmarks.activations --depth 24 --width 256 --device cuda

Every configuration runs in its own subprocess (so its peak resident memory is its own), trains the same GPT-style
model (examples/gpt.py's ``GPT``, dropout 0.1, untied head) with AdamW for a few steps through
``lightning_zero.activations.checkpointing.checkpoint_blocks`` (the code path ``ZeroStrategy(activation_checkpointing=...)`` uses)
and reports:

- activations held at the end of forward: the bytes autograd saved outside checkpointed blocks (each storage once,
  parameters excluded) plus the bytes the checkpoint store holds;
- peak RSS growth: the process's peak resident memory during the measured steps above its level after a warm-up step
  (weights, gradients and Adam states already allocated), with glibc returning freed blocks to the OS;
- on CUDA, ``torch.cuda.max_memory_allocated`` above the same baseline, and reserved minus allocated at that peak;
- step time: one more process runs every configuration one step at a time in turn and keeps the fastest step of
  each, wall-clock and CPU time (on a shared machine, other processes slow every configuration alike).
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
    """The project's GPT (examples/gpt.py) with dropout 0.1 and an untied head, used as a plain module."""
    from examples.gpt import GPT

    return GPT(n_layer=args.depth, n_head=args.heads, n_embd=args.width, context=args.seq, dropout=0.1,
               vocab_size=args.vocab, tied=False, gpt2_init=False)


class _Run:
    """The model, optimizer and data of one measurement, and one training step that reports what forward held."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        torch.manual_seed(0)
        self.args = args
        self.device = torch.device(args.device)
        self.model = _model(args).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
        self.tokens = tokens.to(self.device)

    def step(self, store: Any) -> tuple[int, float]:
        """One step; returns the bytes held at the end of forward and the forward's CPU time."""
        import torch
        import torch.nn.functional as F

        saved, seen = [0], set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.params and ptr not in seen:
                seen.add(ptr)
                saved[0] += t.untyped_storage().nbytes()
            return t

        start = time.process_time()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = self.model(self.tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, self.args.vocab), self.tokens[:, 1:].reshape(-1))
        held = saved[0] + (store.stats.live_bytes if store is not None else 0)
        forward = time.process_time() - start
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return held, forward


def memory(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    """One configuration in its own process: warm up, then the memory of ``args.steps`` steps."""
    import torch

    from lightning_zero.activations.checkpointing import checkpoint_blocks

    run = _Run(args)
    store = checkpoint_blocks(run.model, **options).store if options else None
    cuda = run.device.type == "cuda"
    run.step(store)  # warm-up: gradients and optimizer states exist from now on
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base_cuda = torch.cuda.memory_allocated() if cuda else 0
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident size to the current one
    base_rss = _status("VmRSS")
    held = max(run.step(store)[0] for _ in range(args.steps))
    result = {"held": held, "rss_growth": _status("VmHWM") - base_rss,
              "checkpoint_bytes": store.stats.peak_bytes if store is not None else 0}
    if cuda:
        result["cuda_peak"] = torch.cuda.max_memory_allocated() - base_cuda
        result["fragmentation"] = torch.cuda.max_memory_reserved() - torch.cuda.max_memory_allocated()
    return result


def timing(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Every configuration in one process, one step each in turn, ``args.rounds`` times: whatever else runs on the
    machine slows all of them alike. The fastest step of each, wall-clock and CPU time, and its forward's CPU time."""
    from lightning_zero.activations.checkpointing import ActivationCheckpointing, ActivationStore
    from lightning_zero.activations.blocks import find_blocks

    run = _Run(args)
    stores = {name: ActivationStore(o.get("offload", False), None, o.get("contiguous", False)) if o else None
              for name, o in CONFIGS.items()}
    best: dict[str, dict[str, float]] = {name: {"time": 1e9, "cpu": 1e9, "forward": 1e9} for name in CONFIGS}
    for round_ in range(args.rounds + 1):
        for name, store in stores.items():
            wrapped = ActivationCheckpointing(find_blocks(run.model), store) if store is not None else None
            start, cpu = time.perf_counter(), time.process_time()
            _, forward = run.step(store)
            times = {"time": time.perf_counter() - start, "cpu": time.process_time() - cpu, "forward": forward}
            if wrapped is not None:
                wrapped.remove()
            if round_:  # the first round warms up (optimizer states, the contiguous buffer)
                best[name] = {k: min(v, times[k]) for k, v in best[name].items()}
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="steps measured for memory")
    parser.add_argument("--rounds", type=int, default=6, help="steps of each configuration timed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(timing(args) if args.worker == "timing" else memory(args, CONFIGS[args.worker])))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=str(ROOT))
    results = {}
    for name in list(CONFIGS) + ["timing"]:
        cmd = [sys.executable, "-m", "benchmarks.activations", "--worker", name] + sys.argv[1:]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=True).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    rows = {name: {**results[name], **results["timing"][name]} for name in CONFIGS}
    _print_table(args, rows)


def _print_table(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    mib = 2**20
    none = rows["none"]
    cuda = "cuda_peak" in none
    print(f"{args.depth} layers, width {args.width}, batch {args.batch} x {args.seq} tokens, {args.device}, "
          f"{args.threads} thread(s); memory: {args.steps} steps after a warm-up, time: fastest of {args.rounds} "
          "interleaved steps\n")
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
          f"layer = {(ckpt['checkpoint_bytes'] + per_layer) / mib:.1f} MiB (+ what lives outside the blocks). "
          f"Expected CPU time: none + one more forward = {(none['cpu'] + none['forward']) / none['cpu']:.2f}x "
          "(1.33x if backward took exactly twice the forward and nothing ran outside forward and backward).")


if __name__ == "__main__":
    main()
