"""Stage 3: every rank says which unit it is about to run before it gathers one, so ranks out of step fail at once.

[Note: the lockstep check]
Stage 3's unit gathers follow the model's control flow, and every rank must issue the same ones in the same order
(see [Note: lockstep and prefetch] in ``units.py``). A rank whose control flow skips a unit breaks that silently:
its next all-gather is matched with another unit's of the same size, and the job fails later, somewhere else, or
waits for the process group timeout (30 minutes by default) on a collective no other rank issues. So each unit's
pre-forward and pre-backward hook first exchanges ``(pass, unit, position in the recorded forward order)`` with every
rank, synchronously, over a gloo group of its own (on the CPU, whatever the device: no device synchronization; and
never queued behind the data collectives in flight). Up to the first divergence every rank issues the same checks, so
the first hook where the ranks differ is a check on every rank: all of them fail there, at once, with an error that
names what each rank was about to run and, from the recorded forward order, the units a rank skipped. The cost is one
small round trip per unit per pass (forward, backward); evaluation forwards are checked as well. Not counted in
the engine's ``traffic`` (control messages, not payload).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from lightning_zero.core import collectives

FORWARD, RECOMPUTE, BACKWARD = 0, 1, 2
_PASSES = {FORWARD: "forward", RECOMPUTE: "recomputed forward", BACKWARD: "backward"}


class RanksOutOfStepError(RuntimeError):
    """Stage 3 ranks ran different units at the same point (see [Note: the lockstep check])."""


class LockstepCheck:
    """Exchanges each rank's next unit before it is gathered; raises :class:`RanksOutOfStepError` when they differ.

    Made by every rank at setup (a collective: it makes the check's process group once per job).
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.group: Optional[Any] = collectives.make_lockstep_group()

    def check(self, unit: int, phase: int, forward_order: Sequence[int]) -> None:
        """Collective: raise on every rank if any rank is about to run another unit or pass than this one."""
        if self.group is None:
            return
        position = forward_order.index(unit) if unit in forward_order else -1
        rows = collectives.exchange_positions([phase, unit, position], self.group)
        if any(row != rows[0] for row in rows):
            raise RanksOutOfStepError(self.describe(rows, forward_order))

    def describe(self, rows: list[list[int]], forward_order: Sequence[int]) -> str:
        """What each rank was about to run, and which units a rank skipped (see :meth:`skipped`)."""
        doing = "; ".join(f"rank {r}: the {_PASSES.get(phase, 'pass')} of stage 3 unit '{self.names[unit]}'"
                          for r, (phase, unit, _) in enumerate(rows))
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
