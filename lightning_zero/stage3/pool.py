"""Stage 3's unit memory: blocks allocated once and lent to the unit buffers in turn.

[Note: the engine owns its memory]
A unit buffer (see [Note: stage 3 storage] in ``params.py``) holds memory only while its unit is gathered. Giving
its storage memory with ``resize_`` and taking it away with ``resize_(0)`` is one allocation and one free of the
whole unit per gather: on a GPU the caching allocator makes that cheap, on a CPU it is ``malloc``/``free`` of tens
of MiB, which glibc serves with ``mmap`` above its threshold, so every gather of every step maps fresh pages and
faults on each of them (a zeroed page per 4 KiB; and whether it does depends on a process-wide setting no library
should decide). So the memory comes from a ``BlockPool`` instead: a block of the unit's byte size, made on first
use and kept, is *swapped into* the buffer's storage at gather and swapped back out at release
(``UntypedStorage._swap_data_ptr_``: the two storages exchange their memory; nothing is allocated or copied). The
buffer's storage object never changes, so the parameters (views of it) and every tensor autograd saved from them,
``W.t()`` of ``F.linear`` included, read whatever block the storage holds now: a unit released after its forward
and gathered again for backward into another block of the same size is read correctly. After warm-up a step
allocates nothing here; the pool holds, per size, as many blocks as were ever lent at once (the root, the current
unit and those prefetched: bounded by ``prefetch_size``, not by the model's depth). A block stays the pool's
between steps: the memory a gather would have taken again at the next forward is kept for it.

Alternatives weighed: a fixed pool of slots with each unit's parameters re-pointed (``param.data = slot...``) and
the tensors autograd saved re-pointed through ``saved_tensors_hooks`` works too (it was built and measured), but
hooks every saved tensor of every unit (a lookup each, and care with checkpointing's own hooks and
``torch.compile``), changes the parameters' tensors at every gather (compiled graphs guard on them), and reaches the
same counts: no allocation, no fault. Swapping the memory under an unchanged storage keeps every tensor and every
invariant of the resize design (the guard, hpZ, offload uploads, compiled units) as it was. Where a torch build has
no ``_swap_data_ptr_``, the pool falls back to ``resize_`` (counted as an allocation per gather).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_zero.memory import costs

_SWAPS = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class BlockPool:
    """Blocks of memory lent to unit buffers by exact byte size (see [Note: the engine owns its memory])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._idle: dict[int, list[torch.UntypedStorage]] = {}
        """Blocks not lent, by byte size."""
        self._lent: dict[int, torch.UntypedStorage] = {}
        """``id`` of a buffer's storage to the (memoryless) storage its block came from."""
        self.blocks = 0
        """Blocks ever made."""
        self.block_bytes = 0
        """Bytes of every block made (lent or idle)."""

    def lend(self, buffer: Tensor) -> None:
        """Give ``buffer``'s storage (which holds no memory) a block of its byte size."""
        storage = buffer.untyped_storage()
        nbytes = buffer.numel() * buffer.element_size()
        if not _SWAPS:
            costs.count_allocation(nbytes)
            storage.resize_(nbytes)
            return
        idle = self._idle.get(nbytes)
        block = idle.pop() if idle else self._make(nbytes, buffer.dtype)
        storage._swap_data_ptr_(block)  # type: ignore[attr-defined]  # private, not in torch's stubs; the buffer holds the block's memory, ``block`` none
        self._lent[id(storage)] = block

    def take_back(self, buffer: Tensor) -> None:
        """Take ``buffer``'s block back (the buffer's storage holds no memory after)."""
        storage = buffer.untyped_storage()
        block: Optional[torch.UntypedStorage] = self._lent.pop(id(storage), None)
        if block is None:  # the ``resize_`` fallback, or memory of its own (setup's first allocation)
            storage.resize_(0)
            return
        storage._swap_data_ptr_(block)  # type: ignore[attr-defined]  # private, not in torch's stubs
        self._idle.setdefault(block.nbytes(), []).append(block)

    def _make(self, nbytes: int, dtype: torch.dtype) -> torch.UntypedStorage:
        block = costs.empty(nbytes // _itemsize(dtype), dtype, self.device)
        self.blocks += 1
        self.block_bytes += nbytes
        return block.untyped_storage()

    def clear(self) -> None:
        """Drop the idle blocks (teardown); lent ones go when their buffers are taken back and dropped."""
        for blocks in self._idle.values():
            self.block_bytes -= sum(b.nbytes() for b in blocks)
        self._idle.clear()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
