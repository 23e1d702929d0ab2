"""Freed host memory goes back to the operating system (CPU runs on glibc).

[Note: glibc's dynamic mmap threshold]
glibc serves allocations above ``M_MMAP_THRESHOLD`` (128 KiB at start) with their own ``mmap`` and gives them back
on ``free``. But the threshold is dynamic: freeing such a block raises it to the block's size (up to 32 MiB on 64-bit
Linux), so from then on every tensor of up to 32 MiB comes from the heap or a thread's arena, and freed heap memory
stays resident wherever it is not at the top of the heap. ZeRO's transients are exactly such tensors: stage 3's
gathered units, gradient buckets, per-parameter gradients before they reach a bucket, the optimizer's temporaries.
With the dynamic threshold they stay in the process after being freed, and the peak resident memory of a rank no
longer falls as 1/N (zero3's growth in ``fit`` with glibc's defaults against a fixed threshold: benchmarks/RESULTS.md,
"Memory at 1/N", "Where the overhead went").

:func:`release_freed_memory` fixes the threshold (``mallopt(M_MMAP_THRESHOLD, ...)``, which also turns the dynamic
adjustment off), as ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment would, and trims what the heap holds free
now. It acts on the whole process, which is why it is an option of the strategy (``host_mmap_threshold``, 0 leaves
glibc alone), applied only on CPU runs, and never over a threshold the user chose in the environment.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_MMAP_THRESHOLD = -3


def release_freed_memory(threshold: int) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes and trim the heap; ``False`` if nothing was changed."""
    if threshold <= 0 or not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only (musl has no dynamic threshold to fix)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, malloc_trim.argtypes = [ctypes.c_int, ctypes.c_int], [ctypes.c_size_t]
    changed = mallopt(_M_MMAP_THRESHOLD, threshold) == 1
    malloc_trim(0)
    return changed
