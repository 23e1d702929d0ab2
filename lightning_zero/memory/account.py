"""Where a rank's resident memory is, part by part, read from the process's own counters.

[Note: the account of a rank's memory]
The operating system sees one number per process: its resident memory (``VmRSS``) and that number's high-water mark
(``VmHWM``). An out-of-memory error counts all of it, so the account starts from it, above a reference level (the
level when ``lightning_zero`` was imported, i.e. after the user's imports), and splits it with counters that each
read one thing:

- the model states, by kind (parameters, gradients, fp32 masters, optimizer states), from the live tensors
  (``shards/accounting.py``);
- stage 3's gathered units: the bytes of the block pool (``stage3/pool.py``), lent or idle;
- the bucket buffers of the gradient reduction (the constant-size buffers);
- the rest of glibc's live heap (``mallinfo2``: bytes in use, ``uordblks + hblkhd``) above the reference: activations,
  autograd's temporaries, the data, whatever setup left alive (the heap pin of ``heap_pin.py`` is in use but never
  written, so it is left out: it holds no resident page);
- the rest of the anonymous resident memory (``RssAnon``): glibc's free heap that it keeps for reuse (its slack),
  the interpreter's own small-object arenas and the threads' stacks;
- file pages mapped (``RssFile + RssShmem``): libraries loaded after the reference.

The resident memory is ``RssAnon + RssFile + RssShmem``, so the parts add up to it at the moment of the reading.
What makes an account worth reading is *when* it is taken: a ``MemoryLedger`` reads the counters at the points
of a run where the memory is highest (the end of setup; the first gradient of each backward, when the activations are
all alive; the end of each backward and of each optimizer step; the hand-back of the full weights at teardown) and
keeps the reading with the highest resident memory, with the engine's parts at that moment. Its total is then
compared with the high-water mark: what the readings missed (a peak between two of them) shows as the difference.
The account is the host's: on a GPU the device's own allocator counts the device's memory, and the engine does not
read these counters.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

MiB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2() -> Optional[Callable[[], _MallInfo2]]:
    """glibc's ``mallinfo2`` (2.33 and later), or ``None`` (not Linux, not glibc, or an older glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function  # type: ignore[no-any-return]


_MALLINFO2 = _mallinfo2()


def _status() -> dict[str, int]:
    """The ``kB`` lines of ``/proc/self/status``, in bytes (empty where there is no such file)."""
    values = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if rest.endswith("kB\n"):
                    values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """``VmRSS`` from ``/proc/self/statm`` (one short line: the cheap reading a step can afford); 0 where there is
    none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def status_bytes(key: str) -> int:
    """A ``kB`` line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes; 0 where there is none."""
    return _status().get(key, 0)


def reset_peak() -> None:
    """Set ``VmHWM`` to the current ``VmRSS`` (``/proc/self/clear_refs``, Linux 4.0 and later; nothing elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


@dataclass(frozen=True)
class ProcessMemory:
    """The process's counters at one moment (bytes)."""

    resident: int
    """``VmRSS``."""
    peak: int
    """``VmHWM``: the highest ``VmRSS`` so far."""
    heap_live: int
    """glibc's bytes in use (``uordblks + hblkhd``, every arena); 0 without glibc."""
    anonymous: int
    """``RssAnon``: resident pages of no file (the heap, the interpreter's arenas, stacks)."""
    files: int
    """``RssFile + RssShmem``: resident pages of mapped files."""

    @classmethod
    def read(cls) -> "ProcessMemory":
        """The counters now."""
        status = _status()
        live = 0
        if _MALLINFO2 is not None:
            info = _MALLINFO2()
            live = info.uordblks + info.hblkhd
        return cls(
            status.get("VmRSS", 0),
            status.get("VmHWM", 0),
            live,
            status.get("RssAnon", 0),
            status.get("RssFile", 0) + status.get("RssShmem", 0),
        )


#: The level after the user's imports: read when ``lightning_zero`` has been imported (``mark_imported``).
IMPORTED = ProcessMemory.read()


def mark_imported() -> None:
    """Read ``IMPORTED`` again: the package's ``__init__`` calls it once its own imports are done."""
    global IMPORTED
    IMPORTED = ProcessMemory.read()


@dataclass(frozen=True)
class EngineMemory:
    """What the engine holds at one moment, by part (bytes); the model states by kind."""

    params: int = 0
    grads: int = 0
    master: int = 0
    optimizer_states: int = 0
    pool: int = 0
    """Stage 3's blocks for gathered units (lent or idle)."""
    buckets: int = 0
    """The gradient reduction's bucket buffers."""
    pin: int = 0
    """The heap pin: in use, never written (address space, no resident page)."""

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.master + self.optimizer_states


@dataclass(frozen=True)
class MemoryAccount:
    """A rank's resident memory above ``IMPORTED``, by part, at one reading (see [Note: the account of a rank's
    memory])."""

    at: str
    """Where in the run the reading was taken."""
    now: ProcessMemory
    engine: EngineMemory
    reference: ProcessMemory = field(default_factory=lambda: IMPORTED)

    @property
    def resident(self) -> int:
        """Resident memory above the reference at the reading."""
        return self.now.resident - self.reference.resident

    @property
    def peak(self) -> int:
        """The high-water mark above the reference (the process's own peak, whenever it was; the kernel updates
        ``VmHWM`` lazily, so never below the reading itself)."""
        return max(self.now.peak, self.now.resident) - self.reference.resident

    @property
    def other_live(self) -> int:
        """Live heap above the reference that is none of the engine's parts: activations, temporaries, data."""
        e = self.engine
        return self._live() - e.model_states - e.pool - e.buckets

    def _live(self) -> int:
        """Resident live heap above the reference (the pin left out)."""
        return self.now.heap_live - self.reference.heap_live - self.engine.pin

    @property
    def slack(self) -> int:
        """Anonymous resident memory above the reference that no live allocation holds: glibc's free heap, the
        interpreter's arenas, threads' stacks."""
        return self.now.anonymous - self.reference.anonymous - self._live()

    @property
    def files(self) -> int:
        """File pages mapped above the reference (libraries loaded since)."""
        return self.now.files - self.reference.files

    def parts(self) -> dict[str, int]:
        """Every part, in bytes; they add up to ``resident``."""
        e = self.engine
        return {
            "parameters": e.params,
            "gradients": e.grads,
            "fp32 masters": e.master,
            "optimizer states": e.optimizer_states,
            "gathered units (pool)": e.pool,
            "bucket buffers": e.buckets,
            "activations and other live heap": self.other_live,
            "allocator's free heap, interpreter, stacks": self.slack,
            "files mapped": self.files,
        }

    def describe(self) -> str:
        """Two lines: the parts, then the reading against the high-water mark."""
        cells = ", ".join(f"{name} {value / MiB:,.1f}" for name, value in self.parts().items())
        return (
            f"memory at this rank's highest reading ({self.at}), MiB above the level after imports: {cells}; "
            f"total {self.resident / MiB:,.1f} of a peak of {self.peak / MiB:,.1f}"
        )


class MemoryLedger:
    """Readings at chosen points of a run; keeps the one with the highest resident memory, with the engine's parts
    then (``parts`` is asked only for a new highest reading, so a reading costs one read of ``/proc``)."""

    def __init__(self, parts: Callable[[], EngineMemory], enabled: bool = True) -> None:
        self._parts = parts
        self.enabled = enabled and sys.platform.startswith("linux")
        self.highest: Optional[MemoryAccount] = None

    def note(self, at: str) -> None:
        """Read the counters at ``at``; keep the reading if it is the highest so far."""
        if not self.enabled:
            return
        resident = resident_bytes()
        if self.highest is not None and resident <= self.highest.now.resident:
            return
        self.highest = MemoryAccount(at, ProcessMemory.read(), self._parts())

    def account(self) -> Optional[MemoryAccount]:
        """The highest reading, with the process's high-water mark as it is now; ``None`` before any reading."""
        if self.highest is None:
            return None
        return replace(self.highest, now=replace(self.highest.now, peak=status_bytes("VmHWM")))
