"""The slice marker: which parameters are one rank's slice of a larger tensor under tensor parallelism (the layers
and the plan are in ``tensor_parallel.py``; the layout, the reducer and the checkpoints read the marker)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

from lightning_zero.comm import collectives

_ATTRIBUTE = "_lightning_zero_tensor_parallel"


@dataclass(frozen=True)
class TensorParallelSlice:
    """Where a parameter sits in its full tensor: the full tensor is cut into ``size`` equal slices along ``dim``
    and this rank holds slice ``rank``; with ``parts > 1`` the full tensor is ``parts`` equal blocks along ``dim``
    (a fused q/k/v projection), each cut so, and the slice is this rank's piece of every block, in order."""

    dim: int
    rank: int
    size: int
    parts: int = 1


def mark_tensor_parallel(param: Tensor, dim: int, group: Optional[Any], parts: int = 1) -> Tensor:
    """Record that ``param`` is this rank's slice, along ``dim``, of a tensor cut over the tensor group ``group``
    (of ``parts`` blocks, each cut: see ``TensorParallelSlice``); it survives stage 3's construction on the
    meta device. Returns ``param``."""
    if not -param.dim() <= dim < max(param.dim(), 1):
        raise ValueError(
            f"mark_tensor_parallel: dim {dim} is out of range for a parameter of shape {tuple(param.shape)}."
        )
    setattr(
        param,
        _ATTRIBUTE,
        TensorParallelSlice(dim % max(param.dim(), 1), collectives.rank(group), collectives.world_size(group), parts),
    )
    return param


def tensor_parallel_slice(tensor: Tensor) -> Optional[TensorParallelSlice]:
    """The slice ``tensor`` is (see ``mark_tensor_parallel``), ``None`` for a replicated tensor."""
    found = getattr(tensor, _ATTRIBUTE, None)
    return found if found is not None and found.size > 1 else None
