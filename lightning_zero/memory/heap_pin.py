"""A small block held at the top of the host heap, so the memory a step's activations used stays mapped for the next.

[Note: the heap pin]
On a CPU, tensors below glibc's mmap threshold (up to 32 MiB) come from one heap that grows at its top, and glibc
gives the top back to the kernel (trims it) as soon as more than twice that threshold lies free there. In a
training step the forward's activations sit at the top of that heap; backward frees them. Under DDP the gradients
autograd allocates during backward stay until the next ``zero_grad`` and sit above the activations, so the top
stays occupied and nothing is trimmed. ZeRO frees each gradient as soon as it is in its bucket, so once backward
and the optimizer step have freed their temporaries the whole activation region is free at the top and trimmed:
the next forward takes a fresh page fault for every 4 KiB of its activations (measured at 18.2M parameters, N = 2:
~22,000 faults in each forward against DDP's ~4,000; benchmarks/RESULTS.md).

So the reducer takes a pin when the first gradient of a backward arrives, the moment the heap is at its highest
(the forward's activations are all alive): an uninitialized allocation of ``PIN_BYTES``, which glibc carves
from the top of the heap when no free hole is large enough. It keeps the highest pin it has taken (by address) and
frees any other at once (a pin glibc mapped on its own, above the threshold, lies far from the heap, next to no small
allocation, and is not kept), so the pin only ever moves up and, once at the top, keeps the activation region below it
from being trimmed, as DDP's gradients do. The pin is never written: it costs address space and no resident
memory (nor is it counted among the engine's large allocations in ``memory/costs.py``, which count memory a step
makes), and a pin that lands in a free hole instead of at the top is dropped at the next backward. What the pin
keeps is what the peak of a step needed anyway, so the peak resident memory does not rise; the level between
steps stays at the peak, as under DDP. Nothing process-wide is set: under another allocator (or a GPU) the pin is
one idle allocation. Stage 3 takes a pin too: its gathered units come from its own pool (``stage3/pool.py``), but
its activations and gradients are the heap's, and it frees each gradient into its bucket as stages 1 and 2 do
(measured at N = 2: zero3's faults per step 18-20k -> 10k at 5.3M, 27-37k -> 12-15k at 18.2M; DDP's 9-16k).
"""

from __future__ import annotations

from typing import Optional

import torch

#: A heap this far from a small allocation's address is not the heap that allocation came from (an mmap).
_HEAP_SPAN = 1 << 40

#: The pin's size: below glibc's dynamic mmap threshold once warm (it must come from the heap) and above most
#: holes a forward leaves, so that it is taken from the top.
PIN_BYTES = 8 << 20


class HeapPin:
    """Holds the highest host allocation taken at the heap's peak (see [Note: the heap pin])."""

    def __init__(self, nbytes: int = PIN_BYTES) -> None:
        self.nbytes = nbytes
        self.block: Optional[torch.Tensor] = None
        """The pin kept (``None`` before the first backward and after ``release``)."""

    @property
    def held(self) -> int:
        """Bytes of the pin kept (0 when none): address space, never resident."""
        return self.nbytes if self.block is not None else 0

    def take(self) -> None:
        """Take a new pin now (the heap at its highest) and keep whichever of it and the old one lies higher."""
        candidate = torch.empty(self.nbytes, dtype=torch.uint8)  # never written: no resident pages
        at = candidate.data_ptr()
        if abs(at - torch.empty(1, dtype=torch.uint8).data_ptr()) > _HEAP_SPAN:
            return  # mapped on its own, not from the heap: it would pin nothing
        if self.block is None or at > self.block.data_ptr():
            self.block = candidate

    def release(self) -> None:
        """Let the heap be trimmed again (teardown)."""
        self.block = None
