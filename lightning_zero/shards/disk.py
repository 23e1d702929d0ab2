"""ZeRO-Infinity's disk tier (arXiv:2104.07857): ``offload_optimizer="disk"`` and ``offload_params="disk"``.

[Note: what lives on disk]
With ``offload_optimizer="disk"`` the master shard and the optimizer's per-element states (``exp_avg``,
``exp_avg_sq`` ...) live in files under ``offload_path``; the gradient shard stays in host memory as with
``offload_optimizer=True`` (see [Note: what lives where with offload_optimizer=True] in ``offload.py``). With
``offload_params="disk"`` (stage 3) so does the working parameter shard; where it has the master's dtype and the
optimizer is on disk too, it *is* the master file, as the host shard is the host master in memory. Each such tensor
is a shared memory mapping of a file of its own (``mmap``, no extension of ours): every other part of the engine
(the step's arithmetic, the uploads, checkpoints, the full weights handed back at teardown) reads and writes it as
any CPU tensor, so the results are those of host offload, bit for bit. What differs is residency: pages of a mapping
are in this process's memory only between a *read* (the pages are brought in) and an *eviction*
(``madvise(MADV_DONTNEED)``: the pages leave the process; dirty ones stay in the kernel's page cache until it writes
them to the file, clean ones are dropped, and a later read brings them back from the cache or the file). So a rank's
resident memory holds a few windows of these tensors, not the model.

[Note: the step one window at a time]
The optimizer steps in pieces of at most one bucket's elements ([Note: the step in constant-size pieces] in
``optimizer_support.py``); each piece is a window: its master tensors and their states. Before a piece steps, its
window has been read and the next piece's read is started on a thread of its own (the read: ``MADV_WILLNEED`` and a
touch of every page, which faults the pages in while the main thread steps), so the reading of window i + 1 overlaps
the step of window i. After a piece steps, states the optimizer has just created in anonymous memory (its first step,
or the first step after a checkpoint load) are moved into files of their own, and the window is written back and
evicted. An optimizer that cannot step in pieces (not elementwise, or with step hooks) steps its whole shard as one
window: correct, but its resident memory is then the shard's. Stage 3's gathers evict each unit's piece of a disk
shard once it is uploaded into the unit's buffer, and every copy between a disk shard and another (the update into
the working shard, the fill at setup) goes window by window (``copy_windowed``).

[Note: the files have no name]
Each file is created (``mkstemp`` in ``offload_path``), its blocks reserved (``posix_fallocate``: a disk without room
fails here, at setup, with a clear error, and never later as a ``SIGBUS`` on a page the file system cannot back),
mapped, then unlinked and its descriptor closed. The mapping keeps the file alive; the kernel frees its blocks when
the mapping goes (the tensor is garbage-collected) or the process ends, however it ends: an exception, Ctrl-C,
SIGTERM, even SIGKILL leave nothing behind in ``offload_path``. A write that fails mid-step (the fault point
``offload.write``, or an ``OSError`` of the file system) raises ``DiskOffloadError`` naming the path: the step
is then incomplete, the process ends through the usual exception path, and the last checkpoint (written elsewhere,
atomically: [Note: complete or absent] in ``checkpoints/storage.py``) is untouched.

[Note: faults are agreed on every rank]
A rank whose disk fails while the others' do not must not raise alone: the others would wait for it in their next
collective until the process group's timeout. So the engine's setup and each of its optimizer steps run inside
``agreed_faults``: there a file that cannot be made (``zeros``: the tensor is then an ordinary zeroed one in
memory) or a window that cannot be written back (``evict``) is *recorded* and the rank carries on in step with the
others; at the end of the block one tiny all-reduce (``agree_max``, on the CPU)
tells every rank which rank failed, and every rank raises ``DiskOffloadError`` at the same place (that rank's
own message there, the rank and the cause elsewhere). The all-reduce runs only with a disk tier, once at setup and
once per step, after the optimizer step and before anything (a checkpoint save in ``on_train_batch_end``) can read
an incomplete step: a step on disk reads and writes the whole optimizer shard, next to which four bytes are nothing.
Outside such a block (a copy into the disk tier when a checkpoint is loaded, a direct call) a fault raises at once.

[Note: a truncated file is an error, not a bus error]
The file has no name, but it is not out of reach: ``mmap.mmap`` keeps a duplicate of its descriptor (for
``size()``), which any process of the same user can open as ``/proc/<pid>/fd/<n>`` (and root as
``/proc/<pid>/map_files/...``) and truncate. A page of a mapping past the end of its file is a ``SIGBUS`` when
touched, which no Python code can turn into an exception. So every window is checked before it is touched:
``_mapped`` (under ``read``, the read-ahead, ``copy_windowed`` and therefore stage 3's gathers of a disk
shard) compares the file's size (``fstat`` on that descriptor: one system call per tensor and window) with the size
it was made with, and raises ``DiskOffloadError`` naming the file. Such an error is raised at once on the rank
that sees it (its data is gone; the step cannot go on). A truncation in the instant between the check and the touch
is still a bus error; ``faulthandler`` (enabled by the strategies) then prints where.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.comm import collectives
from lightning_zero.process.faults import fault_point
from lightning_zero.shards.optimizer_support import step_in_pieces, steps_in_pieces

PAGE = mmap.PAGESIZE
#: The value of ``offload_optimizer`` / ``offload_params`` that puts a tier on disk.
DISK = "disk"


class DiskOffloadError(OSError):
    """A file of the disk tier could not be made, reserved or written (the message says which path and what to do)."""


@dataclass
class IOCounters:
    """Bytes the disk tier read into and wrote back from this process's windows since the last ``reset``."""

    read: int = 0
    written: int = 0

    def reset(self) -> None:
        """Start counting again from zero."""
        self.read = self.written = 0


# [Note: the disk tier's process state]
# Four objects of this module are the process's, not an engine's. `_MAPPINGS` finds the file behind a bare tensor
# before a window of it is touched (see [Note: a truncated file is an error, not a bus error]): the callers (reads,
# windowed copies, stage 3's gathers) hold the tensor, not the engine, and a bus error would be the process's. `_POOL`
# is the one reader thread of the process (windows of every engine are read one at a time anyway: one disk).
# `_DEFERRED` is the fault recorded inside the innermost `agreed_faults` block, a dynamic scope on the main thread,
# like `torch.no_grad`: the code that records a fault (a file made, read or written) holds no engine. `COUNTERS`
# counts what that code reads and writes, for the same reason; callers reset and read it around the steps they
# measure, as they do `memory.costs.COSTS`.
COUNTERS = IOCounters()
"""This process's window traffic (see [Note: the step one window at a time])."""

_MAPPINGS: dict[int, tuple[int, "weakref.ref[mmap.mmap]", str, str]] = {}  # base -> (bytes, mapping, dir, file)
_POOL: Optional[ThreadPoolExecutor] = None


class _Deferred:
    """The fault this process recorded inside ``agreed_faults`` (see [Note: faults are agreed on every rank])."""

    def __init__(self) -> None:
        self.depth = 0
        self.fault: Optional[DiskOffloadError] = None

    def record(self, error: DiskOffloadError) -> bool:
        """Keep ``error`` (the first one) for the agreement; ``False`` outside a block (the caller raises it)."""
        if self.depth == 0:
            return False
        self.fault = self.fault or error
        return True


_DEFERRED = _Deferred()


@contextlib.contextmanager
def agreed_faults(group: Optional[Any], enabled: bool = True) -> Iterator[None]:
    """A block after which every rank of ``group`` raises the disk fault any rank recorded in it (see [Note: faults
    are agreed on every rank]); ``enabled=False`` (no disk tier): nothing, no collective. Collective: every rank
    enters and leaves the block at the same place. An exception leaving the block skips the agreement (the other
    ranks may not be there) and propagates."""
    if not enabled or _DEFERRED.depth:  # no disk tier, or inside a block that agrees at its end
        yield
        return
    _DEFERRED.depth = 1
    try:
        yield
    finally:
        _DEFERRED.depth = 0
        fault, _DEFERRED.fault = _DEFERRED.fault, None
    mine = [collectives.rank() + 1, fault.errno or 0] if fault is not None else [0, 0]
    agreed = collectives.agree_max(mine, group)
    if fault is not None:
        raise fault
    if agreed[0]:
        code = agreed[1]
        raise DiskOffloadError(
            code,
            f"Offload to disk failed on rank {agreed[0] - 1} ({os.strerror(code)}); every "
            "rank stopped at the same point. That rank's error says which directory and "
            "what to do; resume from the last checkpoint.",
        )


def directory(path: Optional[str]) -> str:
    """The directory the files go to: ``offload_path``, or the system's temporary directory."""
    return os.path.abspath(os.path.expanduser(str(path))) if path is not None else tempfile.gettempdir()


def zeros(numel: int, dtype: torch.dtype, path: Optional[str]) -> Tensor:
    """A zeroed CPU tensor of ``numel`` elements backed by a nameless file in ``directory`` (see [Note: the
    files have no name]); raises ``DiskOffloadError`` if the file cannot be made or its room reserved."""
    where = directory(path)
    nbytes = -(-max(numel, 1) * torch.empty(0, dtype=dtype).element_size() // PAGE) * PAGE
    try:
        os.makedirs(where, exist_ok=True)
        fault_point("offload.create")
        fd, name = tempfile.mkstemp(prefix=f"lightning-zero-{os.getpid()}-", suffix=".bin", dir=where)
    except OSError as error:
        return _failed(_error(error, f"make a file in {where!r}"), error, numel, dtype)
    try:
        os.unlink(name)
        os.posix_fallocate(fd, 0, nbytes)
        mapping = mmap.mmap(fd, nbytes)  # MAP_SHARED: writes go to the file (through the page cache)
    except OSError as error:
        return _failed(_error(error, f"reserve {nbytes} bytes in {where!r}"), error, numel, dtype)
    finally:
        os.close(fd)
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)
    if numel:
        base = tensor.data_ptr()
        _MAPPINGS[base] = (nbytes, weakref.ref(mapping), where, name)
        weakref.finalize(mapping, _MAPPINGS.pop, base, None)
    return tensor


def _failed(error: DiskOffloadError, cause: OSError, numel: int, dtype: torch.dtype) -> Tensor:
    """A file ``zeros`` could not make: raised at once, or recorded inside ``agreed_faults`` with an ordinary
    zeroed tensor in its place, so that this rank keeps in step until every rank raises."""
    if not _DEFERRED.record(error):
        raise error from cause
    error.__cause__ = cause
    return torch.zeros(numel, dtype=dtype)


def _error(error: OSError, what: str, consequence: str = "") -> DiskOffloadError:
    """A ``DiskOffloadError`` saying what failed where, why, and what to do."""
    hint = (
        "The disk is full: free space there or choose a directory with more room"
        if error.errno == errno.ENOSPC
        else "Choose a writable local directory"
    )
    return DiskOffloadError(
        error.errno,
        f"Offload to disk could not {what} ({os.strerror(error.errno or 0)}).{consequence}"
        f" {hint} with `offload_path=...`, or offload to host memory with "
        "`offload_optimizer=True` / `offload_params=True`.",
    )


def _mapping_of(tensor: Tensor) -> Optional[tuple[mmap.mmap, int, int, str]]:
    """``(mapping, start, end, directory)``: the byte range of ``tensor`` inside the mapping that holds it, or
    ``None``."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    address = tensor.data_ptr()
    # [Note: copy the mappings in one call] `tuple(_MAPPINGS.items())` allocates a pair per entry, and an allocation
    # may run the garbage collector, whose `weakref.finalize` of a dropped mapping pops an entry mid-iteration
    # ("dictionary changed size during iteration"); `dict.copy` copies without running Python code
    for base, (size, ref, where, name) in _MAPPINGS.copy().items():
        if base <= address < base + size:
            mapping = ref()
            if mapping is None:
                return None
            _check_size(mapping, size, name)
            start = address - base
            return mapping, start, min(size, start + tensor.numel() * tensor.element_size()), where
    return None


def _check_size(mapping: mmap.mmap, size: int, name: str) -> None:
    """Raise ``DiskOffloadError`` naming the file if it is shorter than it was made (see [Note: a truncated
    file is an error, not a bus error])."""
    try:
        now = mapping.size()  # fstat of the mapping's own descriptor
    except OSError as error:
        raise _error(error, f"check the size of its file {name!r} (deleted)") from error
    if now < size:
        raise DiskOffloadError(
            errno.EIO,
            f"The offload file {name!r} (deleted, still mapped by rank "
            f"{collectives.rank()}) was truncated to {now} of its {size} bytes by "
            "another process: its data is lost. Resume from the last checkpoint, and "
            "keep other processes away from this run's files (/proc/<pid>/fd).",
        )


def on_disk(tensor: Tensor) -> bool:
    """Whether ``tensor``'s memory is a mapping of the disk tier."""
    return _mapping_of(tensor) is not None


def _pages(start: int, end: int) -> tuple[int, int]:
    """The page-aligned ``(offset, length)`` covering bytes ``[start, end)`` (a shared file mapping loses nothing
    when a page shared with a neighbour is evicted: the neighbour's bytes are in the file too)."""
    first = start // PAGE * PAGE
    return first, -(-end // PAGE) * PAGE - first


def _mapped(tensors: Iterable[Tensor]) -> Iterator[tuple[Tensor, mmap.mmap, int, int, str]]:
    """``(tensor, mapping, offset, length, directory)`` for each disk-tier tensor of ``tensors``: its whole pages
    in the mapping (the others are skipped); ``length`` is rounded up to pages, ``tensor`` gives the exact bytes."""
    for tensor in tensors:
        found = _mapping_of(tensor)
        if found is not None:
            mapping, start, end, where = found
            yield (tensor, mapping, *_pages(start, end), where)


def read(tensors: Iterable[Tensor]) -> None:
    """Bring the pages of the disk-tier ``tensors`` into this process (the *read* of a window)."""
    _touch(list(_mapped(tensors)))


def _touch(mapped: list[tuple[Tensor, mmap.mmap, int, int, str]]) -> None:
    """Fault in the pages of ``_mapped``'s ranges (on the reading thread: the ranges were found on the caller's)."""
    for tensor, mapping, offset, length, _ in mapped:
        mapping.madvise(mmap.MADV_WILLNEED, offset, length)
        step = max(1, PAGE // tensor.element_size())
        with torch.no_grad():
            tensor.reshape(-1)[::step].sum()  # one element per page: every page faulted in
        COUNTERS.read += tensor.numel() * tensor.element_size()


def evict(tensors: Iterable[Tensor], written: bool = False) -> None:
    """Evict the pages of the disk-tier ``tensors`` from this process; ``written``: they were updated (the *write* of
    a window, counted, where a failing file system is reported as ``DiskOffloadError``)."""
    for tensor, mapping, offset, length, where in _mapped(tensors):
        if written:
            try:
                fault_point("offload.write")
            except OSError as error:
                failure = _error(
                    error,
                    f"write the optimizer's window back to {where!r}",
                    " This step is incomplete: resume from the last checkpoint.",
                )
                if not _DEFERRED.record(failure):
                    raise failure from error
                failure.__cause__ = error
            COUNTERS.written += tensor.numel() * tensor.element_size()
        mapping.madvise(mmap.MADV_DONTNEED, offset, length)


def copy_windowed(target: Tensor, source: Tensor, window: int, copy: Callable[[Tensor, Tensor], None]) -> None:
    """``copy(target, source)`` in pieces of ``window`` elements, evicting each piece of a disk-tier side once it is
    copied, so the copy of a whole shard keeps one window resident (see [Note: the step one window at a time])."""
    if not (on_disk(target) or on_disk(source)):
        copy(target, source)
        return
    flat_target, flat_source = target.reshape(-1), source.reshape(-1)
    for start in range(0, flat_source.numel(), window):
        piece = (flat_target[start : start + window], flat_source[start : start + window])
        read([piece[1]])
        copy(*piece)
        evict([piece[1]])
        evict([piece[0]], written=True)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-zero-disk")
    return _POOL


class WindowedStep:
    """The optimizer's step on a disk-tier shard, one window at a time (see [Note: the step one window at a time])."""

    def __init__(self, optimizer: Optimizer, path: Optional[str]) -> None:
        self.optimizer = optimizer
        self.path = path
        self._reading: dict[int, Future[None]] = {}

    def window(self, masters: list[Tensor]) -> list[Tensor]:
        """The tensors of a window: ``masters`` and their tensor states."""
        states = [
            v
            for m in masters
            for v in self.optimizer.state.get(m, {}).values()
            if isinstance(v, Tensor) and v.numel() > 1
        ]
        return [*masters, *states]

    def run(
        self,
        call: Callable[[], Any],
        limit: Optional[int],
        after_piece: Optional[Callable[[list[Tensor]], None]] = None,
    ) -> Any:
        """Run ``call`` (the user's ``optimizer.step``) in windows of at most ``limit`` elements (``None``: one window
        of everything); ``after_piece`` as in ``step_in_pieces``, before the window is written back."""
        if limit is None or not steps_in_pieces(self.optimizer, limit):
            masters = [m for group in self.optimizer.param_groups for m in group["params"]]
            read(self.window(masters))
            output = call()
            self._finish(masters, after_piece)
            return output

        def before(pieces: list[list[Tensor]], index: int) -> None:
            if index == 0:
                read(self.window(pieces[0]))
            else:
                self._reading.pop(index).result()
            if index + 1 < len(pieces):
                mapped = list(_mapped(self.window(pieces[index + 1])))  # looked up here, touched there
                self._reading[index + 1] = _pool().submit(_touch, mapped)

        try:
            return step_in_pieces(self.optimizer, limit, call, lambda piece: self._finish(piece, after_piece), before)
        finally:
            for future in self._reading.values():  # an error mid-step: let the reads end before anything else
                future.result()
            self._reading.clear()

    def _finish(self, masters: list[Tensor], after_piece: Optional[Callable[[list[Tensor]], None]]) -> None:
        if after_piece is not None:
            after_piece(masters)
        self.adopt(masters)
        evict(self.window(masters), written=True)

    def adopt(self, masters: list[Tensor]) -> None:
        """Move the states of ``masters`` that are not in the disk tier (just created, or loaded) into files."""
        for master in masters:
            state = self.optimizer.state.get(master, {})
            for key, value in list(state.items()):
                if (
                    isinstance(value, Tensor)
                    and value.numel() > 1
                    and value.device.type == "cpu"
                    and not on_disk(value)
                ):
                    moved = zeros(value.numel(), value.dtype, self.path)
                    with torch.no_grad():
                        moved.copy_(value.reshape(-1))
                    state[key] = moved.view(value.shape)
