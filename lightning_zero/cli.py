"""The ``lightning-zero`` command (also ``python -m lightning_zero``): training, memory estimates, checkpoints.

lightning-zero fit|validate|test|predict --config cfg.yaml [--model pkg.Module] [--data pkg.DataModule] ...
lightning-zero estimate (--params 1.5B | --model pkg.MyModule [--init-args '{"width": 512}']) -n 8 [--memory 80GiB]
lightning-zero estimate --measure --model pkg.MyModule [--init-args ...] -n 1024 [--stage 3] [--json]
lightning-zero inspect DIR [--verify] [--json] [--trust-code]
lightning-zero consolidate DIR OUT.ckpt [--weights-only] [--dtype fp32|bf16|fp16] [--trust-code]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Optional, Sequence

from lightning_zero.checkpoints.consolidate import DTYPES, FILE_FORMAT, consolidate, inspect_checkpoint
from lightning_zero.checkpoints.export import export_pretrained
from lightning_zero.checkpoints.storage import CheckpointError
from lightning_zero.estimate import (
    build_on_meta,
    format_estimate,
    format_measured,
    human_bytes,
    measure_model,
    parse_bytes,
    parse_count,
    parse_init_args,
)

#: ``--trust-code``: see [Note: a checkpoint is data, never code] in ``checkpoints/trust.py``.
TRUST_CODE_HELP = (
    "unpickle any type the checkpoint names, which can run code: only for a checkpoint from someone "
    "you trust (by default only tensors, numbers, strings and containers of them are read)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-zero",
        description="ZeRO for PyTorch Lightning: training, memory estimates and checkpoint tools.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name in LIGHTNING_COMMANDS:  # listed for --help; main() hands them to LightningCLI before parsing
        commands.add_parser(
            name,
            help=f"LightningCLI's `{name}` with the zero1/zero2/zero3 strategy names (`lightning-zero {name} --help`)",
            add_help=False,
        )

    estimate = commands.add_parser(
        "estimate",
        help="model-state bytes per rank under ddp/zero1/zero2/zero3, and "
        "the largest model each fits in a given memory",
    )
    size = estimate.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=_argument(parse_count), help="a parameter count: 350M, 1.5B, 7e9")
    size.add_argument("--model", help="an importable class, e.g. mypkg.models.GPT (built on the meta device)")
    estimate.add_argument(
        "--init-args",
        type=_argument(parse_init_args),
        default={},
        help="the class's init arguments as a JSON/YAML mapping, e.g. '{width: 512, depth: 12}'",
    )
    estimate.add_argument("-n", "--world-size", type=int, required=True, help="data-parallel ranks")
    estimate.add_argument(
        "--memory",
        type=_argument(parse_bytes),
        help="memory per device with its unit, e.g. 80GiB or 16GB, to find the largest model each stage fits",
    )
    _add_measure_arguments(estimate)
    estimate.set_defaults(run=_estimate)

    inspect = commands.add_parser("inspect", help="summarize a sharded checkpoint directory")
    inspect.add_argument("checkpoint", help="the checkpoint directory (what trainer.save_checkpoint wrote)")
    inspect.add_argument("--verify", action="store_true", help="also check every file against its CRC-32")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")
    inspect.add_argument("--trust-code", action="store_true", help=TRUST_CODE_HELP)
    inspect.set_defaults(run=_inspect)

    merge = commands.add_parser("consolidate", help="write a sharded checkpoint as one standard Lightning file")
    merge.add_argument("checkpoint", help="the checkpoint directory")
    merge.add_argument("output", help="the file to write, e.g. model.ckpt (loadable by MyModule.load_from_checkpoint)")
    merge.add_argument("--weights-only", action="store_true", help="leave out optimizer states and LR schedulers")
    merge.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="convert floating-point weights (default: as saved, fp32 masters under mixed precision)",
    )
    merge.add_argument("--trust-code", action="store_true", help=TRUST_CODE_HELP)
    merge.set_defaults(run=_consolidate)

    export = commands.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face save_pretrained directory "
        "(safetensors shards, config.json), a shard at a time",
    )
    _add_export_arguments(export)
    export.set_defaults(run=_export)
    return parser


def _add_measure_arguments(parser: argparse.ArgumentParser) -> None:
    """``estimate --measure`` and its options."""
    measure = parser.add_argument_group(
        "measure", "run rank 0 of the world in this process on torch's fake process group, through the Trainer"
    )
    measure.add_argument(
        "--measure",
        action="store_true",
        help="measure rank 0 (needs --model: a LightningModule with its own train_dataloader)",
    )
    measure.add_argument("--json", action="store_true", help="with --measure: print one JSON object")
    measure.add_argument("--steps", type=int, default=1, help="optimizer steps to run; the last is reported")
    measure.add_argument("--stage", type=int, choices=(1, 2, 3), default=3, help="the ZeRO stage (default 3)")
    measure.add_argument("--precision", default="bf16-mixed", help="the Trainer's precision (default bf16-mixed)")
    measure.add_argument("--offload-optimizer", action="store_true", help="offload_optimizer=True (host memory)")
    measure.add_argument("--offload-params", action="store_true", help="offload_params=True (host memory)")
    measure.add_argument("--tensor-parallel", type=int, default=1, help="tensor_parallel_size (a model with a plan)")
    measure.add_argument(
        "--devices-per-node", type=int, help="devices of one node (default 8 where it divides -n, else -n)"
    )


def _argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type whose ``ValueError`` message is what the user sees (argparse would otherwise
    print only ``invalid parse_count value``, the name of a function of ours)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__
    return convert


#: Subcommands handed to Lightning's own ``LightningCLI``.
LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status (2 for a bad checkpoint, path or model, with the reason on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in LIGHTNING_COMMANDS:
        run_lightning_cli(argv)
        return 0
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (CheckpointError, FileNotFoundError, ValueError) as error:
        print(f"lightning-zero {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


def run_lightning_cli(argv: Sequence[str]) -> None:
    """``LightningCLI`` with the ZeRO strategy names registered, for any ``LightningModule`` and data module.

    [Note: no script to edit]
    This is the ``main.py`` of Lightning's CLI documentation, ``LightningCLI()`` with the model and the data given by
    ``class_path`` (``--model pkg.GPT`` or ``model: {class_path: ...}`` in the YAML file), plus ``import
    lightning_zero``, so ``trainer.strategy: zero3`` works without touching the user's code. The launcher starts the
    other ranks by running the same command line again, so they import the strategy names too. The current directory
    is importable, as under ``python -m``.
    """
    from lightning_zero.lightning.cli import expand_short_strategy, zero_cli  # Lightning's CLI only when asked for

    _import_from_cwd()
    zero_cli()(args=expand_short_strategy(argv), subclass_mode_model=True, subclass_mode_data=True)


def _import_from_cwd() -> None:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: classes of the project the command runs in


def _estimate(args: argparse.Namespace) -> None:
    if args.world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {args.world_size}.")
    _import_from_cwd()
    if args.measure:
        _measure(args)
        return
    module = build_on_meta(args.model, args.init_args) if args.params is None else None
    params = args.params if module is None else sum(p.numel() for p in module.parameters() if p.requires_grad)
    print(format_estimate(params, args.world_size, args.memory, module))


def _measure(args: argparse.Namespace) -> None:
    """``estimate --measure``: rank 0 of the world, measured here (see ``lightning/simulated.py``)."""
    if args.model is None:
        raise ValueError("--measure needs --model pkg.module.Class (a LightningModule), not --params.")
    options: dict[str, Any] = {}
    if args.offload_optimizer:
        options["offload_optimizer"] = True
    if args.offload_params:
        options["offload_params"] = True
    if args.tensor_parallel != 1:
        options["tensor_parallel_size"] = args.tensor_parallel
    result = measure_model(
        args.model,
        args.init_args,
        args.world_size,
        stage=args.stage,
        precision=args.precision,
        steps=args.steps,
        devices_per_node=args.devices_per_node,
        **options,
    )
    print(json.dumps(result.as_dict(), indent=2) if args.json else format_measured(result))


def _inspect(args: argparse.Namespace) -> None:
    summary = inspect_checkpoint(args.checkpoint, verify=args.verify, trust_code=args.trust_code)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(format_summary(summary))


def format_summary(summary: dict[str, Any]) -> str:
    """The text ``lightning-zero inspect`` prints."""
    if summary["format"] == FILE_FORMAT:
        return _format_file_summary(summary)
    per_rank = ", ".join(human_bytes(b) for b in summary["bytes_per_rank"])
    lines = [
        f"checkpoint   {summary['path']}",
        f"saved by     zero{summary['stage']} on {summary['world_size']} "
        f"rank{'s' if summary['world_size'] != 1 else ''}{_mesh(summary)}, precision {summary['precision']}",
        f"progress     {_progress(summary)}",
        f"parameters   {summary['num_parameters']:,} in {summary['model_tensors']} tensors",
        f"optimizers   {', '.join(summary['optimizers']) or 'none'}"
        + ("" if summary["has_optimizer_state"] else " (weights only: no optimizer state)"),
        f"bytes/rank   {per_rank}  (total {human_bytes(summary['total_bytes'])} with metadata)",
        "files        complete"
        + (", checksums verified" if summary["verified"] else " (sizes checked; --verify also checks the checksums)"),
    ]
    return "\n".join(lines)


def _format_file_summary(summary: dict[str, Any]) -> str:
    optimizers = summary["optimizers"]
    return "\n".join(
        [
            f"checkpoint   {summary['path']}",
            "saved as     one file in ddp's form (consolidated, or by ddp or state_dict_type='full'): every strategy "
            "resumes it",
            f"progress     {_progress(summary)}",
            f"parameters   {summary['num_parameters']:,} in {summary['model_tensors']} tensors",
            f"optimizers   {optimizers} optimizer state{'s' if optimizers != 1 else ''}"
            if optimizers
            else "optimizers   none (weights only)",
            f"bytes        {human_bytes(summary['total_bytes'])}",
            "files        read whole by torch.load (a single file carries no checksums)",
        ]
    )


def _progress(summary: dict[str, Any]) -> str:
    """The Trainer's epoch and global step; a checkpoint without them (Fabric's, a plain loop's) shows the numbers
    saved beside the models instead (``step 7``)."""
    if summary["epoch"] is not None or summary["global_step"] is not None:
        return f"epoch {summary['epoch']}, global step {summary['global_step']}"
    entries = summary.get("entries") or {}
    if not entries:
        return "not recorded (no epoch or global step, and no number saved beside the models)"
    shown = ", ".join(f"{key} {value}" for key, value in entries.items())
    return f"{shown} (saved beside the models; no Trainer epoch or global step)"


def _mesh(summary: dict[str, Any]) -> str:
    """`` (d data x t tensor)`` for a tensor-parallel checkpoint, else nothing."""
    t = summary.get("tensor_parallel_size", 1)
    return f" ({summary['world_size'] // t} data x {t} tensor parallel)" if t > 1 else ""


def _consolidate(args: argparse.Namespace) -> None:
    out = consolidate(
        args.checkpoint,
        args.output,
        weights_only=args.weights_only,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        trust_code=args.trust_code,
    )
    print(f"wrote {out} ({human_bytes(out.stat().st_size)})")


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``lightning-zero export``."""
    parser.add_argument("checkpoint", help="a sharded checkpoint directory, or a file from `consolidate`")
    parser.add_argument("output", help="the directory to write (from_pretrained(OUTPUT) loads it)")
    parser.add_argument(
        "--submodule",
        help="the LightningModule's attribute to export when it holds several "
        "pretrained models (e.g. `lm` for self.lm)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="the most bytes per weight file: 5GB (10^9), 5GiB (2^30), 500MB (default: 5GB)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="convert floating-point weights (default: as saved, fp32 masters under mixed precision)",
    )
    parser.add_argument(
        "--config",
        help="a save_pretrained directory or Hub name whose config.json to write, for a checkpoint that records none",
    )


def _export(args: argparse.Namespace) -> None:
    """``lightning-zero export``: write the directory, print what was written."""
    result = export_pretrained(
        args.checkpoint,
        args.output,
        submodule=args.submodule,
        max_shard_size=args.max_shard_size,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        config=args.config,
        require_config=True,
    )
    what = f"the attribute {result.submodule!r}" if result.submodule else "the model"
    print(
        f"wrote {what} to {result.directory}: {result.num_tensors} tensors, {result.total_size:,} bytes in "
        f"{len(result.files)} file{'s' if len(result.files) != 1 else ''}, config.json"
    )


if __name__ == "__main__":
    sys.exit(main())
