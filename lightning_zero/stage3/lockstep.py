"""Stage 3: every rank says which unit it is about to run, so ranks out of step fail together, naming the unit.

[Note: the lockstep check]
Stage 3's unit gathers follow the model's control flow, and every rank must issue the same ones in the same order
(see [Note: lockstep and prefetch] in ``units.py``). A rank whose control flow skips a unit breaks that silently:
its next all-gather is matched with another unit's of the same size, and the job fails later, somewhere else, or
waits for the process group timeout (30 minutes by default) on a collective no other rank issues. So each unit's
pre-forward and pre-backward hook sends ``(pass, unit, position in the recorded forward order)`` to every rank over a
gloo group of its own (on the CPU, whatever the device: no device synchronization; and never queued behind the data
collectives in flight). Up to the first divergence every rank sends the same checks, so the first check where the
ranks differ is compared on every rank: all of them fail there, with an error that names what each rank was about
to run and, from the recorded forward order, the units a rank skipped. Evaluation forwards are checked as well. Not
counted in the engine's ``traffic`` (control messages, not payload).

[Note: a check is waited for one unit late]
Waiting for each check where it is sent would make every unit a barrier: each rank would wait for the slowest at every
unit, in every pass (measured at 8% of zero3's step time on two CPU ranks). So a check is waited for at the next hook
instead (``UnitRuntime._wait_for_previous_check`` in ``units.py``), one unit's compute later, and the collectives that
depend on it wait with it: what a hook prefetches comes from the *verified* previous unit (its successors in the
recorded order), never from the unit the hook is about to run; at the end of a pass nothing more is prefetched from it
(``UnitRuntime._end_check``). A hook whose unit is not already gathered by such a prefetch, or that starts a pass, waits
for its own check before it gathers (its gather depends on this rank's control flow alone), and so does any
reduce-scatter (before it is launched) and every runtime call between steps. So every data collective a rank issues
follows from checks that every rank has seen agree, and when two ranks diverge, what each has in flight was issued by
all of them alike: they wait for it (it completes) and fail at most one unit after the divergence, with the same error.
At most one check is in flight per rank, sent only once the one before agreed. What is given up: a unit's forward runs
before its check is compared, so a collective of the user's own inside the diverging unit (``SyncBatchNorm``, a
tensor-parallel layer whose peers diverged) meets its mismatch before the check does; ``lockstep_check="strict"`` waits
at every hook, as before.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from lightning_zero.comm import collectives
from lightning_zero.stage3.unit import FORWARD, TrainingPhase


class RanksOutOfStepError(RuntimeError):
    """Stage 3 ranks ran different units at the same point (see [Note: the lockstep check])."""


class LockstepCheck:
    """Exchanges each rank's next unit; ``finish`` raises ``RanksOutOfStepError`` when they differ.

    Made by every rank at setup (a collective: it makes the check's process group once per job). One check is in
    flight at a time (see [Note: a check is waited for one unit late]).
    """

    def __init__(self, names: Sequence[str], strict: bool = False) -> None:
        self.names = list(names)
        self.strict = strict
        """Whether every check is waited for where it is sent (``lockstep_check="strict"``)."""
        self.group: Optional[Any] = collectives.make_lockstep_group()
        self._in_flight: Optional[collectives.PendingPositions] = None

    @property
    def active(self) -> bool:
        """Whether there are other ranks to compare with."""
        return self.group is not None

    @property
    def in_flight(self) -> bool:
        """Whether a check was sent and not waited for."""
        return self._in_flight is not None

    def start(self, unit: int, phase: TrainingPhase, forward_order: Sequence[int]) -> None:
        """Collective: send this rank's next unit (its index in the plan) and pass to every rank (after the check
        before it was waited for)."""
        if self.group is None:
            return
        assert self._in_flight is None, "one lockstep check in flight at a time"
        position = forward_order.index(unit) if unit in forward_order else -1
        self._in_flight = collectives.PendingPositions([int(phase), unit, position], self.group)

    def finish(self, forward_order: Sequence[int]) -> None:
        """Wait for the check in flight (if any); raise on every rank if any rank sent another unit or pass.
        ``forward_order``: the recorded order (it only grows, so the positions sent with the check still hold)."""
        if self._in_flight is None:
            return
        pending, self._in_flight = self._in_flight, None
        rows = pending.result()
        if any(row != rows[0] for row in rows):
            raise RanksOutOfStepError(self.describe(rows, forward_order))

    def describe(self, rows: list[list[int]], forward_order: Sequence[int]) -> str:
        """What each rank was about to run, and which units a rank skipped (see ``skipped``)."""
        doing = "; ".join(
            f"rank {r}: the {_described(phase)} of stage 3 unit '{self.names[unit]}'"
            for r, (phase, unit, _) in enumerate(rows)
        )
        message = f"ZeRO stage 3: the ranks ran different units at the same point of the step ({doing})."
        skipped = self.skipped(rows, forward_order)
        if skipped:
            message += " " + skipped
        return f"{message} {collectives.DIVERGENCE_HINT}"

    def skipped(self, rows: list[list[int]], forward_order: Sequence[int]) -> str:
        """In a forward, the ranks ahead in the recorded forward order skipped the units between (empty if unknown)."""
        if any(phase != FORWARD or position < 0 for phase, _, position in rows):
            return ""
        first = min(position for _, _, position in rows)
        parts = []
        for r, (_, _, position) in enumerate(rows):
            if position > first:
                units = ", ".join(f"'{self.names[u]}'" for u in forward_order[first:position])
                parts.append(f"rank {r} skipped {units}")
        if not parts:
            return ""
        text = "; ".join(parts)
        return f"{text[0].upper()}{text[1:]} (in the order of the first step's forward)."


def _described(phase: int) -> str:
    """A pass received from a rank, in words (see ``TrainingPhase`` in ``unit.py``)."""
    try:
        return TrainingPhase(phase).described
    except ValueError:
        return "pass"
