"""The repeated blocks of a model: what stage 3 gathers together (its units, see [Note: units] in
``stage3/plan.py``) and what ZeRO-R checkpoints (``checkpointing.py``). Found the same way for both, so that a
typo or a container names the option it came from."""

from __future__ import annotations

import difflib
import sys
from typing import Sequence, Union

from torch import nn


def find_blocks(
    module: nn.Module, unit_classes: Sequence[Union[type, str]] = (), option: str = "unit_classes"
) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``module``, outermost first: modules of ``unit_classes`` (classes or class names) if
    given, else the children of ``nn.ModuleList`` / ``nn.Sequential``; only those with parameters. A block compiled
    with ``torch.compile(block)`` is found as its wrapper (see [Note: units and torch.compile]). Classes that match
    nothing, and containers, are refused with an error that names ``option``."""
    chosen: list[tuple[str, nn.Module]] = []

    def is_unit_class(m: nn.Module) -> bool:
        cls = type(m)
        return any(
            c is cls
            or (isinstance(c, type) and isinstance(m, c))
            or c in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}")
            for c in unit_classes
        )

    def visit(name: str, mod: nn.Module, in_container: bool) -> None:
        is_block = is_unit_class(compiled_inner(mod)) if unit_classes else in_container
        if name and is_block and has_params(mod):
            chosen.append((name, mod))  # a compiled block: its wrapper (see [Note: units and torch.compile])
            return
        if mod is not compiled_inner(mod):  # a wrapper that is not a block: look inside as if it were not there
            visit(f"{name}._orig_mod" if name else "_orig_mod", compiled_inner(mod), in_container)
            return
        container = isinstance(mod, (nn.ModuleList, nn.Sequential))
        for child_name, child in mod.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, container)

    visit("", module, False)
    if unit_classes:
        _check_unit_classes(module, unit_classes, chosen, option)
    return chosen


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _class_names(cls: type) -> tuple[str, ...]:
    return cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"


def _check_unit_classes(
    module: nn.Module, unit_classes: Sequence[Union[type, str]], chosen: list[tuple[str, nn.Module]], option: str
) -> None:
    """Refuse ``unit_classes`` entries that match no submodule (with a "did you mean") and units that are containers
    (their forward never runs, so they would never be gathered)."""
    classes = {type(compiled_inner(m)) for m in module.modules()}
    for entry in unit_classes:
        if not any(
            c is entry or (isinstance(entry, type) and issubclass(c, entry)) or entry in _class_names(c)
            for c in classes
        ):
            names = sorted({c.__name__ for c in classes})
            close = difflib.get_close_matches(str(getattr(entry, "__name__", entry)), names, n=3)
            hint = f" Did you mean {' or '.join(repr(n) for n in close)}?" if close else ""
            raise ValueError(
                f"`{option}` names {entry!r}, but no submodule of {type(module).__name__} is of that class.{hint} "
                f"The model's classes: {', '.join(names)}."
            )
    for name, mod in chosen:
        if isinstance(compiled_inner(mod), _CONTAINERS):
            inner = sorted({type(c).__name__ for c in mod.children()})
            raise ValueError(
                f"`{option}` makes '{name}' ({type(mod).__name__}) a block, but a container's forward is never called"
                ", so hooks on it never run (stage 3 would never gather its parameters). Name the class of the blocks"
                f" inside it instead: {option}=[{', '.join(repr(n) for n in inner)}]."
            )


def compiled_inner(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wrapper (``OptimizedModule``) runs, else ``module`` itself."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return module


def has_params(m: nn.Module) -> bool:
    """Whether ``m`` or a submodule has a parameter."""
    return any(True for _ in m.parameters())
