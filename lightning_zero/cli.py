"""The ``lightning-zero`` command (also ``python -m lightning_zero``): memory estimates and sharded checkpoints.

    lightning-zero estimate (--params 1.5B | --model pkg.MyModule [--init-args '{"width": 512}']) -n 8 [--memory 80GiB]
    lightning-zero inspect DIR [--verify] [--json]
    lightning-zero consolidate DIR OUT.ckpt [--weights-only] [--dtype fp32|bf16|fp16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

import yaml

from lightning_zero.checkpoint import CheckpointError
from lightning_zero.consolidate import DTYPES, consolidate, inspect_checkpoint
from lightning_zero.estimate import count_parameters, format_estimate, human_bytes, parse_bytes, parse_count


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-zero", description="ZeRO for PyTorch Lightning: memory "
                                     "estimates and checkpoint tools.")
    commands = parser.add_subparsers(dest="command", required=True)

    estimate = commands.add_parser("estimate", help="model-state bytes per rank under ddp/zero1/zero2/zero3, and "
                                   "the largest model each fits in a given memory")
    size = estimate.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=parse_count, help="a parameter count: 350M, 1.5B, 7e9")
    size.add_argument("--model", help="an importable class, e.g. mypkg.models.GPT (built on the meta device)")
    estimate.add_argument("--init-args", type=yaml.safe_load, default={},
                          help="the class's init arguments as a JSON/YAML mapping, e.g. '{width: 512, depth: 12}'")
    estimate.add_argument("-n", "--world-size", type=int, required=True, help="data-parallel ranks")
    estimate.add_argument("--memory", type=parse_bytes, help="memory per device, e.g. 80GiB, to find the largest "
                          "model each stage fits")
    estimate.set_defaults(run=_estimate)

    inspect = commands.add_parser("inspect", help="summarize a sharded checkpoint directory")
    inspect.add_argument("checkpoint", help="the checkpoint directory (what trainer.save_checkpoint wrote)")
    inspect.add_argument("--verify", action="store_true", help="also check every file against its CRC-32")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")
    inspect.set_defaults(run=_inspect)

    merge = commands.add_parser("consolidate", help="write a sharded checkpoint as one standard Lightning file")
    merge.add_argument("checkpoint", help="the checkpoint directory")
    merge.add_argument("output", help="the file to write, e.g. model.ckpt (loadable by MyModule.load_from_checkpoint)")
    merge.add_argument("--weights-only", action="store_true", help="leave out optimizer states and LR schedulers")
    merge.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                       help="convert floating-point weights (default: as saved, fp32 masters under mixed precision)")
    merge.set_defaults(run=_consolidate)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status (2 for a bad checkpoint, path or model, with the reason on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (CheckpointError, FileNotFoundError, ValueError) as error:
        print(f"lightning-zero {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


def _estimate(args: argparse.Namespace) -> None:
    if args.world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {args.world_size}.")
    if not isinstance(args.init_args, dict):
        raise ValueError(f"--init-args must be a mapping such as '{{width: 512}}', got {args.init_args!r}.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: classes of the project the command runs in
    params = args.params if args.params is not None else count_parameters(args.model, args.init_args)
    print(format_estimate(params, args.world_size, args.memory))


def _inspect(args: argparse.Namespace) -> None:
    summary = inspect_checkpoint(args.checkpoint, verify=args.verify)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(format_summary(summary))


def format_summary(summary: dict[str, Any]) -> str:
    """The text ``lightning-zero inspect`` prints."""
    per_rank = ", ".join(human_bytes(b) for b in summary["bytes_per_rank"])
    lines = [
        f"checkpoint   {summary['path']}",
        f"saved by     zero{summary['stage']} on {summary['world_size']} rank{'s' if summary['world_size'] != 1 else ''}"
        f", precision {summary['precision']}",
        f"progress     epoch {summary['epoch']}, global step {summary['global_step']}",
        f"parameters   {summary['num_parameters']:,} in {summary['model_tensors']} tensors",
        f"optimizers   {', '.join(summary['optimizers']) or 'none'}"
        + ("" if summary["has_optimizer_state"] else " (weights only: no optimizer state)"),
        f"bytes/rank   {per_rank}  (total {human_bytes(summary['total_bytes'])} with metadata)",
        "files        complete" + (", checksums verified" if summary["verified"] else " (sizes checked; --verify "
                                     "also checks the checksums)"),
    ]
    return "\n".join(lines)


def _consolidate(args: argparse.Namespace) -> None:
    out = consolidate(args.checkpoint, args.output, weights_only=args.weights_only,
                      dtype=DTYPES[args.dtype] if args.dtype else None)
    print(f"wrote {out} ({human_bytes(out.stat().st_size)})")


if __name__ == "__main__":
    sys.exit(main())
