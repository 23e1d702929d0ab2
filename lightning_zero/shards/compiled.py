"""How the engine's hooks meet ``torch.compile``: they always run eagerly, and compiled autograd is refused.

[Note: hooks under torch.compile]
Stages 2 and 3 act inside forward and backward through hooks (a gradient handed to its bucket as soon as it is
accumulated, stage 3's gather/free around each unit). These hooks issue asynchronous collectives and resize storages,
which dynamo cannot trace: traced, each would split the graph, one graph break per parameter and unit. So every hook
is wrapped in ``torch.compiler.disable`` and runs as plain Python, whether its caller is eager or compiled; a
compiled block whose hooks sit outside its graph (stage 3: see [Note: units and torch.compile]) compiles once.

Compiled autograd (``torch._dynamo.compiled_autograd``, off by default, and off in Lightning) traces the whole
backward, gradient hooks included: under stages 2 and 3 it would compile one piece of backward per parameter, for
minutes, before the first step. Those hooks refuse it with an error instead (at the first one that runs; the
ordinary autograd engine runs compiled blocks' backward graphs all the same).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch


def eager_hook(hook: Callable[..., Any], what: str) -> Callable[..., Any]:
    """``hook``, never traced by dynamo and refusing compiled autograd; ``what`` names it in the error."""

    def run(*args: Any) -> Any:
        if compiled_autograd_active():
            raise RuntimeError(
                f"lightning-zero: {what} ran under compiled autograd (torch._dynamo.compiled_autograd), which is not "
                "supported: the hook issues collectives during backward that compiled autograd cannot trace, so the "
                "backward would be compiled piece by piece. Compile the model or its blocks with torch.compile "
                "(their backward graphs are compiled with them) and leave compiled autograd off."
            )
        return hook(*args)

    return torch.compiler.disable(run, recursive=True)


def compiled_autograd_active() -> bool:
    """Whether a backward compiled by compiled autograd is running now."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")  # never imported: never used
    return module is not None and bool(module.in_compiled_autograd_region or module.compiled_autograd_enabled)
