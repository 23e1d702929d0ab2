"""A line for the user on stderr that never changes how the process ends.

[Note: a message nobody can read is not an error]
The lines printed while a run stops (the agreed stop, the shutdown deadline, the one report of a failure) go to a
stderr that may be a pipe: ``python train.py 2>&1 | tee log``. Ctrl-C reaches ``tee`` too, which ends at once, and a
write to a pipe without a reader raises ``BrokenPipeError`` (Python ignores ``SIGPIPE``) where the stop was under
way, and again when the interpreter flushes the stream at exit: the exit status is then that of the failed write,
not the documented one. So such a line is dropped when it cannot be written, and the stream's descriptor is pointed
at ``os.devnull`` (what Python's documentation advises for ``SIGPIPE``), stdout's too when it is the same pipe
(``2>&1``): later writes, Lightning's own messages and the flush at exit included, go nowhere instead of failing.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, TextIO


def say(line: str, stream: Optional[TextIO] = None) -> None:
    """Print ``line`` on ``stream`` (stderr); if nobody reads it any more, drop it and silence the stream (see
    [Note: a message nobody can read is not an error])."""
    stream = stream if stream is not None else sys.stderr
    try:
        print(line, file=stream, flush=True)
    except (OSError, ValueError):  # a pipe without a reader, or a stream already closed
        others = [s for s in (sys.stdout, sys.stderr) if s is not None and s is not stream and _same_file(s, stream)]
        for each in [stream, *others]:  # the same pipe found before any of them is silenced
            _silence(each)


def _same_file(a: TextIO, b: TextIO) -> bool:
    """Whether two streams write to the same open file (``2>&1``)."""
    try:
        return os.path.sameopenfile(a.fileno(), b.fileno())
    except (OSError, ValueError, AttributeError):
        return False


def _silence(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at ``os.devnull`` (nothing if it has none)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is an OSError and a ValueError
        pass
