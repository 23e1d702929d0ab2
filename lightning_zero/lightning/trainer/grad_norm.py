"""Lightning's ``grad_norm`` (``lightning.pytorch.utilities``) with ``ddp``'s values for a model set up under ZeRO.

[Note: grad_norm reads the gradient shards]
Under zero2 and zero3 each gradient is reduced into this rank's shard as it is made, so ``param.grad`` is ``None``
in ``on_before_optimizer_step``, and Lightning's ``grad_norm(module, norm_type)`` (which reads ``param.grad``)
returns an empty dict: gradient logging showed nothing, without a word. Importing ``lightning_zero`` makes
``grad_norm`` of a module (or submodule) that a ZeRO engine holds return the engine's
``grad_norms`` for that module's parameters: each trainable
parameter's norm of its averaged gradient (what ``ddp``'s ``.grad`` holds) under the names and keys ``grad_norm``
gives, and their total. It is a collective, as every rank calls ``on_before_optimizer_step``.

A user's module imports ``grad_norm`` with ``from lightning.pytorch.utilities import grad_norm``, often before
``import lightning_zero`` (isort's order), and keeps the function object it got; so the function itself is
redirected: its code is replaced by a two-line dispatch to ``_grad_norm`` (in its own module's globals), and
the original code lives on in a copy that every module Zero does not hold still gets.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Union

import torch
from torch import nn

from lightning_zero.pretrained import loading as pretrained

_DISPATCH = "_lightning_zero_grad_norm"


def _grad_norm(
    original: Callable[..., dict[str, Any]],
    module: nn.Module,
    norm_type: Union[float, int, str],
    group_separator: str = "/",
) -> dict[str, Any]:
    """``original(module, ...)``, or the engine's norms when an engine holds ``module``'s parameters."""
    held = pretrained._owner_of(module)
    if held is None or not hasattr(held[2], "grad_norms"):
        return original(module, norm_type, group_separator)
    engine: Any = held[2]  # an engine: it has grad_norms
    norm_type = float(norm_type)
    if norm_type <= 0:  # as Lightning's own check
        return original(module, norm_type, group_separator)
    ours = {id(p): name for name, p in module.named_parameters()}
    root_names = {name: id(p) for name, p in engine.module.named_parameters()}
    every = engine.grad_norms(norm_type)  # a collective: the whole model's, on every rank
    head = f"grad_{norm_type}_norm/"
    norms = {}
    for key, value in every.items():
        if key.startswith(head) and root_names.get(key[len(head) :]) in ours:
            norms[f"grad_{norm_type}_norm{group_separator}{ours[root_names[key[len(head) :]]]}"] = value
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.stack(list(norms.values())).norm(norm_type)
    return norms


def _dispatch(module: Any, norm_type: Any, group_separator: str = "/") -> Any:
    return _lightning_zero_grad_norm(module, norm_type, group_separator)  # type: ignore[name-defined]  # noqa: F821


def install() -> None:
    """Redirect ``lightning.pytorch.utilities.grad_norm`` (once; see [Note: grad_norm reads the gradient shards])."""
    from lightning.pytorch.utilities import grads

    function = grads.grad_norm
    if _DISPATCH in function.__globals__:
        return
    original = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    function.__globals__[_DISPATCH] = functools.partial(_grad_norm, original)
    function.__code__ = _dispatch.__code__
