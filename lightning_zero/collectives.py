"""The only module that calls ``torch.distributed``; it counts what every collective moves.

[Note: what the counters count]
Each collective adds the *logical payload* it moves to its kind: the full input of a reduce-scatter, the full output
of an all-gather, the tensor of an all-reduce or broadcast. That is the unit of the ZeRO paper's traffic column: a
stage 1 or 2 step moves Ψ elements by reduce-scatter and Ψ by all-gather (2Ψ, the same as DDP's one all-reduce of
Ψ), stage 3 adds a second all-gather. Bytes on the wire depend on the algorithm (a ring moves about twice the payload
times ``(N - 1) / N``) and are not what is compared. A process group of one rank moves nothing and counts nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

# torch >= 2.12 renames the tensor collectives; older releases (the GPU machines run 2.11) only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Traffic:
    """Payload moved per collective kind since the last :meth:`reset`, in bytes and in elements."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    elements: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        """Count ``tensor`` as the payload of one ``kind`` collective."""
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.elements[kind] += tensor.numel()
        self.calls[kind] += 1

    def reset(self) -> None:
        """Start counting from zero."""
        self.bytes.clear()
        self.elements.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A plain copy: ``{"bytes": {...}, "elements": {...}, "calls": {...}}``."""
        return {"bytes": dict(self.bytes), "elements": dict(self.elements), "calls": dict(self.calls)}


#: Counters of this process. Tests and benchmarks reset and read them around the steps they measure.
TRAFFIC = Traffic()


class _DoneWork:
    """Stands in for a ``dist.Work`` handle when nothing had to be communicated."""

    def wait(self) -> bool:
        return True


DIVERGENCE_HINT = (
    "The ranks probably issued different collectives (data-dependent control flow, or a rank that skipped a step). "
    "Every rank must run the same modules in the same order; under zero3 prefer zero2 for models whose ranks take "
    "different branches."
)


def wait(work: Any, what: str) -> None:
    """Wait for ``work``; a failure (a peer that never joined, the process group timeout) says what was waited for."""
    try:
        work.wait()
    except RuntimeError as error:
        raise RuntimeError(f"ZeRO could not {what}: {error}. {DIVERGENCE_HINT}") from error


def is_distributed(group: Optional[Any] = None) -> bool:
    """Whether a process group of more than one rank is there to talk to."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def world_size(group: Optional[Any] = None) -> int:
    """Ranks in ``group``; 1 without a process group."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rank(group: Optional[Any] = None) -> int:
    """This process's rank in ``group``; 0 without a process group."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None, async_op: bool = False) -> Any:
    """Sum ``input`` (``world_size`` equal chunks) over ranks; this rank's chunk of the sum lands in ``output``."""
    if not is_distributed(group):
        output.copy_(input)
        return _DoneWork()
    TRAFFIC.add("reduce_scatter", input)
    work = _reduce_scatter_single(output, input, group=group, async_op=async_op)
    return work if async_op else _DoneWork()


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None, async_op: bool = False) -> Any:
    """Concatenate every rank's ``input`` into ``output``; ``input`` may be this rank's slice of ``output``."""
    if not is_distributed(group):
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _DoneWork()
    TRAFFIC.add("all_gather", output)
    work = _all_gather_single(output, input, group=group, async_op=async_op)
    return work if async_op else _DoneWork()


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Optional[Any] = None) -> torch.Tensor:
    """In-place all-reduce (sum unless ``op`` says otherwise); returns ``tensor``."""
    if is_distributed(group):
        TRAFFIC.add("all_reduce", tensor)
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=group)
    return tensor


def broadcast(tensor: torch.Tensor, src: int = 0, group: Optional[Any] = None) -> torch.Tensor:
    """In-place broadcast from global rank ``src``; returns ``tensor``."""
    if is_distributed(group):
        TRAFFIC.add("broadcast", tensor)
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def barrier(device: Optional[torch.device] = None) -> None:
    """Wait for every rank (NCCL needs to know this rank's device)."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl" and device is not None and device.index is not None:
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s (picklable) ``obj`` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src)
    return holder[0]


MAX = dist.ReduceOp.MAX


def gather_objects(obj: Any, dst: int = 0, group: Optional[Any] = None) -> Optional[list[Any]]:
    """Pickle ``obj`` from every rank to ``dst``: the list on ``dst``, ``None`` elsewhere."""
    if not is_distributed(group):
        return [obj]
    out: Optional[list[Any]] = [None] * world_size(group) if rank(group) == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def all_gather_objects(obj: Any, group: Optional[Any] = None) -> list[Any]:
    """Pickle ``obj`` from every rank to every rank."""
    if not is_distributed(group):
        return [obj]
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def new_group(rank_lists: list[list[int]]) -> Optional[Any]:
    """Make one process group per list of global ranks (every rank must call this with the same lists) and return
    the one this rank belongs to, ``None`` if none."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    me, mine = dist.get_rank(), None
    for ranks in rank_lists:
        group = dist.new_group(sorted(ranks))
        if me in ranks:
            mine = group
    return mine
