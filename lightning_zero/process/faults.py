"""Fault points: places where tests deliver a signal (or a file-system error) deterministically, instead of by timing.
The one test seam for fault injection: no other module keeps fault state or reads the variable.

[Note: fault points]
``fault_point(name)`` marks a place (inside a checkpoint write, before a gradient bucket's reduce-scatter, between
two units of stage-3 construction, at an evaluation step). The one way to arm a fault is the environment variable
``LIGHTNING_ZERO_FAULT`` (so that it reaches every rank a test launches), e.g.
``point=save.written,signal=SIGINT,rank=0,target=group,occurrence=2``: the second time rank 0 reaches
``save.written`` it sends SIGINT to its process group (what Ctrl-C does; ``target=self``, the default, signals only
this process). The variable is read at each fault point, not at import: setting, changing or removing it arms,
re-arms (counting occurrences from zero) or disarms from the next point on. Unset, a fault point costs a function
call and an environment lookup. The points (``POINTS``; ``tests/test_faults.py`` checks that the package
marks exactly these): ``save.written`` (every rank's shard files written, before ``meta.pt``), ``save.full`` (a full
checkpoint's file written, before its rename), ``collective.reduce_scatter`` (before a gradient bucket's
reduce-scatter, in the reducer; no collective carries a fault point), ``materialize.unit`` (before a stage-3 unit
is built), ``evaluation.step`` (at a validation/test/predict step), ``save.prepare`` (rank 0 about to clear stale
staging directories and make a sharded checkpoint's staging directory), ``save.shard`` (inside DCP's write, as each
piece of a shard is written), ``offload.create`` (a file of the disk tier about to be made) and
``offload.write`` (a window of the disk tier written back, see ``disk.py``).

Instead of a signal, ``error=<errno name>`` raises that ``OSError`` at the point, as the file system would (e.g.
``point=save.written,error=ENOSPC,rank=1``: a full disk on rank 1; ``point=save.prepare,error=EACCES``: a read-only
directory, which a test running as root cannot make with ``chmod``).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from typing import Optional

from lightning_zero.comm import collectives

#: Every fault point the package marks (see [Note: fault points]).
POINTS = (
    "save.written",
    "save.full",
    "collective.reduce_scatter",
    "materialize.unit",
    "evaluation.step",
    "save.prepare",
    "save.shard",
    "offload.create",
    "offload.write",
)

VARIABLE = "LIGHTNING_ZERO_FAULT"


def parse(spec: str) -> dict[str, str]:
    """The fields of a ``LIGHTNING_ZERO_FAULT`` value; a clear error for one that names no known point."""
    fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    if fields.get("point") not in POINTS:
        raise ValueError(
            f"{VARIABLE}={spec!r} names no fault point; name one of {', '.join(POINTS)}, e.g. "
            "'point=save.written,signal=SIGINT'."
        )
    return fields


class _Armed:
    """The fault the variable asks for, and how often this process has reached its point since it was set."""

    def __init__(self) -> None:
        self.spec = ""
        self.fields: dict[str, str] = {}
        self.reached = 0

    def due(self, name: str) -> Optional[dict[str, str]]:
        """The fault's fields if it is due at this reach of ``name`` (on this rank), else ``None``."""
        spec = os.environ.get(VARIABLE, "")
        if spec != self.spec:  # armed, re-armed or disarmed since the last point
            self.spec, self.fields, self.reached = spec, parse(spec) if spec else {}, 0
        if self.fields.get("point") != name:
            return None
        rank = collectives.rank()
        if "rank" in self.fields and int(self.fields["rank"]) != rank:
            return None
        self.reached += 1
        return self.fields if self.reached == int(self.fields.get("occurrence", "1")) else None


# [Note: the armed fault is the process's]
# The seam is driven by an environment variable, which is the process's, and its points sit in code that holds no
# engine (the disk tier, the guard, checkpoint writes); so what the variable said at the last point and how often
# the point was reached since are one object per process too. A new value of the variable starts the count again.
_ARMED = _Armed()


def fault_point(name: str) -> None:
    """Deliver the signal (or raise the error) ``LIGHTNING_ZERO_FAULT`` asks for here (see [Note: fault points]);
    otherwise nothing."""
    fault = _ARMED.due(name)
    if fault is None:
        return
    if "error" in fault:
        code = getattr(errno, fault["error"])
        raise OSError(code, f"{os.strerror(code)} (injected by {VARIABLE} at {name})")
    signum = getattr(signal, fault.get("signal", "SIGINT"))
    print(f"lightning-zero fault point {name}: sending {signum.name} at {time.time()}", file=sys.stderr, flush=True)
    if fault.get("target", "self") == "group":
        os.killpg(os.getpgrp(), signum)
    else:
        os.kill(os.getpid(), signum)
