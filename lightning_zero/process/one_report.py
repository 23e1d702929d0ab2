"""An error raised by several ranks is printed once, naming the ranks; each rank's traceback goes to a log file.

[Note: one report for the ranks that raised]
The ranks of a job share one terminal. When all of them raise (a bug in ``training_step``, a refused checkpoint),
Python prints each rank's traceback, and two to four copies of the same 40 lines come out interleaved. So when a run
stops on an exception, each rank that raised writes its traceback to ``<log_dir>/rank<r>.log``, posts its error's
type and message to the job's key-value store, and waits at most ``REPORT_WAIT`` seconds for the other ranks'
(ranks that raise the same error post at once; a rank that did not raise is not waited for longer). The lowest rank
that posted then prints one line instead of its traceback: the error, the ranks that raised it and where the
tracebacks are; a rank that raised the same error prints nothing, one that raised another error prints its own
line. The lines replace the tracebacks through ``sys.excepthook``, which prints an error that ends the script;
only that exception's report is replaced (``KeyboardInterrupt`` and ``SystemExit`` are left as they are). Rank 0
serves the store, so it waits (as long) until every rank that posted has read. Any failure of the store (a rank 0
already gone) leaves Python's own traceback.
"""

from __future__ import annotations

import itertools
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, Optional

from lightning_zero.comm import collectives
from lightning_zero.process.say import say

#: Seconds a rank that raised waits for the other ranks' errors.
REPORT_WAIT = 5.0

_PREFIX = "lightning_zero/error"
# [Note: one report per process]
# `sys.excepthook` is one per process, and so are the exception it is about to print and the hook it replaced; the
# key counter numbers this process's reports in the job's store (one store per job), so that a second report of the
# same process never reads the first one's posts.
_count = itertools.count()
# the last exception reported and what replaces its traceback ("" for nothing); the exception itself, not its id (an
# id is reused once the object is freed), and only the last one
_pending: list[tuple[BaseException, str]] = []
_previous_hook = sys.excepthook


def report_once(error: BaseException, log_dir: Path) -> None:
    """Agree with the other ranks that raised on what each prints for ``error`` (see [Note: one report for the
    ranks that raised]); does nothing without a process group of more than one rank."""
    if not isinstance(error, Exception) or not collectives.is_distributed():
        return
    me, world = collectives.rank(), collectives.world_size()
    log = Path(log_dir) / f"rank{me}.log"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(traceback.format_exception(error)))
        store = collectives.job_store()
        posted = _exchange(store, f"{_PREFIX}/{next(_count)}", me, world, f"{type(error).__name__}: {error}")
    except (OSError, RuntimeError):
        return
    first = min(posted)
    same = [r for r, text in sorted(posted.items()) if text == posted[first]]
    ranks = f"rank {same[0]}" if len(same) == 1 else f"ranks {', '.join(map(str, same))}"
    if me == first:
        line = f"{posted[first]}\n[raised on {ranks} of {world}; each rank's traceback: {log.parent}/rank<r>.log]"
    elif posted[me] == posted[first]:
        line = ""
    else:
        line = f"{posted[me]}\n[raised on rank {me}; its traceback: {log}]"
    _pending[:] = [(error, line)]
    sys.excepthook = _excepthook


def _exchange(store: Any, key: str, me: int, world: int, text: str) -> dict[int, str]:
    """Post ``text``; every rank's that came within ``REPORT_WAIT`` seconds, by rank."""
    store.set(f"{key}/{me}", text)
    keys = [f"{key}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=REPORT_WAIT))
    except RuntimeError:  # some ranks did not raise (or not yet): report those that did
        pass
    posted = {r: store.get(k).decode() for r, k in enumerate(keys) if store.check([k])}
    store.add(f"{key}/read", 1)
    deadline = time.monotonic() + REPORT_WAIT
    while me == 0 and store.add(f"{key}/read", 0) < len(posted) and time.monotonic() < deadline:
        time.sleep(0.05)  # the store's server: stay until every rank that posted has read
    return posted


def _excepthook(kind: type[BaseException], error: BaseException, tb: Optional[TracebackType]) -> None:
    if not _pending or _pending[0][0] is not error:
        _previous_hook(kind, error, tb)
        return
    line = _pending.pop()[1]
    if line:
        say(line)
