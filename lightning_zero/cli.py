"""The ``lightning-zero`` command (also ``python -m lightning_zero``): work with sharded checkpoints.

    lightning-zero inspect DIR [--verify] [--json]
    lightning-zero consolidate DIR OUT.ckpt [--weights-only] [--dtype fp32|bf16|fp16]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

from lightning_zero.checkpoint import CheckpointError
from lightning_zero.consolidate import DTYPES, consolidate, inspect_checkpoint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-zero", description="ZeRO for PyTorch Lightning: checkpoint tools.")
    commands = parser.add_subparsers(dest="command", required=True)

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
    """Entry point; returns the exit status (2 for a bad checkpoint or path, with the reason on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (CheckpointError, FileNotFoundError) as error:
        print(f"lightning-zero {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


def _inspect(args: argparse.Namespace) -> None:
    summary = inspect_checkpoint(args.checkpoint, verify=args.verify)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(format_summary(summary))


def format_summary(summary: dict[str, Any]) -> str:
    """The text ``lightning-zero inspect`` prints."""
    per_rank = ", ".join(_bytes(b) for b in summary["bytes_per_rank"])
    lines = [
        f"checkpoint   {summary['path']}",
        f"saved by     zero{summary['stage']} on {summary['world_size']} rank{'s' if summary['world_size'] != 1 else ''}"
        f", precision {summary['precision']}",
        f"progress     epoch {summary['epoch']}, global step {summary['global_step']}",
        f"parameters   {summary['num_parameters']:,} in {summary['model_tensors']} tensors",
        f"optimizers   {', '.join(summary['optimizers']) or 'none'}"
        + ("" if summary["has_optimizer_state"] else " (weights only: no optimizer state)"),
        f"bytes/rank   {per_rank}  (total {_bytes(summary['total_bytes'])} with metadata)",
        "files        complete" + (", checksums verified" if summary["verified"] else " (sizes checked; --verify "
                                     "also checks the checksums)"),
    ]
    return "\n".join(lines)


def _consolidate(args: argparse.Namespace) -> None:
    out = consolidate(args.checkpoint, args.output, weights_only=args.weights_only,
                      dtype=DTYPES[args.dtype] if args.dtype else None)
    print(f"wrote {out} ({_bytes(out.stat().st_size)})")


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


if __name__ == "__main__":
    sys.exit(main())
