"""Stage 3 parameters that cannot be read by mistake: outside its unit's use a parameter raises a clear error.

[Note: a released parameter raises, it never crashes]
Between uses a stage 3 parameter is a view of a unit buffer whose storage has zero bytes (see [Note: stage 3
storage] in ``params.py``): its shape is the parameter's, its memory is gone. A plain tensor like that crashes the
process when read (a segfault on CPU, no Python traceback). So while its unit is released, the parameter's class is
swapped for a subclass of its own class (``guarded_class``) whose ``__torch_function__`` refuses every operation
that would read the values with ``ParameterNotGatheredError``, naming the parameter, its unit and the fix, and
allows what only reads metadata (shape, dtype, device, ``requires_grad``, ``.grad``, hooks). Gathering the unit swaps
the class back before anyone can use the values, so inside forward and backward the parameters are plain
``nn.Parameter`` objects: the step pays one attribute store per parameter per gather and release, nothing per
operation (timings: benchmarks/RESULTS.md, "Guarding released stage 3 parameters").

Alternatives measured or weighed (2026-11-24): DeepSpeed's 0-element ``param.data`` swaps (a read gives zeros or a
shape error far from the cause, ``W.norm()`` silently returns 0: silent loss, and the tensors autograd saved would
keep the old storage, so backward's re-gather would need ``param.data`` swaps of every saved view as well); FSDP2's
DTensor shards (every operation pays DTensor dispatch, and the user's optimizer and hooks would see DTensors); a
permanent ``__torch_function__`` subclass (a Python dispatch per operation on a parameter in every forward, and a
subclass dynamo must trace). The class swap keeps the step exactly as fast as plain parameters and autograd's saved
views (which share the buffer's storage) untouched.
"""

from __future__ import annotations

from typing import Any, Optional, cast

import torch
from torch import Tensor, nn
from torch.overrides import resolve_name

from lightning_zero.shards.mixins import with_mixin

#: What may be asked of a released parameter: nothing here reads its values.
_METADATA = frozenset(
    f"torch.Tensor.{name}"
    for name in (
        "shape.__get__",
        "dtype.__get__",
        "device.__get__",
        "layout.__get__",
        "ndim.__get__",
        "names.__get__",
        "requires_grad.__get__",
        "requires_grad.__set__",
        "grad.__get__",
        "grad.__set__",
        "grad.__delete__",
        "_grad.__get__",
        "_grad.__set__",
        "is_leaf.__get__",
        "grad_fn.__get__",
        "data.__set__",
        "is_meta.__get__",
        "is_cuda.__get__",
        "is_cpu.__get__",
        "is_sparse.__get__",
        "is_quantized.__get__",
        "is_nested.__get__",
        "_backward_hooks.__get__",
        "_backward_hooks.__set__",
        "_post_accumulate_grad_hooks.__get__",
        "_post_accumulate_grad_hooks.__set__",
        "retains_grad.__get__",
        "itemsize.__get__",
        "nbytes.__get__",
        "size",
        "dim",
        "numel",
        "nelement",
        "element_size",
        "is_floating_point",
        "is_complex",
        "stride",
        "storage_offset",
        "is_contiguous",
        "requires_grad_",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "get_device",
        "__len__",
        "__hash__",
        "_is_view",
        "is_shared",
        "__format__",
        "untyped_storage",
        "data_ptr",  # the storage itself (zero bytes while released), as memory probes read it
    )
)
_INFO = "_lightning_zero_guard"
_DETACH = "torch.Tensor.detach"


class ParameterNotGatheredError(RuntimeError):
    """A stage 3 parameter was used while its unit is not gathered (between steps, outside its unit's forward)."""


class _Released:
    """Mixed into a parameter's class while its unit is released (see [Note: a released parameter raises ...])."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = resolve_name(func) or getattr(func, "__name__", str(func))
        if name == "torch.Tensor.__repr__":
            return _describe(args[0])
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name == _DETACH:  # torch's `state_dict()` detaches every parameter: the result stays guarded
            return _detached(args[0])
        # a _Released is always a tensor: the mixin is only put into tensor classes (guarded_class)
        param = cast(Tensor, next(a for a in (*args, *kwargs.values()) if isinstance(a, _Released)))
        raise ParameterNotGatheredError(_message(param, name))


def guarded_class(cls: type) -> type:
    """``cls`` (``nn.Parameter``, a subclass, or ``Tensor``) with the released behaviour mixed in, keeping its name."""
    return with_mixin(_Released, cls)


def _detached(param: Tensor) -> Tensor:
    """``param.detach()`` of a released parameter: a tensor that refuses reads in the same way (a placeholder that
    ``module.state_dict()`` replaces with the gathered values, see ``engine/module_state.py``)."""
    with torch._C.DisableTorchFunctionSubclass():
        out: Tensor = param.detach().as_subclass(guarded_class(torch.Tensor))
    out.__dict__[_INFO] = param.__dict__.get(_INFO, ("a parameter", "?"))
    return out


def name_parameters(module: nn.Module, units: dict[int, str]) -> None:
    """Remember each parameter's name and unit name for the error (``units``: ``id(param)`` to unit name)."""
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in units and _INFO not in param.__dict__:
            param.__dict__[_INFO] = (name, units[id(param)])


def release(params: list[Tensor]) -> None:
    """Make ``params`` refuse reads (their unit's storage is gone)."""
    for p in params:
        p.__class__ = guarded_class(type(p))


def restore(params: list[Tensor]) -> None:
    """Make ``params`` plain parameters again (their unit is gathered, or they hold values of their own)."""
    for p in params:
        cls = type(p)
        if issubclass(cls, _Released):
            p.__class__ = cls.__mro__[2]


def is_released(param: Tensor) -> bool:
    """Whether ``param`` is a stage 3 parameter whose unit is not gathered."""
    return isinstance(param, _Released)


def _describe(param: Tensor) -> str:
    name, unit = param.__dict__.get(_INFO, ("a parameter", "?"))
    with torch._C.DisableTorchFunctionSubclass():
        shape, dtype = tuple(param.shape), param.dtype
    return f"ShardedParameter({name}, shape={shape}, dtype={dtype}, unit '{unit}' not gathered)"


def _message(param: Tensor, operation: str) -> str:
    name, unit = param.__dict__.get(_INFO, ("a parameter", "?"))
    with torch._C.DisableTorchFunctionSubclass():
        shape = tuple(param.shape)
    return (
        f"`{name}` (shape {shape}) is a zero3 parameter and its unit '{unit}' is not gathered right now, so this rank "
        f"holds no values for it ({operation} was called on it). Between steps, read the weights inside "
        "`with strategy.gathered_parameters():` (a collective: every rank enters it; Trainer: "
        "`self.trainer.strategy.gathered_parameters()`, Fabric: `fabric.strategy.gathered_parameters()`, plain loop: "
        "`engine.gathered_parameters()`) or with `model.state_dict()`, change them with `model.load_state_dict(...)` "
        "(both on every rank), or use zero1/zero2, which keep every parameter whole. Inside a forward this means the "
        "module using it is not a stage 3 unit whose own forward runs (name the blocks' class in `unit_classes`)."
    )
