"""What ``benchmarks._worker`` measures, the same way for every strategy: step time, bytes communicated, peak memory
and model-state bytes per rank.

[Note: one traffic counter for everybody]
:func:`count_collectives` wraps the ``torch.distributed`` collectives (``all_reduce``, the tensor all-gathers and
reduce-scatters under their old and new names, the list forms, ``broadcast``) *before* any strategy imports them,
and counts the logical payload with ``lightning_zero.comm.collectives``' rule: the input of a reduce-scatter, the output
of an all-gather, the tensor of an all-reduce or broadcast. DDP's C++ reducer does not go through Python, so the
``ddp`` run installs the stock ``allreduce_hook`` as its communication hook (:func:`counted_ddp_strategy`),
which calls ``dist.all_reduce`` once per gradient bucket (registered by hand: Lightning does it on CUDA only); FSDP2 and DeepSpeed call the Python functions
themselves. Point-to-point sends (``isend``, ``send``: lightning_zero's pairwise exchanges on gloo, see [Note:
reduce-scatter and all-gather on gloo] in ``lightning_zero/comm/collectives.py``) count as ``send``, the bytes this
rank sent. The counter runs only between the start and the end of a measured step.
"""

from __future__ import annotations

import functools
import os
import resource
import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

_COUNTS: dict[str, int] = defaultdict(int)
_CALLS: dict[str, int] = defaultdict(int)
_ACTIVE = [False]

# name in torch.distributed -> (kind, which argument holds the payload: index or keyword)
_PAYLOAD: dict[str, tuple[str, int, str]] = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "_all_gather_base": ("all_gather", 0, "output_tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "_reduce_scatter_base": ("reduce_scatter", 1, "input"),
    "all_gather": ("all_gather", 0, "tensor_list"),
    "reduce_scatter": ("reduce_scatter", 1, "input_list"),
    "all_reduce_coalesced": ("all_reduce", 0, "tensors"),
    "isend": ("send", 0, "tensor"),
    "send": ("send", 0, "tensor"),
}


def _nbytes(payload: Any) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, (list, tuple)):
        return sum(_nbytes(t) for t in payload)
    return 0


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    kind, index, keyword = _PAYLOAD[name]

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE[0] and dist.get_world_size(kwargs.get("group")) > 1:
            payload = args[index] if len(args) > index else kwargs.get(keyword)
            _COUNTS[kind] += _nbytes(payload)
            _CALLS[kind] += 1
        return fn(*args, **kwargs)

    counted.__wrapped_by_bench__ = True  # type: ignore[attr-defined]
    return counted


def count_collectives() -> None:
    """Wrap the collectives of ``torch.distributed`` (call before importing any strategy; see the note)."""
    for name in _PAYLOAD:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "__wrapped_by_bench__", False):
            setattr(dist, name, _wrap(name, fn))


def traffic_start() -> None:
    """Start counting from zero."""
    _COUNTS.clear()
    _CALLS.clear()
    _ACTIVE[0] = True


def traffic_stop() -> dict[str, dict[str, int]]:
    """Stop counting; the bytes and calls per collective kind since :func:`traffic_start`."""
    _ACTIVE[0] = False
    return {"bytes": dict(_COUNTS), "calls": dict(_CALLS)}


def counted_ddp_strategy(**kwargs: Any) -> Any:
    """Lightning's ``DDPStrategy`` with DDP's stock all-reduce communication hook, on CPU too (Lightning registers
    hooks on CUDA only): the same collective as the C++ default, but issued through the counted ``dist.all_reduce``."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    class CountedDDPStrategy(DDPStrategy):
        def _register_ddp_hooks(self) -> None:
            self.model.register_comm_hook(state=None, hook=allreduce_hook)  # type: ignore[union-attr]

    return CountedDDPStrategy(**kwargs)


# ---------------------------------------------------------------------- memory
def peak_memory(device: torch.device) -> int:
    """Peak bytes of this process: ``torch.cuda.max_memory_allocated`` on a GPU, else the resident high-water mark
    (``VmHWM``; it never goes down, hence one configuration per process)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_memory() -> int:
    """Resident bytes of this process now (``VmRSS``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_memory() -> None:
    """Reset the resident high-water mark to the current level.

    [Note: phases]
    Writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0) sets ``VmHWM`` to the current ``VmRSS``, so the peak
    of one phase of a step (forward, backward, reduce, optimizer step) can be read at its end without tracing
    allocations. ``benchmarks._worker``'s ``PhaseProbe`` reads and resets it at the Lightning hooks between phases.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors: Iterable[Optional[Any]]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors count their local shard)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = _local(t)
        if t.numel() == 0 or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def reachable_tensors(obj: Any, depth: int = 3, _seen: Optional[set[int]] = None) -> list[torch.Tensor]:
    """Tensors reachable from ``obj``'s attributes, lists, tuples and dicts, ``depth`` levels deep (DeepSpeed's
    engines keep their flat buffers and partitions in attributes of that kind)."""
    seen = _seen if _seen is not None else set()
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children: Iterable[Any] = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        children = list(vars(obj).values())
    else:
        return []
    return [t for child in children for t in reachable_tensors(child, depth - 1, seen)]


# ---------------------------------------------------------------------- time
class StepTimer:
    """Wall-clock time of each step (synchronized on a GPU); steps before ``warmup`` are not measured."""

    def __init__(self, warmup: int, device: torch.device) -> None:
        self.warmup = warmup
        self.device = device
        self.times: list[float] = []
        self.cpu: list[float] = []
        """CPU seconds of the process (every thread, user and system) per measured step: less noisy than wall time on
        a shared machine."""
        self.faults: list[int] = []
        """Minor page faults per measured step (fresh pages: a freed-and-remade allocation shows here)."""
        self.traffic: list[dict[str, dict[str, int]]] = []
        self._step = 0
        self._t0 = 0.0
        self._cpu0 = 0.0
        self._faults0 = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._step >= self.warmup:
            traffic_start()
        self._faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self._cpu0 = time.process_time()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self._t0
        cpu = time.process_time() - self._cpu0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self._faults0
        self.last = elapsed
        """The step just timed, warm-up or not."""
        self.measured_last = self._step >= self.warmup
        """Whether the step just timed was measured (past warm-up)."""
        if self._step >= self.warmup:
            self.traffic.append(traffic_stop())
            self.times.append(elapsed)
            self.cpu.append(cpu)
            self.faults.append(faults)
        self._step += 1

    def summary(self) -> dict[str, Any]:
        return {"step_times": self.times, "median_step": statistics.median(self.times) if self.times else None,
                "step_cpu": self.cpu, "step_faults": self.faults,
                "traffic": self.traffic[-1] if self.traffic else {"bytes": {}, "calls": {}}}


def threads_per_rank(world_size: int) -> int:
    """CPU threads per rank so that ranks × threads stays within the machine's cores."""
    return max(1, (os.cpu_count() or 1) // world_size)
