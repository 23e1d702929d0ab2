"""Lightning's errors for a wrong strategy name or option, in one line that says what to do: a wrong ``ZeroStrategy``
option in a LightningCLI YAML file or command line, and a misspelled ``zero`` strategy name.

[Note: one line for a wrong option in a config]
A wrong stage or option in ``strategy: {class_path: lightning_zero.ZeroStrategy, init_args: {...}}`` fails in
jsonargparse's type check of the strategy's signature: it prints the whole usage of the Trainer's arguments and a
nested "Does not validate against any of the Union subtypes" report (55 lines for ``stage: 4``), in any user's
``LightningCLI`` script. Importing ``lightning_zero`` wraps ``LightningArgumentParser.error`` (once): when the error
is about ``ZeroStrategy``'s arguments, the arguments jsonargparse was given are passed to ``ZeroStrategy`` itself,
and its own error, the one the same mistake gets in Python, is printed as one line with the key and the config
file(s) it came from. Any other error is left to jsonargparse as it is.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from typing import Any, Callable, NoReturn, Optional, Sequence

from lightning.fabric import connector as fabric_connector
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.trainer.connectors import accelerator_connector

_MARK = "__lightning_zero_one_line__"
# [Note: the last command line is the process's]
# The command line of the last parse (the config files a wrong option may come from). `parse_args` is patched on
# LightningArgumentParser's class, and the error it leads to is raised by whichever parser jsonargparse is in (a
# subcommand's, a nested one): not the instance that was called, so the argv cannot live on the instance.
_argv: list[str] = []


def zero_option_error(message: str, argv: Sequence[str]) -> Optional[str]:
    """The one-line error for jsonargparse's ``message`` about ``ZeroStrategy``'s arguments (``None`` for any other
    message, or when ``ZeroStrategy`` accepts the arguments given)."""
    from lightning_zero.lightning.trainer.auto import ZeroAutoStrategy
    from lightning_zero.lightning.trainer.strategy import ZeroStrategy

    given = re.search(r"Given value: (\{.*'class_path': 'lightning_zero\.(Zero(?:Auto)?Strategy)'.*\})", message)
    if given is None:
        return None
    strategy = ZeroAutoStrategy if given.group(2) == "ZeroAutoStrategy" else ZeroStrategy
    try:
        init_args = dict(ast.literal_eval(given.group(1)).get("init_args") or {})
        strategy(**init_args)
    except (ValueError, TypeError, SyntaxError) as error:
        keys = re.findall(r'Parser key "([^"]+)"', message)
        key = f"trainer.strategy.init_args.{keys[-1]}" if len(keys) > 1 else "trainer.strategy.init_args"
        files = [f for f in _config_files(argv) if strategy.__name__ in _read(f)]
        where = f"{', '.join(files)}: " if files else ""
        return f"{where}`{key}`: {error}".replace("\n", " ")
    return None


def _config_files(argv: Sequence[str]) -> list[str]:
    """The files given to ``--config``/``-c``/``--trainer`` (the ``=`` form too)."""
    files = []
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag in ("--config", "-c", "--trainer"):
            value = value or (argv[i + 1] if i + 1 < len(argv) else "")
            if value and not value.startswith("-"):
                files.append(value)
    return files


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _one_line(error: Callable[..., NoReturn]) -> Callable[..., NoReturn]:
    @functools.wraps(error)
    def wrapped(self: LightningArgumentParser, message: str, ex: Optional[Exception] = None) -> NoReturn:
        line = zero_option_error(message, _argv) if self.exit_on_error else None
        if line is None:
            error(self, message, ex)
        sys.stderr.write(f"error: {line}\n")
        self.exit(2)

    setattr(wrapped, _MARK, True)
    return wrapped


def _remembers_argv(parse_args: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(parse_args)
    def wrapped(self: LightningArgumentParser, args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        _argv[:] = [str(a) for a in args] if isinstance(args, (list, tuple)) else sys.argv[1:]
        return parse_args(self, args, *rest, **kwargs)

    return wrapped


def unknown_zero_strategy(name: object) -> Optional[str]:
    """The error for a strategy name that starts with ``zero`` but is not registered (``"zero4"``), else ``None``.

    [Note: misspelled strategy names]
    ``Trainer(strategy="zero4")`` fails in Lightning's accelerator connector, whose message lists ``auto, ddp,
    ddp_spawn, deepspeed`` and not ours. That check runs inside ``Trainer.__init__`` (and ``Fabric.__init__``) against
    a plain list of the registry's keys, before any code of ours, so importing ``lightning_zero`` wraps it
    (``_names_ours``): a name starting with ``zero`` gets this message instead. The ``lightning-zero``
    command checks the name itself, before the Trainer is built.
    """
    from lightning.pytorch.strategies import StrategyRegistry

    if not isinstance(name, str) or not name.lower().startswith("zero") or name.lower() in StrategyRegistry:
        return None
    ours = sorted(n for n in StrategyRegistry if n.startswith("zero"))
    return (
        f"There is no strategy {name!r}. lightning-zero registers zero1, zero2, zero3 (ZeRO stages 1-3), "
        f"zero_auto (the stage chosen from the memory budget) and their _spawn/_fork variants: {', '.join(ours)}. "
        "For options, use the long form `strategy: {class_path: lightning_zero.ZeroStrategy, init_args: {stage: "
        "3, ...}}`."
    )


def _names_ours(check: Callable[..., Any]) -> Callable[..., Any]:
    """Lightning's check of the strategy argument, whose error for a name starting with ``zero`` lists ours (see
    [Note: misspelled strategy names])."""

    @functools.wraps(check)
    def wrapped(self: Any, strategy: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return check(self, strategy, *args, **kwargs)
        except ValueError as error:
            ours = unknown_zero_strategy(strategy) if "invalid strategy name" in str(error) else None
            if ours is None:
                raise
            raise ValueError(ours) from None

    setattr(wrapped, _MARK, True)
    return wrapped


def install() -> None:
    """Wrap ``LightningArgumentParser.error`` and ``parse_args`` (see [Note: one line for a wrong option in a
    config]) and the Trainer's and Fabric's check of the strategy name, once."""
    for connector in (accelerator_connector._AcceleratorConnector, fabric_connector._Connector):
        if not getattr(connector._check_config_and_set_final_flags, _MARK, False):
            connector._check_config_and_set_final_flags = _names_ours(  # type: ignore[method-assign]
                connector._check_config_and_set_final_flags
            )
    if not getattr(LightningArgumentParser.error, _MARK, False):
        LightningArgumentParser.error = _one_line(LightningArgumentParser.error)  # type: ignore[method-assign]
        LightningArgumentParser.parse_args = _remembers_argv(  # type: ignore[method-assign]
            LightningArgumentParser.parse_args
        )
