"""Tensor parallelism for ZeRO over the data dimension: Megatron's column- and row-parallel linear layers, and how a
module tells ZeRO which of its parameters are slices of larger tensors.

Under ``ZeroStrategy(tensor_parallel_size=t)`` (or Fabric's, or ``ZeroEngine``'s option) the ranks form a
(data x tensor) ``DeviceMesh``; ``configure_model`` gets it as ``self.device_mesh`` and builds its layers over
``self.device_mesh["tensor_parallel"]``. ZeRO then partitions each rank's slices over ``"data_parallel"`` (see
[Note: ZeRO over the data dimension] in ``comm/groups.py``)::

    def configure_model(self):
        tp = self.device_mesh["tensor_parallel"].get_group()
        self.up = ColumnParallelLinear(width, 4 * width, group=tp)     # this rank: 4 * width / t output features
        self.down = RowParallelLinear(4 * width, width, group=tp)      # this rank: 4 * width / t input features

A layer written by hand marks its sliced parameters with ``mark_tensor_parallel``; every unmarked parameter
is taken to be replicated over the tensor group (the same values and gradients on each of its ranks, as a
LayerNorm between parallel layers is). DTensor parameters (``torch.distributed.tensor.parallel``) are not
supported: ZeRO's flat buffers hold plain tensors.

[Note: Megatron's f and g]
A column-parallel layer takes a replicated input and gives each rank a slice of the output features; a row-parallel
layer takes those slices and sums the partial products over the tensor group. The two conjugate operators make the
gradients right: ``f`` (``copy_to_tensor_parallel``) is the identity forward and sums the input gradient over
the group backward (each rank computed the gradient through its own slice only); ``g``
(``reduce_from_tensor_parallel``) sums forward and is the identity backward. A replicated parameter then gets
the same gradient on every rank of the group, and a sliced one the gradient of its slice of the full tensor.
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_zero.comm import collectives
from lightning_zero.comm.groups import GroupSizes
from lightning_zero.comm.traffic import Group
from lightning_zero.shards.slices import mark_tensor_parallel, tensor_parallel_slice


def cut(full: Tensor, size: int, dim: int, parts: int = 1) -> list[Tensor]:
    """The ``size`` slices of a whole tensor (see ``TensorParallelSlice``), as views where they can be."""
    blocks = full.chunk(parts, dim)
    if parts == 1:
        return list(full.chunk(size, dim))
    return [torch.cat([block.chunk(size, dim)[j] for block in blocks], dim) for j in range(size)]


def join(slices: Sequence[Tensor], dim: int, parts: int = 1) -> Tensor:
    """The whole tensor of ``slices`` (every rank's, in rank order): the inverse of ``cut``."""
    pieces = [piece.chunk(parts, dim) for piece in slices]
    return torch.cat([torch.cat([p[q] for p in pieces], dim) for q in range(parts)], dim)


class _CopyToTensorParallel(torch.autograd.Function):
    """``f`` of [Note: Megatron's f and g]: identity forward, sum of the input gradients backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Optional[Any]) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return collectives.all_reduce(grad.contiguous().clone(), group=ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """``g`` of [Note: Megatron's f and g]: sum forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Optional[Any]) -> Tensor:
        return collectives.all_reduce(x.contiguous().clone(), group=group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def copy_to_tensor_parallel(x: Tensor, group: Optional[Any]) -> Tensor:
    """Megatron's ``f``: ``x`` as is, with its gradient summed over ``group`` in backward."""
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: Tensor, group: Optional[Any]) -> Tensor:
    """Megatron's ``g``: the sum of ``x`` over ``group`` (the gradient passes through unchanged)."""
    return _ReduceFromTensorParallel.apply(x, group)


class _GroupRef:
    """A process group held by a layer: deep copies of the module (EMA callbacks, ``copy.deepcopy(model)``) share it
    (a process group cannot be copied). ``counted``: the same group as a counted
    ``Group`` of an engine, once ``count_tensor_parallel`` bound it."""

    def __init__(self, group: Optional[Any]) -> None:
        self.group = group
        self.counted: Optional[Group] = None

    @property
    def talks_over(self) -> Optional[Any]:
        """What the layer's collectives go over: the counted group once bound, else the bare one."""
        counted = getattr(self, "counted", None)  # a layer pickled before `counted` existed has none
        return counted if counted is not None else self.group

    def __deepcopy__(self, memo: dict) -> "_GroupRef":
        return self


class _ParallelLinear(nn.Module):
    """What the two layers share: the full layer's sizes, the group, the weight (cut along ``cut_dim``), the bias
    (cut with the output features, or whole), ``nn.Linear``'s initialization of the full layer."""

    cut_dim: int  # of the weight: 0 cuts the output features, 1 the input features

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: Optional[Any],
        device: Optional[torch.device],
        dtype: Optional[torch.dtype],
    ) -> None:
        super().__init__()
        self._group = _GroupRef(group)
        self.in_features, self.out_features = in_features, out_features
        shape = [out_features, in_features]
        size = collectives.world_size(group)
        if shape[self.cut_dim] % size:
            what = ("out_features", "in_features")[self.cut_dim]
            raise ValueError(
                f"{what}={shape[self.cut_dim]} does not split over a tensor group of {size} ranks: make "
                f"it a multiple of {size}."
            )
        shape[self.cut_dim] //= size
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(shape, device=device, dtype=dtype)), self.cut_dim, group
        )
        self.bias = nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype)) if bias else None
        if self.bias is not None and self.cut_dim == 0:
            mark_tensor_parallel(self.bias, 0, group)
        self.reset_parameters()

    @property
    def group(self) -> Optional[Any]:
        """The tensor-parallel process group (``None``: the default group)."""
        return self._group.group

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization of the full layer: uniform in ``±1/sqrt(in_features)``."""
        bound = 1 / math.sqrt(self.in_features) if self.in_features else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def _cut_from(cls, linear: nn.Linear, group: Optional[Any], parts: int) -> Any:
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            group,
            linear.weight.device,
            linear.weight.dtype,
        )
        rank, size = collectives.rank(group), collectives.world_size(group)
        with torch.no_grad():
            layer.weight.copy_(cut(linear.weight, size, cls.cut_dim, parts)[rank])
            if layer.bias is not None:
                layer.bias.copy_(cut(linear.bias, size, 0, parts)[rank] if cls.cut_dim == 0 else linear.bias)
        for param in layer.parameters():
            if tensor_parallel_slice(param) is not None:
                mark_tensor_parallel(param, cls.cut_dim if param.dim() > 1 else 0, group, parts)
        return layer

    def extra_repr(self) -> str:
        local = self.weight.shape[1 - self.cut_dim]
        sizes = [f"in_features={self.in_features}", f"out_features={self.out_features}"]
        sizes[1 - self.cut_dim] += f" (this rank: {local})"
        return f"{', '.join(sizes)}, bias={self.bias is not None}"


class ColumnParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with its output features cut over ``group``: this rank computes
    ``out_features / t`` of them from the full (replicated) input. Its weight and bias are marked slices (dim 0).

    Initialized as ``nn.Linear`` initializes the full layer (the bounds use the full fan-in); ``from_linear``
    takes this rank's slice of an existing layer instead.
    """

    cut_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group: Optional[Any] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, group, device, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Optional[Any], parts: int = 1) -> "ColumnParallelLinear":
        """This rank's slice of ``linear`` (the same function of the input as ``linear``, once the slices are
        joined). ``parts``: the output features are that many equal blocks (a fused q/k/v projection: 3), each cut
        over the group, so that this rank computes its share of every block (its heads of q, k and v)."""
        return cls._cut_from(linear, group, parts)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(copy_to_tensor_parallel(x, self._group.talks_over), self.weight, self.bias)


class RowParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with its input features cut over ``group``: this rank multiplies its
    ``in_features / t`` input features (a ``ColumnParallelLinear``'s output) and the partial products are summed
    over the group. The weight is a marked slice (dim 1); the bias is replicated and added once, after the sum.
    """

    cut_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group: Optional[Any] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, group, device, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Optional[Any]) -> "RowParallelLinear":
        """This rank's slice of ``linear`` (the bias whole on every rank)."""
        return cls._cut_from(linear, group, 1)

    def forward(self, x: Tensor) -> Tensor:
        out = reduce_from_tensor_parallel(F.linear(x, self.weight), self._group.talks_over)
        return out + self.bias if self.bias is not None else out


def parallelize(module: nn.Module, tensor_group: Any, plan: dict[str, Any]) -> nn.Module:
    """``torch.distributed.tensor.parallel.parallelize_module``'s plan, carried out with this module's plain-tensor
    layers (ZeRO's buffers hold plain tensors, not DTensors): every ``nn.Linear`` whose name matches a key of
    ``plan`` (``fnmatch`` wildcards, as torch's: ``"blocks.*.mlp.0"``) is replaced by its slice,
    ``ColumnParallelLinear`` for ``ColwiseParallel()`` and ``RowParallelLinear`` for ``RowwiseParallel()``
    (torch's defaults: replicated input and sharded output, sharded input and replicated output, local outputs).
    ``tensor_group``: the process group or the 1-D ``DeviceMesh`` (``self.device_mesh["tensor_parallel"]``).
    Returns ``module``; anything the plan names that this cannot carry out is refused before anything is replaced.
    """
    group = tensor_group.get_group() if hasattr(tensor_group, "get_group") else tensor_group
    names = [name for name, _ in module.named_modules() if name]
    replacements: list[tuple[str, Any]] = []
    for pattern, style in plan.items():
        matched = [name for name in names if fnmatch.fnmatch(name, pattern)]
        if not matched:
            raise ValueError(f"parallelize: no submodule of {type(module).__name__} matches {pattern!r}.")
        layer = _layer_for(style, pattern)
        for name in matched:
            target = module.get_submodule(name)
            if type(target) is not nn.Linear:
                raise TypeError(
                    f"parallelize: {name!r} is a {type(target).__name__}; only nn.Linear layers are cut "
                    "here (write the others with `mark_tensor_parallel`)."
                )
            replacements.append((name, layer))
    for name, layer in replacements:
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, layer.from_linear(module.get_submodule(name), group))
    return module


def _layer_for(style: Any, pattern: str) -> type:
    """The layer class that carries out ``style`` (torch's ``ColwiseParallel`` / ``RowwiseParallel`` with their
    default layouts), or an error that says what is supported."""
    from torch.distributed.tensor import Replicate, Shard

    kind = type(style).__name__
    expected = {
        "ColwiseParallel": (Replicate(), Shard(-1), ColumnParallelLinear),
        "RowwiseParallel": (Shard(-1), Replicate(), RowParallelLinear),
    }
    if kind in expected:
        inputs, outputs, layer = expected[kind]
        if (style.input_layouts, style.output_layouts, style.use_local_output) == ((inputs,), (outputs,), True):
            return layer
    raise ValueError(
        f"parallelize: {pattern!r}: {kind} with these options is not supported; ZeRO takes "
        "`ColwiseParallel()` and `RowwiseParallel()` with their default layouts (for other layouts, "
        "sequence parallelism or embeddings, write the layer with `mark_tensor_parallel`)."
    )


def warn_if_nothing_is_sliced(module: nn.Module, tensor_parallel_size: int) -> None:
    """Say once (rank 0) that ``tensor_parallel_size`` is set but no parameter of ``module`` is a tensor-parallel
    slice."""
    if collectives.rank() != 0 or any(tensor_parallel_slice(p) is not None for p in module.parameters()):
        return
    warnings.warn(
        f"`tensor_parallel_size={tensor_parallel_size}` is set, but no parameter of {type(module).__name__} is a "
        "tensor-parallel slice: the ranks of each tensor group hold the same weights and see the same batches, so "
        "they compute the same thing. Cut the layers over `self.device_mesh['tensor_parallel']` in "
        "`configure_model` (lightning_zero.tensor_parallel's layers, or `mark_tensor_parallel` on your own), or "
        "leave `tensor_parallel_size` out.",
        UserWarning,
        stacklevel=4,
    )


def count_tensor_parallel(module: nn.Module, tensor: Group) -> None:
    """Count the collectives of ``module``'s parallel layers over ``tensor``'s process group in ``tensor``'s traffic
    (an engine does this at setup; see [Note: counted groups] in ``comm/traffic.py``). Layers over another group,
    and ``copy_to_tensor_parallel`` / ``reduce_from_tensor_parallel`` called with a bare group, count
    nowhere."""
    for layer in module.modules():
        if isinstance(layer, _ParallelLinear) and layer.group is tensor.process_group:
            layer._group.counted = tensor


def make_device_mesh(tensor_parallel_size: int, device_type: str = "cpu") -> Any:
    """Collective: the (``"data_parallel"``, ``"tensor_parallel"``) ``DeviceMesh`` of this job, the one
    ``ZeroEngine(tensor_parallel_size=...)`` shards over (made once; for plain loops that build their model
    before the engine)."""
    world = collectives.world_size()
    return GroupSizes.resolve(None, tensor_parallel_size, None, world, world, 1).make(device_type).mesh
