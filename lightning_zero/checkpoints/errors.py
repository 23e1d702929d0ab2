"""Checkpoint errors, and failed saves agreed on by every rank.

[Note: a failed save is agreed on]
A save is a sequence of steps, some of them on rank 0 alone (clearing stale staging directories, making the staging
directory, writing ``meta.pt``, the rename) and some collective (DCP's write, gathering the file sizes). A step that
can fail on one rank is followed by ``agree_on_failure`` before the next collective: every rank learns which
rank failed and why, and every rank raises the same ``CheckpointError``, which names the rank, the step, the
errno and what to do. Otherwise the ranks that did not fail would wait in the next collective until the other one's
socket closes (gloo: "Connection closed by peer", no cause) or the process-group timeout (NCCL: 30 minutes).

The error is an ``Exception`` (DCP's own ``CheckpointException`` is a ``BaseException``, which ``except Exception``
around ``save_checkpoint`` does not catch), so a training script can catch a full disk and go on; and because every
rank raises it at the same point, Lightning's teardown still finds the ranks in step.
"""

from __future__ import annotations

import errno as errnos
from pathlib import Path
from typing import Callable, Optional

from torch.distributed.checkpoint.api import CheckpointException

from lightning_zero.comm import collectives

# what went wrong on one rank: (rank, exception type, message, errno or None)
Report = tuple[int, str, str, Optional[int]]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (not ours, incomplete, damaged, from a different model), or a save that
    failed: then ``rank`` is the rank it failed on and ``errno`` the operating system's error number, if any."""

    def __init__(self, message: str, rank: Optional[int] = None, errno: Optional[int] = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.errno = errno


def agree_on_failure(path: Path, doing: str, failed: Optional[BaseException]) -> None:
    """Collective: raise on every rank if ``doing`` (a step of saving ``path``) failed on any rank.

    ``failed`` is this rank's exception, if any. An interrupt (``KeyboardInterrupt``, ``SystemExit``) on this rank is
    re-raised as it is; everything else becomes a ``CheckpointError`` (see [Note: a failed save is agreed on]).
    """
    every = collectives.all_gather_objects(None if failed is None else _reports(failed))
    reports = sorted({report for part in every if part for report in part})
    if not reports:
        return
    if failed is not None and not isinstance(failed, (Exception, CheckpointException)):
        raise failed
    rank, kind, message, code = reports[0]
    name = f" [{errnos.errorcode.get(code, code)}]" if code is not None else ""
    others = f" (and on rank {', '.join(str(r[0]) for r in reports[1:])})" if len(reports) > 1 else ""
    text = (
        f"Saving the checkpoint {path} failed on rank {rank}{others} while {doing}: {kind}{name}: {message}. "
        f"{_advice(code, path)}Nothing was written under that name; the checkpoint it had before, if any, is "
        "intact."
    )
    raise CheckpointError(text, rank=rank, errno=code) from failed


def _reports(error: BaseException) -> list[Report]:
    """What went wrong where: DCP's ``CheckpointException`` names each failed rank, anything else is this rank's."""
    if isinstance(error, CheckpointException):
        return [
            (rank, type(exc).__name__, _message(exc), getattr(exc, "errno", None))
            for rank, (exc, _) in sorted(error.failures.items())
        ]
    if isinstance(error, CheckpointError) and error.rank is not None:
        return [(error.rank, type(error).__name__, str(error), error.errno)]
    return [(collectives.rank(), type(error).__name__, _message(error), getattr(error, "errno", None))]


def _message(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename!r}" if error.filename else ""
        return f"{error.strerror}{where}"
    return str(error) or repr(error)


def _advice(code: Optional[int], path: Path) -> str:
    if code in (errnos.ENOSPC, errnos.EDQUOT):
        return f"The disk (or the quota) of {path.parent} is full: free space there, or save to another directory. "
    if code in (errnos.EACCES, errnos.EPERM, errnos.EROFS):
        return (
            f"This job may not write in {path.parent}: make it writable by the job, or save to another directory "
            "(e.g. `ModelCheckpoint(dirpath=...)`). "
        )
    return ""


def agree_on_check(check: Callable[[], None]) -> None:
    """Run ``check`` on every rank; if it raised on any, raise the first rank's error on every rank."""
    try:
        check()
        mine: Optional[str] = None
    except (CheckpointError, FileNotFoundError) as error:
        mine = str(error)
    errors = [e for e in collectives.all_gather_objects(mine) if e is not None]
    if errors:
        raise CheckpointError(errors[0])
