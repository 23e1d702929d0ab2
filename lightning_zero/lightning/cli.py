"""The Lightning side of the ``lightning-zero`` command: ``LightningCLI`` with the ZeRO strategy names, the long form
of a short strategy name followed by its options, and the hints for a misspelled strategy or option."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import re
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

import yaml
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.checkpoints.storage import missing_message
from lightning_zero.config import ZeroConfig
from lightning_zero.lightning.trainer.auto import ZeroAutoStrategy
from lightning_zero.lightning.trainer.cli_errors import unknown_zero_strategy
from lightning_zero.lightning.trainer.strategy import ZeroStrategy

STRATEGY_FLAG = "--trainer.strategy"
ZERO_STRATEGIES = (
    ZeroAutoStrategy,
    ZeroStrategy,
)  # by name in jsonargparse's messages ("ZeroStrategy" is not in the other)
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
    method of a ``_spawn`` / ``_fork`` name). The short name may be on the command line or, as ``strategy: zero3``,
    in a ``--config`` file before the flags. Any other command line is returned as it is.

    [Note: options after a short name]
    jsonargparse types ``trainer.strategy`` as ``Union[str, Strategy]``: after ``zero3`` (a string) a nested flag has
    no class to belong to, and it fails with ``Given value: NestedArg(key=...)``. The registry entry of the name says
    which class and init arguments it stands for, so the short name is replaced by them where it stands, before the
    flags that follow it; a name from a config file is followed by the long form on the command line just before
    the first option flag (later values override the file's)."""
    argv = list(argv)
    first = next((i for i, a in enumerate(argv) if _is_option_flag(a)), None)
    if first is None:
        return argv
    for i, arg in enumerate(argv):
        name, width = None, 1
        if arg == STRATEGY_FLAG and i + 1 < len(argv):
            name, width = argv[i + 1], 2
        elif arg.startswith(STRATEGY_FLAG + "="):
            name = arg.split("=", 1)[1]
        if name is not None:
            long_form = _long_form(name)
            return argv if long_form is None else argv[:i] + long_form + argv[i + width :]
    long_form = _long_form(_strategy_in_configs(argv[:first]))
    return argv if long_form is None else argv[:first] + long_form + argv[first:]


def _is_option_flag(arg: str) -> bool:
    return arg.startswith(STRATEGY_FLAG + ".") and not arg.startswith(STRATEGY_FLAG + ".help")


def _long_form(name: object) -> Optional[list[str]]:
    """The long form of a ZeRO strategy's registered short name; ``None`` for any other value."""
    entry = dict.get(StrategyRegistry, name) if isinstance(name, str) else None  # .get() would build it
    if entry is None or not issubclass(entry["strategy"], ZeroStrategy):
        return None
    long_form = [STRATEGY_FLAG, f"lightning_zero.{entry['strategy'].__name__}"]  # ZeroStrategy, ZeroAutoStrategy
    for key, value in entry["init_params"].items():
        if not (key == "start_method" and value == "popen"):
            long_form += [f"{STRATEGY_FLAG}.{key}", str(value)]
    return long_form


def _strategy_in_configs(argv: Sequence[str]) -> object:
    """``trainer.strategy`` of the last ``--config`` / ``-c`` file in ``argv`` that sets it (at the top or under a
    subcommand); ``None`` if none does or a file cannot be read (the parser then says why)."""
    found: object = None
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else None
        path = arg.split("=", 1)[1] if arg.startswith("--config=") else path
        if path is None:
            continue
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue
        for section in [loaded] + (list(loaded.values()) if isinstance(loaded, dict) else []):
            trainer = section.get("trainer") if isinstance(section, dict) else None
            if isinstance(trainer, dict) and "strategy" in trainer:
                found = trainer["strategy"]
    return found


def option_hints(message: str) -> str:
    """jsonargparse's error for an unknown ``ZeroStrategy`` option ("Option 'stagee' is not accepted") with the
    "did you mean" the Python API gives (``config.check_option_names``)."""
    strategy = next((cls for cls in ZERO_STRATEGIES if cls.__name__ in message), None)
    if strategy is None:
        return message
    known = [f.name for f in dataclasses.fields(ZeroConfig)] + [
        name for cls in ZERO_STRATEGIES for name in inspect.signature(cls).parameters if name != "kwargs"
    ]
    hints = [
        f"`{name}`: did you mean `{match[0]}`?"
        for name in re.findall(r"Option '([^']+)' is not accepted", message)
        for match in [difflib.get_close_matches(name, known, n=1)]
        if match
    ]
    if not hints:
        return message
    return (
        message
        + "\nUnknown ZeRO option(s): "
        + "; ".join(hints)
        + f" (every option is listed by `--trainer.strategy.help lightning_zero.{strategy.__name__}`)."
    )


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


def zero_cli() -> Any:
    """``LightningCLI`` that names lightning-zero's strategies when ``trainer.strategy`` is a misspelled one, and
    suggests the option meant for a misspelled one (``option_hints``)."""

    class ZeroArgumentParser(LightningArgumentParser):
        def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
            if "NestedArg(" in message and 'key "trainer.strategy"' in message:  # a short name in the YAML file
                message += "\n" + LONG_FORM_HINT
            super().error(option_hints(message), ex)

    class ZeroLightningCLI(LightningCLI):
        def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
            self.parser_class = ZeroArgumentParser
            return super().init_parser(**kwargs)

        def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
            """As Lightning's, without its warning that ``args`` and a command line were both given: ``lightning-zero
            fit`` passes its own command line, expanded (``expand_short_strategy``), as ``args``."""
            self.config = parser.parse_object(args) if isinstance(args, (dict, Namespace)) else parser.parse_args(args)

        def before_instantiate_classes(self) -> None:
            config = self.config[self.subcommand] if self.subcommand else self.config
            message = unknown_zero_strategy(config.get("trainer", {}).get("strategy")) or missing_ckpt_path(
                config.get("ckpt_path")
            )
            if message:
                self.parser.error(message)

    return ZeroLightningCLI
