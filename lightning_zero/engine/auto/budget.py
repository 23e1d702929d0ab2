"""The memory ``zero_auto`` may use per rank, and the peak a run reached, both per device kind.

[Note: what peak means]
On CUDA the peak is ``torch.cuda.max_memory_allocated`` from the start of setup: the bytes of live tensors at their
highest (the caching allocator's reserve on top is not counted, as ``mem_get_info`` leaves it to the margin). On CPU
there is no allocator to ask, so the peak is the rank's resident memory: its high-water mark (``VmHWM``, reset to
the current level with ``/proc/self/clear_refs`` at the start of setup, after the heap's free memory is given
back with ``malloc_trim``) above its level then, the level less the
bytes the module's own tensors already held (a model built in ``__init__`` is part of the run's peak, not of the
level before it). ``benchmarks/memory.py`` measures "peak growth in fit" the same way.

[Note: the default budget]
CUDA: the device's free memory (``torch.cuda.mem_get_info``) at setup. CPU: the host's available memory
(``MemAvailable`` of ``/proc/meminfo``) divided among the ranks of this node. Either less ``MARGIN`` of it, which
is left to what no prediction sees: the allocator's reserve and fragmentation, the framework's own growth during
fit (threads, the collectives' transport buffers, the data loader) and, on CPU, the other processes of the host.
"""

from __future__ import annotations

import gc
from typing import Optional, Union

import torch

from lightning_zero.memory.account import reset_peak, status_bytes
from lightning_zero.memory.host_memory import give_back_free_heap
from lightning_zero.shards.accounting import parse_bytes

#: The part of the free memory the default budget leaves unused (see [Note: the default budget]).
MARGIN = 0.10


def default_budget(device: torch.device, local_ranks: int) -> float:
    """Bytes one rank may use when the user gave no ``memory_budget`` (see [Note: the default budget])."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * (1 - MARGIN)
    return available_host_memory() / max(1, local_ranks) * (1 - MARGIN)


def available_host_memory() -> float:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (psutil's figure where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil  # type: ignore[import-untyped]  # only where /proc is missing

    return float(psutil.virtual_memory().available)


def resolve_budget(value: Optional[Union[str, int, float]]) -> Optional[float]:
    """``memory_budget`` as bytes: a size with its unit (``"20GiB"``), a number of bytes, or ``None`` (the default)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"`memory_budget` must be a size such as '20GiB' or a number of bytes, got {value!r}.")
    if isinstance(value, str):
        return parse_bytes(value)
    if not value > 0:
        raise ValueError(f"`memory_budget` must be a positive number of bytes, got {value!r}.")
    return float(value)


class PeakMeter:
    """The peak of one rank from a start point on (see [Note: what peak means])."""

    def __init__(self, device: torch.device, held: int) -> None:
        """Start now; ``held``: bytes the module's own tensors hold now (part of the run's peak, not the level)."""
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.level = torch.cuda.memory_allocated(device) - held
        else:
            gc.collect()
            give_back_free_heap()  # the level is what is in use, not what an earlier run freed
            reset_peak()
            self.level = status_bytes("VmRSS") - held

    def peak(self) -> int:
        """Bytes above the level at the start, at their highest since."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.level
        return status_bytes("VmHWM") - self.level
