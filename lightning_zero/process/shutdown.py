"""Clean shutdown on Ctrl-C and SIGTERM, wherever the signal lands, and fault points that tests drive signals to.

[Note: signals act at agreed step boundaries]
Python runs a signal handler between two bytecodes of the main thread, wherever that is. The default SIGINT handler
raises ``KeyboardInterrupt`` there: inside a write callback that C++ called (``torch.save`` under a DCP checkpoint
write: "write to closed file", then ``terminate`` and SIGABRT), or on one rank between two collectives that the
other ranks then wait for. Lightning's own SIGTERM handler even issues a broadcast from inside the handler, matched
against whatever collective the other ranks are in.

While a ZeRO run is set up or trains, ``SignalGuard`` replaces those handlers with one that only *records* the
signal. At every safe point (the start of each training, validation, test and predict step, and between two units of
stage-3 construction) every rank calls ``SignalGuard.safe_point``: one tiny all-reduce tells every rank what any
rank received, and all of them act on it at the same place: SLURM's requeue signal runs Lightning's requeue handler
(which saves a checkpoint: a collective, now issued by every rank at the same point), SIGINT and SIGTERM raise
``Stopped`` on every rank. A checkpoint write is never interrupted: it completes, or fails as a whole, before the
next safe point. ``Stopped`` is a ``KeyboardInterrupt``, so Lightning's own graceful-shutdown path runs (callbacks'
``on_exception``, teardown, exit code 1).

A second Ctrl-C while one is pending raises ``KeyboardInterrupt`` at once (outside a checkpoint write): the way out
when a rank is stuck where no safe point comes (a hung data loader, a peer that died); that rank then makes no claim
that the ranks stopped together. A signal still pending when the run ends is raised at teardown, once the run's last
checkpoint is complete.

[Note: a SIGTERM is acted on within a bound]
A batch system sends SIGTERM once and SIGKILL some time later; nobody presses Ctrl-C twice. A rank stuck away from
any safe point (a hung data loader, a peer waiting in a collective for it, a ``recv`` that never completes) would
never act on the signal, and the job would end by SIGKILL or the process-group timeout (30 minutes) with no word of
where it was. So a SIGTERM or SIGINT starts a deadline of ``shutdown_timeout`` seconds (120 by default; ``None``: no
bound), kept by a thread that needs nothing from the main thread (see [Note: the deadline does not need the main
thread] in ``deadline.py``): if the guard has not been removed by then (the ranks stopped and tore down), every rank
that received the signal prints one line naming the rank that did not arrive and where the others waited, and ends
with ``128 + signal`` (143 for SIGTERM). A checkpoint write in progress is ended too: the checkpoint under its name is
the previous one (see [Note: complete or absent] in ``checkpoints/storage.py``), so set the bound above the longest
write.

[Note: a failed run claims no agreed stop]
A rank whose collective failed (a peer ended: "Connection closed by peer") goes through Lightning's exception path to
teardown with the signal still pending. The ranks did not stop together there, so ``SignalGuard.raise_pending``
then says what happened in one line and lets the failure propagate, instead of raising ``Stopped``.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any, Callable, Optional, Union

from lightning_zero.comm import collectives
from lightning_zero.comm.groups import ShardGroups
from lightning_zero.process import deadline
from lightning_zero.process.say import say

Handler = Union[Callable[[int, Optional[FrameType]], Any], int, None]

#: Seconds a recorded SIGTERM may go unacted on before the process ends (the option ``shutdown_timeout``).
DEFAULT_SHUTDOWN_TIMEOUT = 120.0

#: The signals the guard records, in the order of the agreement vector.
GUARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Stopped(KeyboardInterrupt):
    """Every rank stops at the same step boundary because a rank received SIGINT or SIGTERM."""


class SignalGuard:
    """Records SIGINT, SIGTERM and SLURM's requeue signal, and acts on them at agreed safe points.

    See [Note: signals act at agreed step boundaries].

    [Note: one guard per process]
    The guard stays one object per process (``GUARD``), not a part of the communication object
    (``ShardGroups``): what it guards is process state by nature. A signal is
    delivered to the process, ``signal.signal`` keeps one handler per signal per process, and a checkpoint write
    (``with GUARD:``) must hold off a signal whichever engine's write it is. Two guards would fight over the same
    handlers. Only its agreement is communication, and that goes over the ``ShardGroups`` each caller passes to
    ``SignalGuard.safe_point`` (counted as ``control`` under ``"world"`` in its traffic), so the guard holds no
    process group and no counter. It costs one small all-reduce per step (benchmarks/RESULTS.md, "The signal
    guard's step boundary") and is kept: it is what lets every rank stop at the same step.
    """

    def __init__(self) -> None:
        self.pending: dict[int, int] = {}
        """Signal number to how many times it arrived since the last safe point acted on it."""
        self.original: dict[int, Handler] = {}
        """The handler each guarded signal had before the guard first took it in this process: restored by
        ``remove``, and what the signal does while the guard is inactive."""
        self.adopted: dict[int, Handler] = {}
        """Handlers registered over the guard's during this run (Lightning's), replaced by it again; SLURM's
        requeue handler among them is run at a safe point."""
        self.active = False
        self.critical = 0
        """Nesting depth of sections that must not be interrupted (checkpoint writes)."""
        self.shutdown_timeout: Optional[float] = DEFAULT_SHUTDOWN_TIMEOUT
        """Seconds a recorded SIGTERM may go unacted on (see [Note: a SIGTERM is acted on within a bound])."""
        self._watchdog: Optional[deadline.Watchdog] = None
        self._generation = 0
        self.progress = deadline.Progress()
        """The step boundaries passed since ``install``, which the watchdog reports at the deadline."""
        self._handler = self._record  # one bound method object, so that `signal.getsignal(...) is` compares
        self.where: Optional[Callable[[], str]] = None
        """The adapter's description of where the run stopped, for the stop message: the step and the checkpoint to
        resume from (``None``: the message names neither)."""

    # ------------------------------------------------------------------ installing
    def install(self, shutdown_timeout: Optional[float] = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        """Take over the guarded signals (main thread only; a no-op elsewhere). ``shutdown_timeout``: see
        [Note: a SIGTERM is acted on within a bound] (``None``: no bound)."""
        if not _main_thread():
            return
        self.shutdown_timeout = shutdown_timeout
        self.active = True
        self.where = None
        self.adopted = {}
        for signum in GUARDED:
            if _worth_taking(signum):
                self._take(signum)
        self.progress.boundaries = 0
        if self._watchdog is None and shutdown_timeout is not None:
            self._generation += 1
            self._watchdog = deadline.Watchdog(shutdown_timeout, self._generation, self.progress)

    def retake(self) -> None:
        """Take back signals whose handler was replaced since ``install`` (Lightning registers its own after
        the strategy's setup); the replacing handler is adopted (see ``adopted``)."""
        if self.active and _main_thread():
            for signum in GUARDED:
                if signal.getsignal(signum) is not self._handler and _worth_taking(signum):
                    self._take(signum)

    def _take(self, signum: int) -> None:
        current = signal.getsignal(signum)
        if current is not self._handler:
            # [Note: never delegate to a handler that calls the guard] Lightning's SIGTERM handler calls the handler
            # it found (the guard's): only the first handler ever found is the original one.
            self.original.setdefault(signum, current)
            if self.active and signum in self.original and self.original[signum] is not current:
                self.adopted[signum] = current
            signal.signal(signum, self._handler)

    def remove(self) -> None:
        """Give the signals back to the handlers they had. A handler copy that Lightning restores later still
        delegates to them (the guard is inactive)."""
        self.active = False
        if not _main_thread():
            return
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        for signum, handler in self.original.items():
            if signal.getsignal(signum) is self._handler:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    # ------------------------------------------------------------------ receiving
    def _record(self, signum: int, frame: Optional[FrameType]) -> None:
        if not self.active:
            self._delegate(signum, frame)
            return
        self.pending[signum] = self.pending.get(signum, 0) + 1
        if signum == signal.SIGINT and self.pending[signum] > 1 and not self.critical:
            self.pending.clear()  # this rank stops alone: nothing is left for `raise_pending` to claim
            self.active = False
            raise KeyboardInterrupt("second Ctrl-C: stopping at once, not at the next step boundary")

    def _delegate(self, signum: int, frame: Optional[FrameType]) -> None:
        """What the signal would have done without the guard."""
        handler = self.original.get(signum, signal.SIG_DFL)
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # ------------------------------------------------------------------ acting
    def safe_point(self, groups: ShardGroups) -> None:
        """Collective: every rank calls this at the same place. Acts on what any rank received; the agreement is
        counted in ``groups``' traffic (see [Note: one guard per process])."""
        if not self.active:
            return
        self.retake()
        self.progress.boundaries += 1
        mine = [min(self.pending.get(s, 0), 1) for s in GUARDED]
        agreed = collectives.agree_max(mine, groups.world)
        if not any(agreed):
            return
        self.pending.clear()
        self._act(dict(zip(GUARDED, agreed)))

    def _act(self, agreed: dict[int, int]) -> None:
        if agreed[signal.SIGUSR1]:
            handler = self.adopted.get(signal.SIGUSR1, self.original.get(signal.SIGUSR1))
            if callable(handler):  # Lightning's SLURM requeue: saves a checkpoint (every rank, here), requeues
                handler(signal.SIGUSR1, None)
        name = "SIGTERM" if agreed[signal.SIGTERM] else "SIGINT" if agreed[signal.SIGINT] else None
        if name is not None:
            self.active = False
            raise Stopped(_reason(name, self._where()))

    def _where(self) -> str:
        """Where the run stopped, from the adapter (empty if it says nothing, or fails to)."""
        try:
            return self.where() if self.where is not None else ""
        except Exception:
            return ""

    def raise_pending(self, failure: Optional[BaseException] = None) -> None:
        """At the end of a run: a SIGINT or SIGTERM that arrived after the last safe point still stops the script.
        After a ``failure`` (the run is ending on an exception) it is only reported: see [Note: a failed run claims
        no agreed stop]."""
        signums = [s for s in (signal.SIGTERM, signal.SIGINT) if self.pending.get(s)]
        self.pending.clear()
        if not signums:
            return
        self.active = False
        name = signal.Signals(signums[0]).name
        if failure is not None and not isinstance(failure, KeyboardInterrupt):
            say(
                f"lightning-zero: {name} received on rank {collectives.rank()}, but the run failed before the ranks "
                f"could stop together ({type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''}"
                "); the last complete checkpoint is the state to resume from."
            )
            return
        raise Stopped(_reason(name, self._where()))

    def __enter__(self) -> "SignalGuard":
        """A section no signal interrupts (a checkpoint write); the signal is acted on at the next safe point."""
        self.critical += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self.critical -= 1


def _reason(name: str, where: str = "") -> str:
    """The stop message (printed by rank 0; see [Note: a message nobody can read is not an error] in ``say.py``):
    ``where`` is the adapter's "at global step N. Resume ..." (see ``SignalGuard.where``)."""
    position = where or ". The last complete checkpoint is the state to resume from."
    message = f"lightning-zero: {name} received; every rank stopped at the same step boundary{position}"
    if collectives.rank() == 0:
        say(message)
    return message


def _worth_taking(signum: int) -> bool:
    """Not a signal the process ignores (``nohup``); SIGUSR1 only where somebody handles it (Lightning's SLURM
    requeue): its default is to end the process."""
    current = signal.getsignal(signum)
    if current == signal.SIG_IGN:
        return False
    return signum != signal.SIGUSR1 or callable(current)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


#: The guard of this process (one run at a time): see [Note: one guard per process].
GUARD = SignalGuard()
