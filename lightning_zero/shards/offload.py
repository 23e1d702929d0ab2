"""ZeRO-Offload (arXiv:2101.06840) of the optimizer: master shard, optimizer states and the step in host memory.

[Note: what lives where with offload_optimizer=True]
Device (the rank's accelerator): the working parameters (the flat buffer of stages 1 and 2, the working shard and
gathered units of stage 3; with ``offload_params`` only the units in flight), stage 1's full ``.grad`` between
backward and the step, and the gradient bucket pool with its scratch chunks. No reduced gradient shard: its device
memory is the pool's, constant in the model size.
Host: the master shard (always a tensor of its own, even where the master dtype equals the working dtype, so that
the update never writes the device's memory directly), the gradient shard in the master dtype, and whatever state
the user's optimizer makes for its tensors (``exp_avg`` ... are ``zeros_like`` the host masters). One step:

1. each bucket's reduced chunk goes from a device scratch chunk into the host gradient shard as soon as its
   reduction completes (see [Note: the gradient shard goes to the host bucket by bucket]); the master tensors'
   ``.grad`` are views of that shard; unscaling, clipping and the overflow check act on these host gradients;
2. the user's optimizer steps on the host masters (the CPU step);
3. ``refresh_working`` copies the updated master shard into the device's working parameters (and all-gathers them
   under stages 1 and 2), exactly where a non-offloaded run copies its device master shard. From pinned memory the
   copies are asynchronous (``copy_to_device``), so stages 1 and 2 overlap each bucket's upload with the
   all-gathers of the buckets before it, and stage 3's upload with what follows the step.

[Note: the uploads of the update do not block]
The host master is written again only by the next optimizer step (or a checkpoint load), and before that step reads
or writes the host buffers it waits for the events of the gradient copies of the next backward (or reduction),
which are ordered on the device's stream after these uploads; a load settles first. So an asynchronous upload
always reads the values of the step that issued it, and the CPU never waits for it.

The host tensors are pinned when the working device is a CUDA GPU (fast, asynchronous copies) and ordinary CPU
tensors otherwise. On a CPU-only machine the host and the device are both CPU memory, but the host buffers are still
separate storages and every copy above still happens, so CPU tests exercise the whole offloaded path.

[Note: offloading and checkpoints]
The master views and optimizer states a checkpoint reads and writes are the host tensors: the checkpoint's format
does not depend on where they live, so an offloaded run resumes a non-offloaded checkpoint and vice versa.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.shards import disk
from lightning_zero.shards.layout import Bucket
from lightning_zero.shards.optimizer_support import optimizer_name, user_class

HOST = torch.device("cpu")
#: Elements per piece of a copy to or from a disk-tier shard (see [Note: the step one window at a time] in disk.py).
DISK_COPY_ELEMENTS = 4_000_000
#: torch optimizers with fused CPU kernels: their CPU step reaches the memory bandwidth, the default loop does not.
FUSED_ON_CPU = ("torch.optim.Adam", "torch.optim.AdamW")


def pins(device: torch.device) -> bool:
    """Whether host buffers for ``device`` are pinned (page-locked): only for CUDA devices, where it is possible."""
    return device.type == "cuda" and torch.cuda.is_available()


def host_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zeroed host tensor of ``numel`` elements staging data for ``device`` (pinned where ``pins``)."""
    return torch.zeros(numel, dtype=dtype, device=HOST, pin_memory=pins(device))


def copy_to_device(target: Tensor, source: Tensor) -> None:
    """``target.copy_(source)``, asynchronous when ``source`` is pinned host memory and ``target`` is on a CUDA device
    (see [Note: the uploads of the update do not block]); window by window where a side is on disk (``disk.py``)."""
    disk.copy_windowed(target, source, DISK_COPY_ELEMENTS, _copy)


def _copy(target: Tensor, source: Tensor) -> None:
    with torch.no_grad():
        target.copy_(source, non_blocking=target.device.type == "cuda" and source.is_pinned())


def allocate_master(
    numel: int, dtype: torch.dtype, device: torch.device, offload: Union[bool, str], path: Optional[str] = None
) -> Tensor:
    """A shard (the master, or stage 3's working shard with ``offload_params``): on the host (see [Note: what lives
    where ...]) with ``offload=True``, in a file under ``path`` with ``offload="disk"`` (see [Note: what lives on
    disk] in ``disk.py``), else on ``device``."""
    if offload == disk.DISK:
        return disk.zeros(numel, dtype, path)
    if offload:
        return host_zeros(numel, dtype, device)
    return torch.zeros(numel, dtype=dtype, device=device)


class HostGrads:
    """A storage's reduced gradient shard, in host memory and the master dtype: the reducer's
    ``GradSink`` (step 1 of [Note: what lives where ...]).

    [Note: the gradient shard goes to the host bucket by bucket]
    No gradient shard exists on the device. Each bucket's reduce-scatter (and, under hybrid sharding, the replica
    all-reduce) writes into a scratch chunk of the reducer's bucket pool, and ``write`` moves that chunk here:
    the first reduction of a bucket after ``zero_grad`` copies it into its slice of the host buffer (cast to the
    master dtype), a later one (gradient accumulation) adds it in the master dtype. Zeroing (buckets that got no
    gradient, another optimizer's ``zero_grad`` of borrowed parameters) is done here too. So the host buffer is the
    one gradient shard, complete whenever the reducer is idle and ``shard`` returned.

    On CPU the copies and additions are done at once. On CUDA (pinned memory) they are asynchronous and ordered on
    the current stream after the reduction they follow, so they overlap with the rest of backward: a first write
    copies straight into the host slice; an accumulation copies into a pinned staging chunk (a small pool, constant
    size) whose addition to the host slice runs on the CPU once the copy has landed. Every copy records a CUDA
    event, kept in issue order: it is returned to the reducer, whose slot waits for it before the scratch chunk is
    written again ([Note: a sink instead of a device shard] in ``bucket_slots.py``), and the host side waits for it (and
    so, in issue order, for every earlier copy, among them the first write of the slice an addition lands on)
    before any CPU read or write of the buffer: an addition, a zeroing, ``shard`` before the step.
    ``clear`` waits for what is in flight and drops pending additions (their gradients were cleared).

    The buffer and the staging chunks are made on first use and kept (pinned memory is slow to allocate).
    """

    def __init__(
        self, numel: int, dtype: torch.dtype, device: torch.device, chunk_elements: int = 0, staging_chunks: int = 2
    ) -> None:
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.asynchronous = pins(device)
        self.chunk_elements = chunk_elements
        """The largest bucket chunk (the size of a staging chunk)."""
        self.staging_chunks = max(1, staging_chunks)
        self.buffer: Optional[Tensor] = None
        self.staging: list[Tensor] = []
        """Pinned staging chunks ever made (CUDA accumulation only; at most ``staging_chunks``)."""
        self._spare: list[Tensor] = []
        self._in_flight: deque[tuple[Any, Optional[Tensor], Tensor]] = deque()  # (event, staging, host slice)

    # ------------------------------------------------------------------ the reducer's sink
    def write(self, bucket: Bucket, chunk: Tensor, accumulate: bool) -> Optional[Any]:
        """Copy ``bucket``'s reduced ``chunk`` (a device scratch chunk) into its host slice, or add it there with
        ``accumulate``; returns the CUDA event after which ``chunk`` may be overwritten (``None`` on CPU)."""
        target = self._buffer()[bucket.shard_offset : bucket.shard_offset + bucket.chunk_size]
        with torch.no_grad():
            if not self.asynchronous:
                if accumulate:
                    target.add_(chunk)
                else:
                    target.copy_(chunk)
                return None
            staging = self._take_staging() if accumulate else None
            (staging[: chunk.numel()] if staging is not None else target).copy_(chunk, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._in_flight.append((event, staging, target))
        return event

    def zero(self, start: int, end: int) -> None:
        """Zero ``[start, end)`` of the host shard (after every copy in flight has landed)."""
        self._land()
        with torch.no_grad():
            self._buffer()[start:end].zero_()

    def shard(self) -> Tensor:
        """The host shard, once every copy into it has landed and every addition is done."""
        self._land()
        return self._buffer()

    def clear(self) -> None:
        """Wait for the copies in flight and drop the pending additions (the gradients were cleared)."""
        self._land(apply=False)

    # ------------------------------------------------------------------ internals
    def _land(self, apply: bool = True, until_spare: bool = False) -> None:
        """Wait for the copies in flight in issue order, doing their additions (``apply``); with ``until_spare``
        only until a staging chunk is free."""
        while self._in_flight and not (until_spare and self._spare):
            event, staging, target = self._in_flight.popleft()
            event.synchronize()
            if staging is not None:
                if apply:
                    with torch.no_grad():
                        target.add_(staging[: target.numel()])
                self._spare.append(staging)

    def _take_staging(self) -> Tensor:
        if not self._spare and len(self.staging) < self.staging_chunks:
            self.staging.append(host_zeros(self.chunk_elements, self.dtype, self.device))
            return self.staging[-1]
        self._land(until_spare=True)
        return self._spare.pop()

    def _buffer(self) -> Tensor:
        if self.buffer is None:
            self.buffer = host_zeros(self.numel, self.dtype, self.device)
        return self.buffer


def check_steps_on_host(optimizer: Optimizer) -> None:
    """Refuse, at setup, an optimizer that cannot step on CPU tensors (offload runs its step on the host).

    torch's own optimizers step on CPU tensors except with ``capturable=True`` (CUDA graphs) or ``fused=True`` on a
    torch without CPU fused kernels; for those, and for any other optimizer class, one step on a two-element CPU
    tensor of a fresh instance with the same defaults tells. An instance that cannot be made that way is not probed
    (its errors then come from the first step).
    """
    cls = user_class(optimizer)
    special = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    if cls.__module__.startswith("torch.optim") and not special:
        return
    probe_param = torch.zeros(2, requires_grad=True)
    try:
        probe = cls([probe_param], **optimizer.defaults)
    except Exception:
        return
    probe_param.grad = torch.zeros(2)
    try:
        probe.step()
    except Exception as error:
        name = f"{cls.__module__}.{cls.__qualname__}"
        raise TypeError(
            f"`offload_optimizer=True` runs the optimizer step on CPU tensors, but {name} failed to step on one "
            f"({type(error).__name__}: {error}). Use an optimizer with a CPU implementation (e.g. torch.optim.AdamW, "
            "without `fused=True` on a torch that lacks CPU fused kernels), or set `offload_optimizer=False`."
        ) from error


def fused_hint(optimizer: Optimizer) -> Optional[str]:
    """Advice for an offloaded torch Adam/AdamW without ``fused=True``, whose CPU step is then several times slower.

    [Note: the fast CPU step is the user's choice]
    ``benchmarks/offload.py`` times AdamW's CPU step with its default implementation, ``foreach=True`` and
    ``fused=True`` against the memory-bandwidth bound: only ``fused=True`` comes near the bound (benchmarks/RESULTS.md,
    "The CPU step against the memory-bandwidth bound"). The optimizer's options stay the user's, so this is advice,
    not a change.
    """
    name = optimizer_name(optimizer)
    if name not in FUSED_ON_CPU or optimizer.defaults.get("fused"):
        return None
    return (
        f"`offload_optimizer=True` runs {name}'s step on the CPU, where its default implementation is several "
        f"times slower than `fused=True` (see benchmarks/RESULTS.md). Create it with `{name}(..., fused=True)` for "
        "the fastest offloaded step."
    )
