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

[Note: the mmap threshold costs time]
A fixed 128 KiB threshold returns every freed tensor above it to the kernel, so the next step's tensors of that size
(activations, their gradients, the optimizer's temporaries: DDP's as much as ZeRO's) come back as fresh pages, each
one a page fault that the kernel zero-fills: many times DDP's faults per step, which run with glibc's dynamic
threshold, and a step well above DDP's (the regression of issue 23: commit 4a654ac fixed the threshold for every
model). The memory it gives back is the activations' as much as ZeRO's transients', and no setting tried keeps both
(benchmarks/RESULTS.md, "Step time against DDP at N = 2": intermediate thresholds of 2-4 MiB still fault on the
large activations and already let the heap keep stage 3's transients; huge pages, ``THP_MEM_ALLOC_ENABLE=1``, must
be in a process's environment before its first tensor, which rank 0 of a ``Trainer`` script never is). So the
trade-off is an option, and its default depends on the model: ``host_mmap_threshold=None`` fixes 128 KiB at process
start, as before, and an engine of fewer than :data:`AUTO_FIXED_MIN_PARAMS` trainable parameters (where speed matters
more than a few tens of MiB) then switches to :data:`HEAP_SETTINGS`: the steady state of glibc's dynamic threshold,
in which freed memory stays in the heap and is reused without faults. A threshold once fixed cannot be made dynamic
again, hence fixed values; a threshold above 128 KiB fixes the trim threshold at twice its value, as glibc's dynamic
adjustment does (:func:`fix_threshold`), so ``host_mmap_threshold=33_554_432`` chooses the heap for any model.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Optional

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: The threshold that ``host_mmap_threshold=None`` fixes at process start (freed tensors leave the process).
FIXED_THRESHOLD = 131_072
#: ``host_mmap_threshold=None``: engines of at least this many trainable parameters keep :data:`FIXED_THRESHOLD`;
#: smaller ones switch to :data:`HEAP_SETTINGS` (see [Note: the mmap threshold costs time]).
AUTO_FIXED_MIN_PARAMS = 16_000_000
#: (mmap threshold, trim threshold) in bytes: glibc's dynamic threshold at its 64-bit maximum, the trim threshold
#: twice that, as glibc's dynamic adjustment sets it (what :func:`fix_threshold` makes of 32 MiB).
HEAP_SETTINGS = (32 * 2**20, 64 * 2**20)

#: Whether an engine of at least :data:`AUTO_FIXED_MIN_PARAMS` was set up in this process: glibc's thresholds are
#: process state, so one large engine keeps the fixed threshold for every later one (per process by design).
_large_engine = False


def release_freed_memory(threshold: Optional[int]) -> bool:
    """At process start: fix glibc's mmap threshold at ``threshold`` bytes (``None``: :data:`FIXED_THRESHOLD`) and
    trim the heap; ``False`` if nothing was changed."""
    threshold = FIXED_THRESHOLD if threshold is None else threshold
    libc = _glibc() if threshold > 0 else None
    if libc is None:
        return False
    changed = fix_threshold(libc, threshold)
    libc.malloc_trim(0)
    return changed


def fix_threshold(libc: Any, threshold: int) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes and, above :data:`FIXED_THRESHOLD`, the trim threshold at
    twice that (as glibc's dynamic adjustment would: the heap keeps its top for reuse); ``False`` if refused."""
    if libc.mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        return False
    return threshold <= FIXED_THRESHOLD or libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold) == 1


def settle_for_model(threshold: Optional[int], trainable: int) -> bool:
    """At engine setup: with ``threshold=None`` and fewer than :data:`AUTO_FIXED_MIN_PARAMS` ``trainable`` parameters,
    let the heap keep freed memory (:data:`HEAP_SETTINGS`); ``False`` if nothing was changed."""
    global _large_engine
    _large_engine = _large_engine or trainable >= AUTO_FIXED_MIN_PARAMS
    if threshold is not None or _large_engine:  # one large engine in the process keeps the fixed threshold
        return False
    libc = _glibc()
    if libc is None:
        return False
    return fix_threshold(libc, HEAP_SETTINGS[0])


def _glibc() -> Optional[Any]:
    """glibc's ``mallopt`` and ``malloc_trim``, or ``None`` (not Linux, not glibc, or a threshold set in the
    environment, which always wins)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only (musl has no dynamic threshold to fix)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes, libc.malloc_trim.argtypes = [ctypes.c_int, ctypes.c_int], [ctypes.c_size_t]
    return libc
