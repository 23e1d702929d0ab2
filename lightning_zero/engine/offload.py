"""ZeRO-Offload (arXiv:2101.06840) of the optimizer: master shard, optimizer states and the step in host memory.

[Note: what lives where with offload_optimizer=True]
Device (the rank's accelerator): the working parameters (the flat buffer of stages 1 and 2, the working shard and
gathered units of stage 3), the gradient bucket buffers and the reduced gradient shard in the working dtype.
Host: the master shard (always a tensor of its own, even where the master dtype equals the working dtype, so that
the update never writes the device's memory directly), a gradient shard in the master dtype, and whatever state the
user's optimizer makes for its tensors (``exp_avg`` ... are ``zeros_like`` the host masters). One step:

1. each bucket's slice of the reduced gradient shard is copied from the device into the host gradient buffer as
   soon as it is written (see [Note: the gradient shard goes to the host bucket by bucket]); the master tensors'
   ``.grad`` are views of that buffer; unscaling, clipping and the overflow check act on these host copies;
2. the user's optimizer steps on the host masters (the CPU step);
3. ``refresh_working`` copies the updated master shard into the device's working parameters (and all-gathers them
   under stages 1 and 2), exactly where a non-offloaded run copies its device master shard. These copies block:
   the host masters may change again as soon as they return.

The host tensors are pinned when the working device is a CUDA GPU (fast, asynchronous copies) and ordinary CPU
tensors otherwise. On a CPU-only machine the host and the device are both CPU memory, but the host buffers are still
separate storages and every copy above still happens, so CPU tests exercise the whole offloaded path.

[Note: offloading and checkpoints]
The master views and optimizer states a checkpoint reads and writes are the host tensors: the checkpoint's format
does not depend on where they live, so an offloaded run resumes a non-offloaded checkpoint and vice versa.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.engine.buckets import GradientReducer
from lightning_zero.engine.layout import Bucket
from lightning_zero.engine.optimizer_support import optimizer_name, user_class

HOST = torch.device("cpu")
#: torch optimizers with fused CPU kernels: their CPU step reaches the memory bandwidth, the default loop does not.
FUSED_ON_CPU = ("torch.optim.Adam", "torch.optim.AdamW")


def pins(device: torch.device) -> bool:
    """Whether host buffers for ``device`` are pinned (page-locked): only for CUDA devices, where it is possible."""
    return device.type == "cuda" and torch.cuda.is_available()


def host_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zeroed host tensor of ``numel`` elements staging data for ``device`` (pinned where :func:`pins`)."""
    return torch.zeros(numel, dtype=dtype, device=HOST, pin_memory=pins(device))


def allocate_master(numel: int, dtype: torch.dtype, device: torch.device, offload: bool) -> Tensor:
    """A shard (the master, or stage 3's working shard with ``offload_params``): on the host (see [Note: what lives
    where ...]) with ``offload``, else on ``device``."""
    if offload:
        return host_zeros(numel, dtype, device)
    return torch.zeros(numel, dtype=dtype, device=device)


class HostGrads:
    """The host copy of one engine's reduced gradient shard, in the master dtype (step 1 of [Note: what lives ...]).

    [Note: the gradient shard goes to the host bucket by bucket]
    The reducer calls :meth:`copy_bucket` whenever a bucket's slice of the device gradient shard has just been
    written: reduced (under stage 2 and 3 during backward, as each bucket's reduce-scatter completes), accumulated,
    zeroed because no gradient reached it, or cleared by another optimizer's ``zero_grad``. Every write to the device
    shard is therefore followed by a copy of that slice, and the host buffer equals the device shard (cast to the
    master dtype) whenever the reducer is idle. With pinned memory (CUDA) the copies are asynchronous, ordered on the
    current stream after the write they follow, so they overlap with the rest of backward; :meth:`ready` waits for
    the device before the CPU step reads the buffer. Under gradient accumulation each micro-batch copies again (only
    the last copy is read): the price of not waiting for the step to start the transfer.

    The buffer is made on first use and kept (pinned memory is slow to allocate).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.asynchronous = pins(device)
        self.buffer: Optional[Tensor] = None
        self._pending = False

    def follow(self, reducer: GradientReducer) -> None:
        """Copy every bucket ``reducer`` writes into its gradient shard from now on (see the note above)."""
        reducer.on_reduced = lambda bucket: self.copy_bucket(reducer.grad_shard, bucket)

    def copy_bucket(self, shard: Optional[Tensor], bucket: Bucket) -> None:
        """Copy ``bucket``'s slice of the device gradient shard ``shard`` into the host buffer."""
        if shard is None:
            return
        end = bucket.shard_offset + bucket.chunk_size
        with torch.no_grad():
            self._buffer()[bucket.shard_offset : end].copy_(shard[bucket.shard_offset : end],
                                                            non_blocking=self.asynchronous)
        self._pending = self.asynchronous

    def ready(self) -> Tensor:
        """The host buffer, once every copy into it has landed."""
        if self._pending:  # the copies may have been issued from autograd's threads, on their streams: wait for all
            torch.cuda.synchronize(self.device)
            self._pending = False
        return self._buffer()

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
    except Exception:  # noqa: BLE001 - a constructor we cannot call with its defaults: nothing to probe
        return
    probe_param.grad = torch.zeros(2)
    try:
        probe.step()
    except Exception as error:  # noqa: BLE001 - any failure means the same thing to the user
        name = f"{cls.__module__}.{cls.__qualname__}"
        raise TypeError(
            f"`offload_optimizer=True` runs the optimizer step on CPU tensors, but {name} failed to step on one "
            f"({type(error).__name__}: {error}). Use an optimizer with a CPU implementation (e.g. torch.optim.AdamW, "
            "without `fused=True` on a torch that lacks CPU fused kernels), or set `offload_optimizer=False`."
        ) from error


def fused_hint(optimizer: Optimizer) -> Optional[str]:
    """Advice for an offloaded torch Adam/AdamW without ``fused=True``, whose CPU step is then several times slower.

    [Note: the fast CPU step is the user's choice]
    benchmarks/offload.py (25M parameters, one thread): AdamW's default CPU step 182 ms, ``foreach=True`` 136 ms,
    ``fused=True`` 31 ms, at 96% of the memory-bandwidth bound. The optimizer's options stay the user's, so this is
    advice, not a change.
    """
    name = optimizer_name(optimizer)
    if name not in FUSED_ON_CPU or optimizer.defaults.get("fused"):
        return None
    return (f"`offload_optimizer=True` runs {name}'s step on the CPU, where its default implementation is about 6x "
            f"slower than `fused=True` (see benchmarks/offload.py). Create it with `{name}(..., fused=True)` for "
            "the fastest offloaded step.")
