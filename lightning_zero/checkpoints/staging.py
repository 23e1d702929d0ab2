"""The file-system side of writing a checkpoint: staging directories that other writers can tell are live, atomic
replacement under a lock, and the digest of ``meta.pt``.

[Note: writers that cannot collide]
Two jobs may write the same checkpoint name at once (a SLURM requeue overlapping the job it replaces, two runs
given the same ``dirpath``). Each save stages its files in a hidden sibling ``.NAME.tmp-<token>`` and clears what
*interrupted* saves left there, so it must tell an abandoned staging directory from another job's live one. The
writer (rank 0) holds an exclusive ``flock`` on its staging directory from its creation until it is renamed into
place; the directory is made under a private name (``.NAME.new-<token>``), locked, and only then renamed to the
name others look at, so no one ever sees it unlocked while its writer lives. A dead writer's lock is released by the
kernel, so "the lock can be taken" proves "nobody writes there": only such directories are removed. The two renames
that put a checkpoint in place (the old one aside, the new one in) run under an exclusive ``flock`` on the parent
directory, so two writers' renames never interleave: the last writer wins, and a reader sees either complete
checkpoint or, for an instant between the two renames, none (see [Note: complete or absent] in ``storage.py``).
On a file system without ``flock`` (some NFS and Lustre mounts) nothing can be proved: stale staging directories are
then left for the user to delete, and the renames are not serialized.

[Note: every byte a load reads is checked first]
``meta.pt`` records the size and CRC-32 of every other file a load reads (the shards and DCP's ``.metadata``). Its
own size and CRC-32 are in ``meta.crc32``, written after it; ``read_meta_bytes`` checks them before
``torch.load`` turns a single byte of it into state (a flipped bit in a pickled float would otherwise become, say,
an Adam ``beta2`` of 8.6e-78 and a run that trains to NaN).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import zlib
from pathlib import Path
from typing import Optional

#: The file holding ``meta.pt``'s size and CRC-32 (see [Note: every byte a load reads is checked first]).
META_DIGEST_FILE = "meta.crc32"


# ---------------------------------------------------------------------- digests
def describe(path: Path) -> tuple[int, int]:
    """``(size in bytes, CRC-32)`` of a file."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return path.stat().st_size, crc


def write_meta_digest(directory: Path, meta_file: Path) -> None:
    """Write ``meta.crc32`` (``"<size> <crc32 hex>"``) for ``meta_file`` into ``directory``, durably."""
    size, crc = describe(meta_file)
    with open(directory / META_DIGEST_FILE, "w") as f:
        f.write(f"{size} {crc:08x}\n")
        f.flush()
        os.fsync(f.fileno())


def meta_digest_problem(directory: Path, data: bytes) -> Optional[str]:
    """What is wrong with ``data`` (the bytes of ``meta.pt``) against ``meta.crc32``, or ``None``."""
    digest = directory / META_DIGEST_FILE
    if not digest.is_file():
        return f"{META_DIGEST_FILE} (the checksum of meta.pt) is missing"
    try:
        size_text, crc_text = digest.read_text().split()
        size, crc = int(size_text), int(crc_text, 16)
    except (ValueError, UnicodeDecodeError):
        return f"{META_DIGEST_FILE} is damaged"
    if len(data) != size:
        return f"meta.pt has {len(data)} bytes instead of {size} (truncated or overwritten)"
    if zlib.crc32(data) != crc:
        return "meta.pt does not match its checksum (corrupted)"
    return None


# ---------------------------------------------------------------------- staging directories
class StagingLock:
    """The exclusive ``flock`` a live writer holds on its staging directory (see [Note: writers that cannot
    collide]); ``release`` once the directory was renamed into place or removed."""

    def __init__(self, fd: Optional[int]) -> None:
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


def make_staging(path: Path, staging: Path, token: str, directory: bool = True) -> StagingLock:
    """Clear what interrupted saves to ``path`` left behind, then make ``staging`` (a directory, or an empty file
    for a full checkpoint) locked by this process: made under a private name, locked, then renamed (see [Note:
    writers that cannot collide]). A file's lock holds the descriptor to write it through (``StagingLock.fd``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(path)
    private = path.parent / f".{path.name}.new-{token}"
    if directory:
        private.mkdir()
        fd = os.open(private, os.O_RDONLY)
    else:
        fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _try_lock(fd, unsupported=True)  # no flock here: others cannot prove it live and leave it alone
        os.rename(private, staging)
    except BaseException:
        os.close(fd)
        remove(private)
        raise
    return StagingLock(fd)


def remove_stale_siblings(path: Path) -> None:
    """Delete what interrupted saves to ``path`` left behind: staging directories no live writer holds, and (when a
    checkpoint is at ``path``) copies moved aside by an interrupted overwrite. Never the only copy of a checkpoint,
    never another job's live staging directory."""
    for staging in siblings(path, "tmp"):
        if _is_abandoned(staging):
            remove(staging)
    with DirectoryLock(path.parent):  # not between another writer's two renames
        if path.exists():
            for old in siblings(path, "old"):
                remove(old)


def _is_abandoned(staging: Path) -> bool:
    """Whether no live writer holds ``staging``'s lock (a staging directory, or a full checkpoint's staging file)."""
    if staging.is_symlink():
        return True
    try:
        fd = os.open(staging, os.O_RDONLY)
    except FileNotFoundError:
        return False  # renamed into place or removed meanwhile
    try:
        return _try_lock(fd, unsupported=False)
    finally:
        os.close(fd)


def _try_lock(fd: int, unsupported: bool = False) -> bool:
    """Take an exclusive ``flock`` on ``fd`` without waiting: ``True`` if taken, ``False`` if another holds it;
    ``unsupported`` where the file system has no ``flock``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF, errno.EINVAL):
            return unsupported
        raise


class DirectoryLock:
    """An exclusive ``flock`` on a directory for the duration of a ``with`` block (none where unsupported)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.fd: Optional[int] = None

    def __enter__(self) -> "DirectoryLock":
        self.fd = os.open(self.directory, os.O_RDONLY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF, errno.EINVAL):
                os.close(self.fd)
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def replace(staging: Path, path: Path, token: str) -> None:
    """Put ``staging`` at ``path``; an existing checkpoint there is moved aside first and deleted last. The renames
    run under the parent directory's lock (see [Note: writers that cannot collide])."""
    old = None
    with DirectoryLock(path.parent):
        if path.exists() or path.is_symlink():
            old = path.parent / f".{path.name}.old-{token}"
            os.rename(path, old)
        os.rename(staging, path)
        fsync_dir(path.parent)
    if old is not None:
        remove(old)


def siblings(path: Path, kind: str) -> list[Path]:
    """``.<name>.tmp-*`` / ``.<name>.old-*`` next to ``path`` (no glob: checkpoint names contain ``[`` and ``=``)."""
    prefix = f".{path.name}.{kind}-"
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefix)) if path.parent.is_dir() else []


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
