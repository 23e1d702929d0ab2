"""ZeRO-Offload measured: the CPU optimizer step against the memory-bandwidth bound, and whole training steps with and
without ``offload_optimizer`` (and, under zero3, ``offload_params``) for a GPT of a chosen size.

    python -m benchmarks.offload --params 25M --threads 1                 # the CPU step alone
    python -m benchmarks.offload --sizes small --strategies zero2 zero3   # + training steps, 2 CPU ranks
    python -m benchmarks.offload --sizes medium --gpu --world-size 1      # on a GPU: the device step vs offloaded

[Note: the bound of the CPU step]
AdamW reads the weight, the gradient and the two moments and writes the weight and the moments back: 7 fp32 values,
28 bytes per parameter per step. No implementation can step faster than 28Ψ bytes divided by the memory bandwidth
the cores reach, which is measured here as an in-place triad (``a += s·b``: 12 bytes per element, read, read, write
back in place, as Adam updates its tensors; an out-of-place ``c = a + s·b`` also reads ``c`` before writing it and
understates the bandwidth by a third) over arrays of the size of the step's. ``efficiency`` is the share of that
bandwidth the step reaches (its 28Ψ bytes per second). The optimizer sees flat tensors of at most one bucket (4M
elements), as ZeRO hands them over; torch's CPU default for AdamW is the single-tensor loop (``foreach=None`` picks
foreach only for device tensors). DeepSpeed's ``DeepSpeedCPUAdam`` is measured when DeepSpeed is installed, and
reported as missing otherwise. Use sizes well above the last-level cache (at 10M parameters on a 32 MiB L3 the
fused step appeared faster than the bound).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Optional

import torch


from benchmarks.compare import run_config
from benchmarks._model import SIZES
from lightning_zero.estimate import human_bytes, parse_count

ADAM_BYTES = 28
PIECE = 4_000_000  # elements per tensor the optimizer sees (the largest default bucket)


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: states are created, pages touched
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def triad_bandwidth(numel: int, repeats: int) -> float:
    """Bytes per second of ``a += 0.5 b`` over ``numel`` fp32 elements (two reads, one write in place)."""
    a, b = torch.rand(numel), torch.rand(numel)
    seconds = _median_seconds(lambda: a.add_(b, alpha=0.5), repeats)
    return 12 * numel / seconds


def _pieces(numel: int) -> list[torch.Tensor]:
    return [torch.zeros(min(PIECE, numel - start)) for start in range(0, numel, PIECE)]


def adam_variants() -> dict[str, Callable[[list[torch.Tensor]], Any]]:
    """Name to optimizer maker (lr and decay as a GPT run would use them)."""
    variants: dict[str, Callable[[list[torch.Tensor]], Any]] = {
        "AdamW (torch default on CPU)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
        "AdamW foreach=True": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True),
        "AdamW fused=True": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]

        variants["DeepSpeedCPUAdam"] = lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.1, adamw_mode=True)
    except Exception:  # noqa: BLE001 - not installed or its extension does not build here
        pass
    return variants


def cpu_step(numel: int, repeats: int) -> list[dict[str, Any]]:
    """One row per AdamW implementation: seconds per step, ns per parameter, bytes per second, share of the bound."""
    bandwidth = triad_bandwidth(numel, repeats)
    rows = [{"name": "memory bound (triad bandwidth)", "seconds": ADAM_BYTES * numel / bandwidth,
             "bandwidth": bandwidth}]
    for name, make in adam_variants().items():
        params = _pieces(numel)
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        optimizer = make(params)
        seconds = _median_seconds(optimizer.step, repeats)
        rows.append({"name": name, "seconds": seconds, "bandwidth": ADAM_BYTES * numel / seconds})
        del optimizer, params
    for row in rows:
        row["ns_per_param"] = row["seconds"] / numel * 1e9
        row["efficiency"] = row["bandwidth"] / bandwidth
    return rows


#: What each training row offloads: ``(label, ZeroStrategy options)``; ``params`` rows run under zero3 only.
OFFLOADS = (("no", {}), ("optimizer", {"offload_optimizer": True}),
            ("params", {"offload_params": True}), ("both", {"offload_optimizer": True, "offload_params": True}))


def training_steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Whole steps of the benchmark GPT without offload, with ``offload_optimizer``, and under zero3 with
    ``offload_params`` alone and with both (benchmarks/_worker.py's probes). Runs that offload the optimizer step with
    fused AdamW (what the strategy recommends), the others with the foreach kernels. With ``--deepspeed``, DeepSpeed's
    ZeRO-Offload at the same stage (its ``DeepSpeedCPUAdam``) runs beside each."""
    rows = []
    for size in args.sizes:
        for strategy in args.strategies:
            runs = [(strategy, offload, options) for offload, options in OFFLOADS
                    if "offload_params" not in options or strategy == "zero3"]
            if args.deepspeed:
                runs.append((f"deepspeed{strategy[-1]}", "optimizer", {"offload_optimizer": True}))
            for name, offload, options in runs:
                cfg = {"strategy": name, "size": SIZES[size].__dict__, "steps": args.steps, "warmup": args.warmup,
                       "bucket": None, "gpu": args.gpu, "precision": args.precision,
                       "fused": bool(options.get("offload_optimizer")), "options": options}
                record = run_config(cfg, args.world_size, timeout=args.timeout)
                rows.append({"size": size, "strategy": name, "offload": offload, **record})
    return rows


def _table_cpu(rows: list[dict[str, Any]], numel: int, threads: int) -> str:
    lines = [f"CPU optimizer step, {numel:,} fp32 parameters in {PIECE:,}-element tensors, {threads} thread(s); "
             f"AdamW moves {ADAM_BYTES} bytes per parameter:", "",
             "| implementation | step | ns / parameter | bytes/s (28 B/param) | share of bandwidth |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['seconds'] * 1e3:.1f} ms | {r['ns_per_param']:.2f} | "
                     f"{r['bandwidth'] / 1e9:.2f} GB/s | {r['efficiency']:.0%} |")
    if not any(r["name"] == "DeepSpeedCPUAdam" for r in rows):
        lines.append("(DeepSpeedCPUAdam: not measured, DeepSpeed is not installed here)")
    return "\n".join(lines)


def _table_steps(rows: list[dict[str, Any]], world_size: int) -> str:
    lines = ["", f"Training steps on {world_size} rank(s) (median over the measured steps; model states per rank):", "",
             "| size | Ψ | strategy | offload | step | device model states | host model states |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['size']} | | {r['strategy']} | {r['offload']} | {r.get('error') or r['skipped']} | | |")
            continue
        states = r["states"]
        device = states.get("device_model_states", states.get("model_states", 0))
        lines.append(f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['strategy']} | {r['offload']} | "
                     f"{statistics.median(r['step_times']) * 1e3:.0f} ms | {human_bytes(device)} | "
                     f"{human_bytes(states.get('host', 0))} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=parse_count, default=parse_count("25M"), help="parameters of the CPU step")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of the step (default: torch's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", nargs="*", default=[], choices=list(SIZES), help="GPT sizes to train (none: "
                        "the CPU step only)")
    parser.add_argument("--strategies", nargs="+", default=["zero2", "zero3"], choices=["zero1", "zero2", "zero3"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--gpu", action="store_true", help="train on CUDA devices (the offloaded step on the host)")
    parser.add_argument("--deepspeed", action="store_true", help="also DeepSpeed's ZeRO-Offload at each stage")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(_table_cpu(cpu_step(args.params, args.repeats), args.params, torch.get_num_threads()), flush=True)
    if args.sizes:
        print(_table_steps(training_steps(args), args.world_size))


if __name__ == "__main__":
    main()
