"""The ``lightning-zero`` command (also ``python -m lightning_zero``): training, memory estimates, checkpoints.

    lightning-zero fit|validate|test|predict --config cfg.yaml [--model pkg.Module] [--data pkg.DataModule] ...
    lightning-zero estimate (--params 1.5B | --model pkg.MyModule [--init-args '{"width": 512}']) -n 8 [--memory 80GiB]
    lightning-zero inspect DIR [--verify] [--json] [--trust-code]
    lightning-zero consolidate DIR OUT.ckpt [--weights-only] [--dtype fp32|bf16|fp16] [--trust-code]
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Sequence


from lightning_zero.checkpoints.storage import CheckpointError, missing_message
from lightning_zero.checkpoints.export import add_export_arguments, run_export
from lightning_zero.checkpoints.consolidate import DTYPES, FILE_FORMAT, consolidate, inspect_checkpoint
from lightning_zero.trainer.cli_errors import unknown_zero_strategy
from lightning_zero.estimate import (
    build_on_meta,
    format_estimate,
    human_bytes,
    parse_bytes,
    parse_count,
    parse_init_args,
)


#: ``--trust-code``: see [Note: a checkpoint is data, never code] in ``checkpoints/trust.py``.
TRUST_CODE_HELP = ("unpickle any type the checkpoint names, which can run code: only for a checkpoint from someone "
                   "you trust (by default only tensors, numbers, strings and containers of them are read)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-zero", description="ZeRO for PyTorch Lightning: training, memory "
                                     "estimates and checkpoint tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in LIGHTNING_COMMANDS:  # listed for --help; main() hands them to LightningCLI before parsing
        commands.add_parser(name, help=f"LightningCLI's `{name}` with the zero1/zero2/zero3 strategy names "
                            f"(`lightning-zero {name} --help`)", add_help=False)

    estimate = commands.add_parser("estimate", help="model-state bytes per rank under ddp/zero1/zero2/zero3, and "
                                   "the largest model each fits in a given memory")
    size = estimate.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=_argument(parse_count), help="a parameter count: 350M, 1.5B, 7e9")
    size.add_argument("--model", help="an importable class, e.g. mypkg.models.GPT (built on the meta device)")
    estimate.add_argument("--init-args", type=_argument(parse_init_args), default={},
                          help="the class's init arguments as a JSON/YAML mapping, e.g. '{width: 512, depth: 12}'")
    estimate.add_argument("-n", "--world-size", type=int, required=True, help="data-parallel ranks")
    estimate.add_argument("--memory", type=_argument(parse_bytes), help="memory per device with its unit, e.g. "
                          "80GiB or 16GB, to find the largest model each stage fits")
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
    merge.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                       help="convert floating-point weights (default: as saved, fp32 masters under mixed precision)")
    merge.add_argument("--trust-code", action="store_true", help=TRUST_CODE_HELP)
    merge.set_defaults(run=_consolidate)

    export = commands.add_parser("export", help="write a checkpoint as a Hugging Face save_pretrained directory "
                                 "(safetensors shards, config.json), a shard at a time")
    add_export_arguments(export, DTYPES)
    export.set_defaults(run=lambda args: print(run_export(args, DTYPES)))
    return parser


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
    _import_from_cwd()
    _zero_cli()(args=expand_short_strategy(argv), subclass_mode_model=True, subclass_mode_data=True)


STRATEGY_FLAG = "--trainer.strategy"
LONG_FORM_HINT = (
    "A strategy given by its short name (`zero3`) takes no options after it: jsonargparse reads the name as a string. "
    "Give the class and its stage instead, on the command line `--trainer.strategy lightning_zero.ZeroStrategy "
    "--trainer.strategy.stage 3 --trainer.strategy.reduce_bucket_size 1e6` (`lightning-zero fit` turns "
    "`--trainer.strategy zero3 --trainer.strategy.reduce_bucket_size 1e6` into that itself), or in YAML `strategy: "
    "{class_path: lightning_zero.ZeroStrategy, init_args: {stage: 3, reduce_bucket_size: 1e6}}`."
)


def expand_short_strategy(argv: Sequence[str]) -> list[str]:
    """``--trainer.strategy zero3`` followed by ``--trainer.strategy.<option>`` flags, in the long form jsonargparse
    accepts options for: ``--trainer.strategy lightning_zero.ZeroStrategy --trainer.strategy.stage 3`` (and the start
    method of a ``_spawn`` / ``_fork`` name). Any other command line is returned as it is.

    [Note: options after a short name]
    jsonargparse types ``trainer.strategy`` as ``Union[str, Strategy]``: after ``zero3`` (a string) a nested flag has
    no class to belong to, and it fails with ``Given value: NestedArg(key=...)``. The registry entry of the name says
    which class and init arguments it stands for, so the short name is replaced by them where it stands, before the
    flags that follow it."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_zero.trainer.strategy import ZeroStrategy

    argv = list(argv)
    if not any(a.startswith(STRATEGY_FLAG + ".") and not a.startswith(STRATEGY_FLAG + ".help") for a in argv):
        return argv
    for i, arg in enumerate(argv):
        name, width = None, 1
        if arg == STRATEGY_FLAG and i + 1 < len(argv):
            name, width = argv[i + 1], 2
        elif arg.startswith(STRATEGY_FLAG + "="):
            name = arg.split("=", 1)[1]
        entry = dict.get(StrategyRegistry, name) if isinstance(name, str) else None  # .get() would build it
        if entry is None or not issubclass(entry["strategy"], ZeroStrategy):
            continue
        long_form = [STRATEGY_FLAG, "lightning_zero.ZeroStrategy"]
        for key, value in entry["init_params"].items():
            if not (key == "start_method" and value == "popen"):
                long_form += [f"{STRATEGY_FLAG}.{key}", str(value)]
        return argv[:i] + long_form + argv[i + width:]
    return argv


def option_hints(message: str) -> str:
    """jsonargparse's error for an unknown ``ZeroStrategy`` option ("Option 'stagee' is not accepted") with the
    "did you mean" the Python API gives (``config.check_option_names``)."""
    from lightning_zero.config import ZeroConfig
    from lightning_zero.trainer.strategy import ZeroStrategy

    if "ZeroStrategy" not in message:
        return message
    known = [f.name for f in dataclasses.fields(ZeroConfig)] + list(inspect.signature(ZeroStrategy).parameters)
    hints = [f"`{name}`: did you mean `{match[0]}`?" for name in re.findall(r"Option '([^']+)' is not accepted",
                                                                            message)
             for match in [difflib.get_close_matches(name, known, n=1)] if match]
    if not hints:
        return message
    return (message + "\nUnknown ZeRO option(s): " + "; ".join(hints) +
            " (every option is listed by `--trainer.strategy.help lightning_zero.ZeroStrategy`).")


def missing_ckpt_path(ckpt_path: object) -> Optional[str]:
    """The error for a ``ckpt_path`` that names a local path with nothing there, found before the model is built and
    sharded (Lightning finds it only when it restores, after setup); ``None`` otherwise ("last", "best", "hpc",
    "registry", URLs)."""
    if not isinstance(ckpt_path, (str, os.PathLike)):
        return None
    text = str(ckpt_path)
    if text in ("last", "best", "hpc", "registry") or text.startswith("registry:") or "://" in text:
        return None
    if os.path.exists(text):
        return None
    return f"`ckpt_path`: {missing_message(Path(text))} Check the path (a sharded checkpoint is a directory)."


def _zero_cli() -> Any:
    """``LightningCLI`` that names lightning-zero's strategies when ``trainer.strategy`` is a misspelled one, and
    suggests the option meant for a misspelled one (:func:`option_hints`)."""
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    class ZeroArgumentParser(LightningArgumentParser):
        def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
            if "NestedArg(" in message and 'key "trainer.strategy"' in message:  # a short name in the YAML file
                message += "\n" + LONG_FORM_HINT
            super().error(option_hints(message), ex)

    class ZeroLightningCLI(LightningCLI):
        def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
            self.parser_class = ZeroArgumentParser
            return super().init_parser(**kwargs)

        def before_instantiate_classes(self) -> None:
            config = self.config[self.subcommand] if self.subcommand else self.config
            message = unknown_zero_strategy(config.get("trainer", {}).get("strategy")) or missing_ckpt_path(
                config.get("ckpt_path"))
            if message:
                self.parser.error(message)

    return ZeroLightningCLI


def _import_from_cwd() -> None:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: classes of the project the command runs in


def _estimate(args: argparse.Namespace) -> None:
    if args.world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {args.world_size}.")
    _import_from_cwd()
    module = build_on_meta(args.model, args.init_args) if args.params is None else None
    params = args.params if module is None else sum(p.numel() for p in module.parameters() if p.requires_grad)
    print(format_estimate(params, args.world_size, args.memory, module))


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
        f"saved by     zero{summary['stage']} on {summary['world_size']} rank{'s' if summary['world_size'] != 1 else ''}"
        f"{_mesh(summary)}, precision {summary['precision']}",
        f"progress     epoch {summary['epoch']}, global step {summary['global_step']}",
        f"parameters   {summary['num_parameters']:,} in {summary['model_tensors']} tensors",
        f"optimizers   {', '.join(summary['optimizers']) or 'none'}"
        + ("" if summary["has_optimizer_state"] else " (weights only: no optimizer state)"),
        f"bytes/rank   {per_rank}  (total {human_bytes(summary['total_bytes'])} with metadata)",
        "files        complete" + (", checksums verified" if summary["verified"] else " (sizes checked; --verify "
                                     "also checks the checksums)"),
    ]
    return "\n".join(lines)


def _format_file_summary(summary: dict[str, Any]) -> str:
    optimizers = summary["optimizers"]
    return "\n".join([
        f"checkpoint   {summary['path']}",
        "saved as     one file in ddp's form (consolidated, or by ddp or state_dict_type='full'): every strategy "
        "resumes it",
        f"progress     epoch {summary['epoch']}, global step {summary['global_step']}",
        f"parameters   {summary['num_parameters']:,} in {summary['model_tensors']} tensors",
        f"optimizers   {optimizers} optimizer state{'s' if optimizers != 1 else ''}" if optimizers else
        "optimizers   none (weights only)",
        f"bytes        {human_bytes(summary['total_bytes'])}",
        "files        read whole by torch.load (a single file carries no checksums)",
    ])


def _mesh(summary: dict[str, Any]) -> str:
    """`` (d data x t tensor)`` for a tensor-parallel checkpoint, else nothing."""
    t = summary.get("tensor_parallel_size", 1)
    return f" ({summary['world_size'] // t} data x {t} tensor parallel)" if t > 1 else ""


def _consolidate(args: argparse.Namespace) -> None:
    out = consolidate(args.checkpoint, args.output, weights_only=args.weights_only,
                      dtype=DTYPES[args.dtype] if args.dtype else None, trust_code=args.trust_code)
    print(f"wrote {out} ({human_bytes(out.stat().st_size)})")


if __name__ == "__main__":
    sys.exit(main())
