"""A gradient bucket's pooled buffer (``BucketSlot``), the sink a reducer may write into instead of a device
gradient shard (``GradSink``), and the two helpers that fill a bucket; the reducer that uses them is in
``buckets.py``.

[Note: a sink instead of a device shard]
With a ``GradSink`` (``offload_optimizer``: ``offload.HostGrads``) the reducer keeps no gradient shard at all
(``grad_shard`` stays ``None``): every reduce-scatter writes into its slot's side output, a scratch chunk of one
bucket's chunk size (after the replica all-reduce under hybrid sharding, as above), and the sink copies that chunk
into its shard (the first reduction after a clear) or adds it (accumulation). Zeroing (buckets that got no
gradient, ``clear_params``) goes to the sink too. The sink may read the chunk asynchronously: it returns a fence
(a CUDA event) that the slot keeps, and the slot's next reduce-scatter is ordered after it, so a chunk is never
overwritten before it was read. The device memory of the gradients is then the pool's: constant in the model size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from lightning_zero.memory import costs
from lightning_zero.shards.layout import Bucket, FlatLayout


class GradSink(Protocol):
    """Where the reduced chunks go instead of a device gradient shard (see [Note: a sink instead of a device shard])."""

    def write(self, bucket: Bucket, chunk: torch.Tensor, accumulate: bool) -> Optional[Any]:
        """Copy (``accumulate=False``) or add ``bucket``'s reduced ``chunk`` into the shard; returns a fence the chunk
        must not be overwritten before (a CUDA event), or ``None`` when ``chunk`` has been read already."""

    def zero(self, start: int, end: int) -> None:
        """Zero positions ``[start, end)`` of the shard."""

    def shard(self) -> torch.Tensor:
        """The whole shard, once every write has landed."""

    def clear(self) -> None:
        """Forget what is in flight (the gradients were cleared: the next write of each bucket copies)."""


@dataclass
class BucketSlot:
    """One pooled buffer, sized for the largest bucket, and (only once accumulation or a sink needs it) a side output
    with the fence of the sink's last read of it."""

    bucket: torch.Tensor
    out: Optional[torch.Tensor] = None
    fence: Optional[Any] = None

    def wait_fence(self, device: torch.device) -> None:
        """Order the next write of the side output after the sink's read of it (a stream wait, no CPU block)."""
        if self.fence is not None:
            torch.cuda.current_stream(device).wait_event(self.fence)
            self.fence = None

    def input(self, bucket: Bucket, world_size: int) -> torch.Tensor:
        """The part of the input buffer that ``bucket`` uses."""
        return self.bucket[: bucket.chunk_size * world_size]

    def output(self, bucket: Bucket, world_size: int) -> torch.Tensor:
        """The side output of a reduce-scatter that must be added to the shard (gradient accumulation) or handed to
        the sink."""
        if self.out is None:
            self.out = costs.empty(self.bucket.numel() // world_size, self.bucket.dtype, self.bucket.device)
        return self.out[: bucket.chunk_size]


def scaled_copy(target: torch.Tensor, source: torch.Tensor, world_size: int) -> None:
    """``target = source / world_size`` in one pass (two when the dtypes differ: cast, then divide as before)."""
    if target.dtype == source.dtype:
        torch.div(source, world_size, out=target)
    else:
        target.copy_(source).div_(world_size)


def bucket_gaps(layout: FlatLayout, bucket: Bucket) -> list[tuple[int, int]]:
    """Ranges of ``bucket``'s input buffer that no parameter piece covers (padding)."""
    spans = sorted((offset, offset + length) for _, _, length, offset in layout.bucket_pieces(bucket))
    gaps, at = [], 0
    for begin, end in spans:
        if begin > at:
            gaps.append((at, begin))
        at = max(at, end)
    total = bucket.chunk_size * layout.world_size
    if at < total:
        gaps.append((at, total))
    return gaps
