"""Tensor parallelism for ZeRO over the data dimension: Megatron's column- and row-parallel linear layers, and how a
module tells ZeRO which of its parameters are slices of larger tensors.

Under ``ZeroStrategy(tensor_parallel_size=t)`` (or Fabric's, or ``ZeroEngine``'s option) the ranks form a
(data x tensor) ``DeviceMesh``; ``configure_model`` gets it as ``self.device_mesh`` and builds its layers over
``self.device_mesh["tensor_parallel"]``. ZeRO then partitions each rank's slices over ``"data_parallel"`` (see
[Note: ZeRO over the data dimension] in ``engine/collectives.py``)::

    def configure_model(self):
        tp = self.device_mesh["tensor_parallel"].get_group()
        self.up = ColumnParallelLinear(width, 4 * width, group=tp)     # this rank: 4 * width / t output features
        self.down = RowParallelLinear(4 * width, width, group=tp)      # this rank: 4 * width / t input features

A layer written by hand marks its sliced parameters with :func:`mark_tensor_parallel`; every unmarked parameter
is taken to be replicated over the tensor group (the same values and gradients on each of its ranks, as a
LayerNorm between parallel layers is). DTensor parameters (``torch.distributed.tensor.parallel``) are not
supported: ZeRO's flat buffers hold plain tensors.

[Note: Megatron's f and g]
A column-parallel layer takes a replicated input and gives each rank a slice of the output features; a row-parallel
layer takes those slices and sums the partial products over the tensor group. The two conjugate operators make the
gradients right: ``f`` (:func:`copy_to_tensor_parallel`) is the identity forward and sums the input gradient over
the group backward (each rank computed the gradient through its own slice only); ``g``
(:func:`reduce_from_tensor_parallel`) sums forward and is the identity backward. A replicated parameter then gets
the same gradient on every rank of the group, and a sliced one the gradient of its slice of the full tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_zero.engine import collectives

_ATTRIBUTE = "_lightning_zero_tensor_parallel"


@dataclass(frozen=True)
class TensorParallelSlice:
    """Where a parameter sits in its full tensor: the full tensor is cut into ``size`` equal slices along ``dim``
    and this rank holds slice ``rank``."""

    dim: int
    rank: int
    size: int


def mark_tensor_parallel(param: Tensor, dim: int, group: Optional[Any]) -> Tensor:
    """Record that ``param`` is this rank's slice, along ``dim``, of a tensor cut over the tensor group ``group``
    (it survives stage 3's construction on the meta device); returns ``param``."""
    if not -param.dim() <= dim < max(param.dim(), 1):
        raise ValueError(f"mark_tensor_parallel: dim {dim} is out of range for a parameter of shape "
                         f"{tuple(param.shape)}.")
    setattr(param, _ATTRIBUTE, TensorParallelSlice(dim % max(param.dim(), 1), collectives.rank(group),
                                                   collectives.world_size(group)))
    return param


def tensor_parallel_slice(tensor: Tensor) -> Optional[TensorParallelSlice]:
    """The slice ``tensor`` is (see :func:`mark_tensor_parallel`), ``None`` for a replicated tensor."""
    found = getattr(tensor, _ATTRIBUTE, None)
    return found if found is not None and found.size > 1 else None


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


def _slice_size(features: int, group: Optional[Any], what: str) -> int:
    size = collectives.world_size(group)
    if features % size:
        raise ValueError(f"{what}={features} does not split over a tensor group of {size} ranks: make it a multiple "
                         f"of {size}.")
    return features // size


class ColumnParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with its output features cut over ``group``: this rank computes
    ``out_features / t`` of them from the full (replicated) input. Its weight and bias are marked slices (dim 0).

    Initialized as ``nn.Linear`` initializes the full layer (the bounds use the full fan-in); :meth:`from_linear`
    takes this rank's slice of an existing layer instead.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: Optional[Any] = None,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.group = group
        self.in_features, self.out_features = in_features, out_features
        local = _slice_size(out_features, group, "out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype)) if bias else None
        mark_tensor_parallel(self.weight, 0, group)
        if self.bias is not None:
            mark_tensor_parallel(self.bias, 0, group)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization: uniform in ``±1/sqrt(in_features)``."""
        bound = 1 / math.sqrt(self.in_features) if self.in_features else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Optional[Any]) -> "ColumnParallelLinear":
        """This rank's slice of ``linear`` (the same function of the input as ``linear``, once the slices are
        joined)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group,
                    linear.weight.device, linear.weight.dtype)
        rank, local = collectives.rank(group), layer.weight.shape[0]
        with torch.no_grad():
            layer.weight.copy_(linear.weight[rank * local : (rank + 1) * local])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias[rank * local : (rank + 1) * local])
        return layer

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(copy_to_tensor_parallel(x, self.group), self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{self.weight.shape[0]}), bias={self.bias is not None}")


class RowParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with its input features cut over ``group``: this rank multiplies its
    ``in_features / t`` input features (a :class:`ColumnParallelLinear`'s output) and the partial products are summed
    over the group. The weight is a marked slice (dim 1); the bias is replicated and added once, after the sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: Optional[Any] = None,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.group = group
        self.in_features, self.out_features = in_features, out_features
        local = _slice_size(in_features, group, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        mark_tensor_parallel(self.weight, 1, group)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization of the full layer: uniform in ``±1/sqrt(in_features)``."""
        bound = 1 / math.sqrt(self.in_features) if self.in_features else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Optional[Any]) -> "RowParallelLinear":
        """This rank's slice of ``linear`` (the bias whole on every rank)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group,
                    linear.weight.device, linear.weight.dtype)
        rank, local = collectives.rank(group), layer.weight.shape[1]
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, rank * local : (rank + 1) * local])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        out = reduce_from_tensor_parallel(F.linear(x, self.weight), self.group)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), "
                f"out_features={self.out_features}, bias={self.bias is not None}")


def make_device_mesh(tensor_parallel_size: int, device_type: str = "cpu") -> Any:
    """Collective: the (``"data_parallel"``, ``"tensor_parallel"``) ``DeviceMesh`` of this job, the one
    ``ZeroEngine(tensor_parallel_size=...)`` shards over (made once; for plain loops that build their model
    before the engine)."""
    world = collectives.world_size()
    return collectives.make_shard_groups(world // tensor_parallel_size, tensor_parallel_size, device_type).mesh
