"""Which optimizers ZeRO can shard and how (flat slices or whole tensors), the subclass it swaps in for
``zero_grad`` (see [Note: gradients live until zero_grad] in ``optimizer.py``), and the checks and ordering of the
parameters a storage lays out."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.shards.mixins import with_mixin
from lightning_zero.shards.policy import OptimizerPolicy

#: torch optimizers whose update of an element depends on that element's gradient and state only.
ELEMENTWISE_OPTIMIZERS = frozenset(
    f"torch.optim.{name}"
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop")
)
#: Optimizers that cannot work on any partition of the parameters.
UNSUPPORTED_OPTIMIZERS = {
    "torch.optim.LBFGS": "LBFGS re-evaluates the closure several times within one step and keeps a history of "
    "flattened whole-model gradients, but under ZeRO each rank holds only its shard and the "
    "closure runs once per step, before the gradients are reduced. Train with LBFGS under "
    "`strategy='ddp'`, or pick an optimizer that steps once per closure (Adam, SGD, ...)",
    "torch.optim.SparseAdam": "SparseAdam needs sparse gradients, which ZeRO's flat buckets do not hold. Use "
    "`torch.optim.Adam` or `strategy='ddp'`",
}


def optimizer_name(optimizer: Optimizer) -> str:
    """The public dotted name of the optimizer's class, e.g. ``torch.optim.AdamW``."""
    cls = user_class(optimizer)
    module = cls.__module__
    if module.startswith("torch.optim."):
        module = "torch.optim"
    return f"{module}.{cls.__qualname__}"


def is_elementwise(optimizer: Optimizer, policy: OptimizerPolicy) -> bool:
    """Whether ``optimizer`` may be stepped on flat slices (see ``ZeroConfig.partition_whole_params``)."""
    if policy.partition_whole_params is not None:
        return not policy.partition_whole_params
    name = optimizer_name(optimizer)
    return name in ELEMENTWISE_OPTIMIZERS or any(
        name == n or name.rsplit(".", 1)[-1] == n for n in policy.elementwise_optimizers
    )


def check_optimizer(optimizer: Any) -> None:
    """Raise a clear error for an object ZeRO cannot shard."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"ZeroStrategy needs `configure_optimizers` to return `torch.optim.Optimizer` instances, got "
            f"{type(optimizer).__name__}. Wrap custom update rules in a `torch.optim.Optimizer` subclass."
        )
    reason = UNSUPPORTED_OPTIMIZERS.get(optimizer_name(optimizer))
    if reason:
        raise TypeError(f"ZeroStrategy cannot shard {optimizer_name(optimizer)}: {reason}.")


class _ZeroGradHook:
    """Mixin that makes ``zero_grad`` also clear the gradients ZeRO keeps outside the optimizer's params."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # type: ignore[misc]
        self._zero_sharded.zero_grad()  # type: ignore[attr-defined]


def zero_subclass(cls: type) -> type:
    """``cls`` with ``_ZeroGradHook`` mixed in, keeping its name (see the module docstring)."""
    return with_mixin(_ZeroGradHook, cls)


def user_class(optimizer: Optimizer) -> type:
    """The user's optimizer class behind ZeRO's subclass."""
    cls = type(optimizer)
    while issubclass(cls, _ZeroGradHook) and cls.__bases__[0] is _ZeroGradHook:
        cls = cls.__bases__[1]
    return cls


def _piecewise_step_is_invisible(optimizer: Optimizer) -> bool:
    """Whether nothing but the tensors can tell several ``step`` calls from one (see [Note: the step in ...])."""
    from torch.optim import optimizer as torch_optimizer

    hooks = (
        optimizer._optimizer_step_pre_hooks,
        optimizer._optimizer_step_post_hooks,
        torch_optimizer._global_optimizer_pre_hooks,
        torch_optimizer._global_optimizer_post_hooks,
    )
    return optimizer_name(optimizer) in ELEMENTWISE_OPTIMIZERS and not any(hooks)


def steps_in_pieces(optimizer: Optimizer, limit: int) -> bool:
    """Whether ``step_in_pieces`` would call ``step`` more than once."""
    if not _piecewise_step_is_invisible(optimizer):
        return False
    size, pieces = limit, 0
    for group in optimizer.param_groups:
        for tensor in group["params"]:
            if size + tensor.numel() > limit:
                pieces, size = pieces + 1, 0
            size += tensor.numel()
    return pieces > 1


def step_in_pieces(
    optimizer: Optimizer,
    limit: int,
    step: Callable[[], Any],
    after_piece: Optional[Callable[[list[Any]], None]] = None,
    before_piece: Optional[Callable[[list[list[Any]], int], None]] = None,
) -> Any:
    """Run ``step`` (the user's ``optimizer.step``) once per run of master tensors of at most ``limit`` elements;
    ``after_piece`` gets the tensors of each piece once it is stepped, ``before_piece`` the tensors of every piece
    and the index of the one about to be stepped (both only when there are several pieces).

    [Note: the step in constant-size pieces]
    An optimizer allocates temporaries as large as what one ``step`` call covers (``foreach`` AdamW: one per master
    tensor for ``sqrt(v)``, all at once), so stepping a whole shard costs shard-sized memory that does not fall with
    the model. Only for elementwise optimizers, whose tensors are flat slices anyway: each call sees a few whole
    master tensors (never a part of one) and every other group is left empty for that call, so every tensor gets
    exactly the arithmetic of one big call (per-tensor ``step`` counts, bias corrections, the same kernels on the
    same tensors): the results are bitwise those of one call. The groups' ``params`` are restored afterwards, even
    on an error. Only torch's own optimizer classes with no step hooks are stepped in pieces: a subclass or a hook may
    count or act per ``step`` call, and must see one call per step, as under ``ddp``.
    """
    if not _piecewise_step_is_invisible(optimizer):
        return step()
    groups = optimizer.param_groups
    saved = [group["params"] for group in groups]
    pieces: list[list[list[Any]]] = []
    size = limit
    for g, params in enumerate(saved):
        for tensor in params:
            if size + tensor.numel() > limit:
                pieces.append([[] for _ in groups])
                size = 0
            pieces[-1][g].append(tensor)
            size += tensor.numel()
    if len(pieces) <= 1:
        return step()
    output = None
    try:
        tensors = [[tensor for params in piece for tensor in params] for piece in pieces]
        for index, piece in enumerate(pieces):
            if before_piece is not None:
                before_piece(tensors, index)
            for group, params in zip(groups, piece):
                group["params"] = params
            output = step()
            if after_piece is not None:
                after_piece(tensors[index])
    finally:
        for group, params in zip(groups, saved):
            group["params"] = params
    return output


def backward_order(params: list[Tensor], module: Optional[torch.nn.Module]) -> list[int]:
    """When backward should produce each parameter's gradient: the reverse of the module's registration order."""
    registered = {id(p): i for i, p in enumerate(module.parameters())} if module is not None else {}
    fallback = len(registered)
    return [-registered.get(id(p), fallback + i) for i, p in enumerate(params)]


def check_params(params: list[Tensor], optimizer: Optimizer) -> None:
    """Refuse a parameter listed twice, or one ZeRO cannot flatten (sparse, integer)."""
    seen: set[int] = set()
    for p in params:
        if id(p) in seen:
            raise ValueError(f"A parameter appears twice in the param groups of {optimizer_name(optimizer)}.")
        seen.add(id(p))
        check_not_dtensor(p)
        if p.is_sparse or not p.is_floating_point():
            raise TypeError(f"ZeroStrategy shards dense floating-point parameters only, got one of dtype {p.dtype}.")


def check_not_dtensor(param: Tensor, name: str = "") -> None:
    """Refuse a DTensor parameter (``parallelize_module``, ``distribute_tensor``) with what to use instead."""
    if type(param).__name__ == "DTensor":
        raise TypeError(
            f"ZeRO got a DTensor parameter{f' ({name})' if name else ''}, from "
            "`torch.distributed.tensor.parallel.parallelize_module` or `distribute_tensor`: ZeRO's flat buffers hold "
            "plain tensors. For tensor parallelism under ZeRO use `ZeroStrategy(tensor_parallel_size=t)` and, in "
            "`configure_model`, `lightning_zero.tensor_parallel.parallelize(module, "
            "self.device_mesh['tensor_parallel'], plan)` with the same plan of ColwiseParallel()/RowwiseParallel(), "
            "or its layers (ColumnParallelLinear, RowParallelLinear, your own with `mark_tensor_parallel`); for "
            "DTensor tensor parallelism use Lightning's ModelParallelStrategy (FSDP2)."
        )
