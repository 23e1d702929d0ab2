"""ddp, zero1-3, FSDP2 and DeepSpeed side by side: the same GPT, data, seed, optimizer (AdamW) and process count.

    python -m benchmarks.compare --world-sizes 1 2 4 --sizes small medium --steps 10 --repeats 3 \\
        --out benchmarks/results/                          # tables, JSON and plot
    python -m benchmarks.compare --fit-budget 2GiB --world-sizes 2   # largest model each strategy fits
    python -m benchmarks.compare --world-sizes 2 --sizes medium --strategies ddp zero1 --profile
    python -m benchmarks.compare --world-sizes 2 --sizes medium --repeats 3 --steps 6 --warmup 2 \\
        --strategies ddp zero3 zero3:prefetch_size=0 zero3:overlap_comm=False zero3+OMP_NUM_THREADS=2   # A/B
    python -m benchmarks.speed_table          # the speed and memory table at 5M-85M against DDP and FSDP2 (~32 min)

Every (repeat, world size, size, strategy) is its own launch of N gloo ranks (``benchmarks._worker``, one process
per rank with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set, ``OMP_NUM_THREADS`` = cores // N), so each peak memory is
its own. The strategies of one repeat run back to back and the repeats rotate their order, so slow phases of a
shared machine spread over all strategies and show as the range of the repeats. FSDP2 and DeepSpeed are optional:
a peer that cannot run here is skipped with the reason. A strategy may be a variant,
``strategy[:option=value,...][+ENV=value,...]``: extra ``ZeroStrategy`` options (Python literals) and environment
variables for its launches only, for interleaved A/B runs of options on a shared machine (``+BENCH_ROOT=DIR``: the
ranks import the package and benchmarks from ``DIR``, a copy of another commit, for before/after runs). Outputs in
``--out``: ``compare.md``, ``compare.json``, ``compare.png`` (with matplotlib), ``profiles/`` (with ``--profile``).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent

from benchmarks import _report as report
from benchmarks._model import SIZES, GPTSize
from benchmarks._peers import missing
from benchmarks._probes import threads_per_rank

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp2", "deepspeed1", "deepspeed2", "deepspeed3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_variant(text: str) -> tuple[str, dict[str, Any], dict[str, str]]:
    """``zero3:prefetch_size=0+FOO=1`` to ``("zero3", {"prefetch_size": 0}, {"FOO": "1"})``."""
    head, _, env_text = text.partition("+")
    strategy, _, opt_text = head.partition(":")
    options = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in opt_text.split(",") if o)}
    env = dict(e.split("=", 1) for e in env_text.split(",") if e)
    return strategy, options, env


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` set, as it was again afterwards (the launched ranks inherit it)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _allocator_env() -> dict[str, str]:
    """``os.environ`` for a rank, as a user's run has it: no allocator setting of ours, for any strategy (a variant's
    ``+MALLOC_...=`` may add one to its own launches, for an A/B run)."""
    return dict(os.environ)


def run_config(cfg: dict[str, Any], world_size: int, timeout: float, keep: Optional[Path] = None) -> dict[str, Any]:
    """Launch one configuration on ``world_size`` ranks; one record (slowest rank's step times, highest peak)."""
    reason = missing(cfg["strategy"])
    if reason:
        return {"skipped": reason}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        port, threads = str(_free_port()), str(threads_per_rank(world_size))
        procs, logs = [], []
        for rank in range(world_size):
            env = dict(_allocator_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world_size),
                       RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS=threads,
                       PYTHONPATH=os.environ.get("BENCH_ROOT", str(ROOT)), PL_DISABLE_FORK="1",
                       DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cuda" if cfg.get("gpu") else "cpu"))
            logs.append(open(out / f"rank{rank}.log", "w"))
            cmd = [sys.executable, "-m", "benchmarks._worker", str(out), json.dumps(cfg)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, cwd=out))
        try:
            for p in procs:
                p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
        for log in logs:
            log.close()
        ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
        if keep is not None and (out / "profile.txt").exists():
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{cfg['strategy']}_n{world_size}.txt").write_text((out / "profile.txt").read_text())
        if len(ranks) < world_size or any("error" in r for r in ranks):
            errors = [r["error"] for r in ranks if "error" in r]
            tail = (out / "rank0.log").read_text().splitlines()[-15:]
            return {"error": errors[0] if errors else "a rank died or timed out: " + " / ".join(tail)}
    return _merge(ranks)


def _merge(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [max(times) for times in zip(*(r["step_times"] for r in ranks))]
    top = max(ranks, key=lambda r: r["peak_memory"] - r["baseline_memory"])
    zero = ranks[0]
    cpu = [max(c) for c in zip(*(r.get("step_cpu", []) for r in ranks))]
    faults = [max(f) for f in zip(*(r.get("step_faults", []) for r in ranks))]
    costs = [{key: max(c[key] for c in step) for key in step[0]} for step in zip(*(r.get("step_costs", []) for r in ranks))]
    return {"step_times": steps, "step_cpu": cpu, "step_faults": faults, "step_costs": costs,
            "peak_memory": max(r["peak_memory"] for r in ranks),
            "peak_growth": top["peak_memory"] - top["baseline_memory"],
            "model_states": zero["states"].get("model_states"), "states": zero["states"],
            "comm_bytes": zero["traffic"]["bytes"], "comm_calls": zero["traffic"]["calls"], "loss": zero["loss"],
            "params": zero["size"]["params"], "threads": zero["threads"],
            "cpu_seconds": [r.get("cpu_seconds") for r in ranks],
            "host_peak": max(r.get("host_peak", 0) for r in ranks),
            "disk_io": [r.get("disk_io") for r in ranks],
            **{k: top[k] for k in ("phases", "levels", "phase_seconds") if k in top},
            "accounts": [r["account"] for r in ranks if "account" in r]}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else float("nan")


def compare(args: argparse.Namespace, sizes: dict[str, GPTSize]) -> list[dict[str, Any]]:
    """Every (repeat, world size, size, strategy); strategies rotate their order from one repeat to the next."""
    records = []
    keep = Path(args.out) / "profiles" if args.profile else None
    for repeat in range(args.repeats):
        for world_size in args.world_sizes:
            for size_name, size in sizes.items():
                shift = repeat % len(args.strategies)
                for strategy in args.strategies[shift:] + args.strategies[:shift]:
                    name, options, env = parse_variant(strategy)
                    cfg = {"strategy": name, "size": size.__dict__, "steps": args.steps, "warmup": args.warmup,
                           "bucket": args.bucket, "gpu": args.gpu, "precision": args.precision,
                           "profile": args.profile, "options": options, "clip": args.clip,
                           "fused": args.fused, "compile": args.compile}
                    t0 = time.perf_counter()
                    with environment(env):
                        rec = run_config(cfg, world_size, args.timeout, keep)
                    rec.update(strategy=strategy, world_size=world_size, size_name=size_name, repeat=repeat,
                               params=size.num_params())
                    status = rec.get("skipped") or rec.get("error") or (
                        f"median step {_median(rec['step_times']) * 1e3:.0f} ms "
                        f"(CPU {_median(rec['step_cpu']) * 1e3:.0f} ms, "
                        f"{_median(rec['step_faults']):.0f} page faults), "
                        f"loss {rec['loss']:.6f}, collectives {rec['comm_calls']}")
                    print(f"[{repeat}] N={world_size} {size_name} {strategy}: {status} "
                          f"({time.perf_counter() - t0:.0f}s)", flush=True)
                    records.append(rec)
    return records


def fit(args: argparse.Namespace, budget: int) -> list[dict[str, Any]]:
    """Bisection on the width (multiples of 64, depth fixed): the largest GPT that trains one step in ``budget``."""
    world_size = args.world_sizes[0]
    results = []
    for strategy in args.strategies:
        name, options, env = parse_variant(strategy)
        reason = missing(name)
        if reason:
            results.append({"strategy": strategy, "error": reason})
            continue
        probes: dict[int, Optional[int]] = {}

        def fits(width: int) -> bool:
            size = GPTSize(width=width, depth=args.fit_depth, seq=args.fit_seq, batch=1)
            cfg = {"strategy": name, "size": size.__dict__, "steps": 1, "warmup": 0, "bucket": args.bucket,
                   "gpu": args.gpu, "precision": args.precision, "options": options}
            with environment(env):
                rec = run_config(cfg, world_size, args.timeout)
            probes[width] = None if "error" in rec else rec["peak_growth"]
            ok = probes[width] is not None and probes[width] <= budget
            print(f"fit {strategy} N={world_size} width {width}: {probes[width]} bytes -> {ok}", flush=True)
            return ok

        if args.fit_range:  # a known bracket: LO fits, HI does not (saves the doubling probes of large widths)
            lo, hi = args.fit_range
        else:
            lo, hi = 0, 64
            while fits(hi):
                lo, hi = hi, hi * 2
        while hi - lo > 64:
            mid = (lo + hi) // 128 * 64
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        size = GPTSize(width=lo, depth=args.fit_depth, seq=args.fit_seq, batch=1)
        results.append({"strategy": strategy, "width": lo, "params": size.num_params() if lo else 0,
                        "growth": probes.get(lo), "probes": len(probes)})
    return results


def parse_bytes(text: str) -> int:
    """``2GiB``, ``512MiB``, ``1.5GB`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 2GiB or 512MiB)")
    power = "_KMGT".index(match.group(2).upper() or "_")
    return int(float(match.group(1)) * (1024 if match.group(3) or power == 0 else 1000) ** power)


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return (f"{platform.node()}, {os.cpu_count()} CPU cores, {gpu or 'no GPU'}, torch {torch.__version__}, "
            f"python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M')}")


def arguments() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.compare`` (also what ``benchmarks.check_speed`` fills in)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sizes", nargs="+", default=["small", "medium"], choices=list(SIZES))
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES, metavar="STRATEGY",
                        help=f"{', '.join(STRATEGIES)}, or a variant: strategy[:option=value,...][+ENV=value,...]")
    parser.add_argument("--steps", type=int, default=10, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="launches of every configuration (interleaved)")
    parser.add_argument("--batch", type=int, help="sequences per rank per step (default: the size's)")
    parser.add_argument("--bucket", type=int, help="bucket elements for every strategy (default: each one's own)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--clip", type=float, help="gradient_clip_val of the Trainer (norm clipping; default: none)")
    parser.add_argument("--gpu", action="store_true", help="one CUDA device per rank (nccl)")
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True) (default: foreach)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block in configure_model")
    parser.add_argument("--profile", action="store_true", help="write rank 0's torch.profiler tables")
    parser.add_argument("--fit-budget", type=parse_bytes, help="bisection mode: bytes per rank, e.g. 2GiB")
    parser.add_argument("--fit-depth", type=int, default=4)
    parser.add_argument("--fit-seq", type=int, default=128)
    parser.add_argument("--fit-range", type=int, nargs=2, metavar=("LO", "HI"),
                        help="bisect between widths LO (known to fit) and HI (known not to) instead of doubling from 64")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    return parser


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    unknown = [s for s in args.strategies if parse_variant(s)[0] not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}: use {', '.join(STRATEGIES)}, optionally with :options or +ENV")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.fit_budget:
        fits = fit(args, args.fit_budget)
        text = report.fit_markdown(fits, args.fit_budget, args.world_sizes[0], args.fit_depth)
        (out / "fit.md").write_text(f"Machine: {machine()}\n\n{text}\n")
        report.write_json(out / "fit.json", {"machine": machine(), "budget": args.fit_budget, "fits": fits})
        print(text)
        return
    sizes = {name: SIZES[name] if args.batch is None else GPTSize(**{**SIZES[name].__dict__, "batch": args.batch})
             for name in args.sizes}
    records = compare(args, sizes)
    rows = report.summarize(records)
    text = report.markdown(rows, machine()) + "\n\nScaling:\n\n" + report.scaling_markdown(rows) + "\n"
    (out / "compare.md").write_text(text)
    report.write_json(out / "compare.json", {"machine": machine(), "args": vars(args), "rows": rows,
                                             "records": records})
    why_not = report.plot(rows, out / "compare.png")
    print(text + (f"\n{why_not}" if why_not else f"\nplot: {out / 'compare.png'}"))


if __name__ == "__main__":
    main()
