"""What a training step costs this process, counted without a clock: the engine's own large allocations, the bytes
it copies, and the minor page faults of the process.

[Note: what a step costs]
Wall-clock time on a shared machine is noise; these counts are not. Every buffer the engine makes for use within a
step (stage 3's unit memory, gradient buckets and the gradient shard, scratch of the quantized exchanges) comes from
``empty``, which counts it once it is ``LARGE_BYTES`` or more; bulk copies the engine makes of gradients and
parameters (into buckets, out of hpZ's secondary copies, uploads) are counted by ``count_copy``. After warm-up a
step should allocate nothing large of its own (see [Note: the engine owns its memory] in ``stage3/pool.py``), copy
about Ψ elements (the gradients into their buckets, as DDP's reducer does), and take about as many minor page
faults as DDP's step: a fault is a fresh page, so memory freed and made again shows here whichever allocator made
it. The counters are per process (the allocator and the page tables are too); ``ZeroEngine.step_costs`` reads their
differences from one call to the next.
"""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

#: Allocations of at least this many bytes are counted as large.
LARGE_BYTES = 1 << 20


@dataclass
class Costs:
    """Running totals since the process started (see [Note: what a step costs])."""

    large_allocations: int = 0
    """Allocations of ``LARGE_BYTES`` or more made through ``empty``."""
    allocated_bytes: int = 0
    """Their bytes."""
    copied_bytes: int = 0
    """Bytes of gradients and parameters the engine copied (``count_copy``)."""

    def snapshot(self) -> dict[str, int]:
        """The totals now, with the process's minor page faults."""
        return {**asdict(self), "minor_faults": minor_faults()}


# [Note: the cost counters are the process's]
# `COSTS` is one object per process, not the engine's: the allocator and the page tables it counts are the
# process's, and `empty` is called from every layer that makes a buffer (buckets, the unit pool, staging, quantized
# scratch), most of which hold no engine. Each engine reads differences from its own mark (`step_costs`), so several
# engines in one process (Fabric with two models) each see what the process spent since their last call.
COSTS = Costs()
"""The process's counters (see [Note: the cost counters are the process's])."""


def empty(numel: int, dtype: torch.dtype, device: Any, pin_memory: bool = False) -> Tensor:
    """``torch.empty`` of the engine's own buffers, counted when large."""
    tensor = torch.empty(numel, dtype=dtype, device=device, pin_memory=pin_memory)
    count_allocation(tensor.numel() * tensor.element_size())
    return tensor


def count_allocation(nbytes: int) -> None:
    """Count an allocation of ``nbytes`` made elsewhere (a storage given memory again by ``resize_``)."""
    if nbytes >= LARGE_BYTES:
        COSTS.large_allocations += 1
        COSTS.allocated_bytes += nbytes


def count_copy(tensor: Tensor) -> None:
    """Count a copy of ``tensor``'s bytes made by the engine."""
    COSTS.copied_bytes += tensor.numel() * tensor.element_size()


def minor_faults() -> int:
    """Minor page faults of this process so far (fresh pages the kernel had to map)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """``after - before`` per counter."""
    return {key: value - before.get(key, 0) for key, value in after.items()}
