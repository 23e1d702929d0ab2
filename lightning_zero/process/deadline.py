"""The shutdown deadline: a thread that ends this rank ``shutdown_timeout`` seconds after SIGTERM or SIGINT, whatever
the main thread is blocked in, and says which rank did not arrive.

[Note: the deadline does not need the main thread]
A Python signal handler runs on the main thread between two bytecodes. A main thread blocked in C++ (a gloo
collective whose peer never comes, a ``recv`` that never completes) runs no bytecode, so a deadline that a Python
handler starts is never started, and the run waits for the process group's timeout (30 minutes). What does run is
CPython's C-level handler, on whatever thread the kernel picked: it writes the signal's number to the *wakeup file
descriptor* (``signal.set_wakeup_fd``). ``Watchdog`` owns a socket pair: the C handler writes one end, a thread
of its own blocks reading the other, and on SIGTERM or SIGINT it starts the deadline. When the deadline passes while
the guard is still installed (the ranks did not stop and tear down), the thread reports (below) and ends the process
with ``128 + signal`` (143 for SIGTERM), without the main thread. The thread lives from the guard's ``install`` to its
``remove``, which joins it (see [Note: nothing outlives the run] in ``lightning/processes.py``).

[Note: who did not arrive]
At the deadline each rank's thread describes its main thread (``position``): how many step boundaries it passed
and whether it waits inside one of the package's collectives (a frame of ``comm/collectives.py`` on its stack), with
the innermost frame. It posts that to the job's key-value store (the one the process group was made with, through a
connection of its own: the main thread may hold the other, blocked), waits at most ``GRACE`` seconds for the
other ranks' posts, and prints one line: the ranks that did not arrive (not waiting in a collective while others do,
or fewer step boundaries behind them), where the others waited, and this rank's exit. Rank 0 serves the store, so it
ends last: it waits (at most ``GRACE`` seconds) until every rank that posted has read.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from types import FrameType
from typing import Any, Optional

from lightning_zero.comm import collectives
from lightning_zero.process.say import say

#: Seconds the report waits for the other ranks' positions (a safety net: they post at the same deadline).
GRACE = 10.0

#: The signals that start the deadline.
DEADLINE_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_STOP = b"\0"  # written by `Watchdog.stop` to wake the thread; no signal has number 0
_COLLECTIVES = os.path.join("lightning_zero", "comm", "collectives.py")


class Progress:
    """What the main thread has passed, read by the watchdog thread (plain attributes: written by one thread); the
    guard's, handed to each of its watchdogs."""

    def __init__(self) -> None:
        self.boundaries = 0
        """Step boundaries (safe points) this rank has passed since the guard was installed."""


class Watchdog:
    """The thread of [Note: the deadline does not need the main thread]; one per guard installation."""

    def __init__(self, timeout: float, generation: int, progress: Progress) -> None:
        self.timeout = timeout
        self.generation = generation
        self.progress = progress
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)  # `set_wakeup_fd` requires it; the C handler never blocks on a full buffer
        self._previous = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._expired = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning-zero-deadline", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Join the thread and give the wakeup descriptor back (main thread). Past the deadline the thread owns the
        process: this waits for it to end the process."""
        if self._expired.is_set():
            self._thread.join()  # the thread ends the process with `os._exit`
        self._writer.send(_STOP)
        self._thread.join()
        signal.set_wakeup_fd(self._previous)
        self._reader.close()
        self._writer.close()

    def _run(self) -> None:
        started: Optional[tuple[int, float]] = None  # (signal, monotonic time of its arrival)
        while True:
            left = None if started is None else started[1] + self.timeout - time.monotonic()
            if started is not None and left is not None and left <= 0:
                self._expired.set()
                _end(started[0], self.timeout, self.generation, self.progress.boundaries)
            ready = select.select([self._reader], [], [], left)[0]
            if not ready:
                continue
            data = self._reader.recv(64)
            if not data or _STOP in data:
                return
            for signum in data:
                if started is None and signum in DEADLINE_SIGNALS:
                    started = (signum, time.monotonic())


def position(frame: Optional[FrameType], boundaries: int) -> dict[str, Any]:
    """This rank's place (see [Note: who did not arrive]): ``boundaries`` (as given), ``collective`` (the package's
    collective the main thread waits in, or ``None``) and ``at`` (its innermost frame, and the innermost outside torch
    and Lightning when that one is inside them)."""
    collective, frames = None, []
    while frame is not None:
        if frame.f_code.co_filename.endswith(_COLLECTIVES) and collective is None:
            what = frame.f_locals.get("what")
            # co_qualname is Python 3.11's; 3.10 names the function alone
            collective = getattr(frame.f_code, "co_qualname", frame.f_code.co_name) + (
                f" ({what})" if isinstance(what, str) else ""
            )
        frames.append(frame)
        frame = frame.f_back
    at = _where(frames[0]) if frames else "unknown"
    if frames and _library(frames[0]):
        caller = next((f for f in frames if not _library(f)), None)
        at += f", from {_where(caller)}" if caller is not None else ""
    return {"boundaries": boundaries, "collective": collective, "at": at}


def _where(frame: FrameType) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _library(frame: FrameType) -> bool:
    """Whether ``frame`` runs torch's or Lightning's code."""
    parts = frame.f_code.co_filename.split(os.sep)
    return "torch" in parts or "lightning" in parts


def describe(positions: dict[int, dict[str, Any]], world: int, signame: str, timeout: float, me: int) -> str:
    """The one line of [Note: who did not arrive] from every rank's ``position`` (missing: no answer)."""
    waiting = {r: p for r, p in positions.items() if p["collective"] is not None}
    if waiting and len(waiting) < len(positions):
        late = {r: p for r, p in positions.items() if r not in waiting}
    else:
        least = min(p["boundaries"] for p in positions.values())
        late = (
            {r: p for r, p in positions.items() if p["boundaries"] == least}
            if any(p["boundaries"] != least for p in positions.values())
            else {}
        )
        waiting = {r: p for r, p in positions.items() if r not in late}
    silent = [r for r in range(world) if r not in positions]
    parts = [
        f"rank {r} did not arrive (at {p['at']}, after step boundary {p['boundaries']})"
        for r, p in sorted(late.items())
    ]
    parts += [f"rank {r} did not answer (it ended, or its process is stuck without its deadline)" for r in silent]
    if not parts:
        parts = ["no rank is behind the others (a peer's connection failed, or the ranks issued different collectives)"]
    places = sorted({f"{p['collective'] or p['at']} after step boundary {p['boundaries']}" for p in waiting.values()})
    others = f"; ranks {', '.join(map(str, sorted(waiting)))} waited in {'; '.join(places)}" if waiting else ""
    return (
        f"lightning-zero: {signame} received and the ranks did not stop within `shutdown_timeout={timeout:g}`: "
        f"{'; '.join(parts)}{others}. Ending rank {me} (exit code {128 + signal.Signals[signame].value}); the last "
        "complete checkpoint is the state to resume from (raise `shutdown_timeout` if a step or a checkpoint "
        "write legitimately takes longer)."
    )


def _end(signum: int, timeout: float, generation: int, boundaries: int) -> None:
    """The deadline passed: post, gather, print the line, end the process (on the watchdog thread)."""
    me, world = collectives.rank(), collectives.world_size()
    mine = position(sys._current_frames().get(threading.main_thread().ident or -1), boundaries)
    try:
        positions = _exchange(mine, me, world, generation)
    except Exception:  # no store, or it is gone (rank 0 ended): report what this rank knows
        positions = {me: mine}
    say(describe(positions, world, signal.Signals(signum).name, timeout, me))
    os._exit(128 + signum)


def _exchange(mine: dict[str, Any], me: int, world: int, generation: int) -> dict[int, dict[str, Any]]:
    """Every rank's position through the job's store (see [Note: who did not arrive])."""
    store = _store_connection()
    if store is None or world == 1:
        return {me: mine}
    prefix = f"lightning_zero/deadline/{collectives.restart_attempt()}/{generation}"  # torchrun's store outlives it
    store.set(f"{prefix}/at/{me}", json.dumps(mine))
    keys = [f"{prefix}/at/{r}" for r in range(world)]
    _wait(store, keys)  # a rank that never posts (ended, or no deadline of its own) is reported without
    positions = {r: json.loads(store.get(k)) for r, k in enumerate(keys) if store.check([k])}
    store.set(f"{prefix}/read/{me}", "1")
    if me == 0:  # the store lives in this process: let the others read before it goes
        _wait(store, [f"{prefix}/read/{r}" for r in positions])
    return positions


def _wait(store: Any, keys: list[str]) -> bool:
    """Whether every key of ``keys`` was set within ``GRACE`` seconds."""
    try:
        store.wait(keys, timedelta(seconds=GRACE))
    except Exception:  # the store's timeout (a DistStoreError) or its connection gone
        return False
    return True


def _store_connection() -> Optional[Any]:
    """A connection of its own to the store of the default process group (``None`` without one)."""
    store = collectives.job_store()
    while store is not None and not hasattr(store, "clone") and hasattr(store, "underlying_store"):
        store = store.underlying_store
    if store is None or not hasattr(store, "clone"):
        return None
    connection = store.clone()
    connection.set_timeout(timedelta(seconds=GRACE))
    return connection
