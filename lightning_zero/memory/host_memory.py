"""An escape hatch for CPU runs on glibc: fix the allocator's mmap threshold for the whole process (off by default).

[Note: no allocator setting decides speed or memory]
glibc serves allocations above ``M_MMAP_THRESHOLD`` (128 KiB at start) with their own ``mmap`` and returns them on
``free``; freeing such a block raises the threshold to the block's size (up to 32 MiB on 64-bit Linux), so from then
on most tensors come from the heap and freed memory stays in the process for reuse. Fixing the threshold at 128 KiB
(``mallopt(M_MMAP_THRESHOLD, ...)``, as ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment would) makes every freed
tensor above it leave the process and come back at its next allocation as fresh pages, a page fault per 4 KiB,
activations as much as ZeRO's buffers: lower peaks, slower steps (benchmarks/RESULTS.md, "Step time against DDP at
N = 2"). That is a trade for the whole process, the user's model and data loading included, so the engine does not
make it: the memory ZeRO's step needs within a step is its own, allocated once and reused (see [Note: the engine
owns its memory] in ``stage3/pool.py``), and glibc is left as DDP has it. ``host_mmap_threshold`` (default ``None``,
nothing changed) fixes a threshold for a user who wants that trade on a CPU run; a threshold above 128 KiB also
fixes the trim threshold at twice its value, as glibc's own adjustment does (``fix_threshold``). A threshold set
in the environment always wins.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Optional

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: glibc's own starting threshold (``host_mmap_threshold=131072`` returns every freed tensor above it at once).
FIXED_THRESHOLD = 131_072


def release_freed_memory(threshold: Optional[int]) -> bool:
    """At process start: fix glibc's mmap threshold at ``threshold`` bytes and trim the heap (``None`` or 0: leave
    glibc alone, the default); ``False`` if nothing was changed."""
    libc = _glibc() if threshold else None
    if libc is None or threshold is None:
        return False
    changed = fix_threshold(libc, threshold)
    libc.malloc_trim(0)
    return changed


def give_back_free_heap() -> bool:
    """Once, at a point the engine chooses: return the whole pages of glibc's free heap to the kernel
    (``malloc_trim(0)``); ``False`` where there is no glibc (nothing to do).

    [Note: the engine gives back what its setup left behind]
    Sharded construction builds each unit whole and keeps a shard of it, and the first step makes the optimizer's
    states and temporaries: both leave holes in glibc's heap that it keeps resident (``mallinfo2().fordblks``, tens
    of MiB) and that no later step needs, since every buffer of a step is the engine's own and reused. One trim after
    setup and one after the first optimizer step hand those pages back (the paper's memory defragmentation, done by
    the allocator that owns the holes). It changes no setting: the heap keeps serving the process as DDP's does, and
    a hole a later step does reuse is faulted back in once, not every step. A trim in every step would return the
    activations' pages too and bring their faults back every step: never call this per step.
    """
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def fix_threshold(libc: Any, threshold: int) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes and, above ``FIXED_THRESHOLD``, the trim threshold at
    twice that (as glibc's dynamic adjustment would: the heap keeps its top for reuse); ``False`` if refused."""
    if libc.mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        return False
    return threshold <= FIXED_THRESHOLD or libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold) == 1


def _glibc() -> Optional[Any]:
    """glibc's ``mallopt`` and ``malloc_trim``, or ``None`` (not Linux, not glibc, or a threshold set in the
    environment, which always wins)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    return _libc()


def _libc() -> Optional[Any]:
    """glibc with ``mallopt`` and ``malloc_trim`` typed, or ``None`` (not Linux, or not glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only (musl has no dynamic threshold to fix)
        return None
    libc.mallopt.argtypes, libc.malloc_trim.argtypes = [ctypes.c_int, ctypes.c_int], [ctypes.c_size_t]
    return libc
