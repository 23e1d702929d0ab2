"""Fault points: places where tests deliver a signal deterministically, instead of by timing.

[Note: fault points]
``fault_point(name)`` marks a place (inside a checkpoint write, inside a collective, between two units of stage-3
construction, at an evaluation step). The environment variable ``LIGHTNING_ZERO_FAULT`` selects one, e.g.
``point=save.written,signal=SIGINT,rank=0,target=group,occurrence=2``: the second time rank 0 reaches
``save.written`` it sends SIGINT to its process group (what Ctrl-C does; ``target=self``, the default, signals only
this process). The variable is read at the first fault point, not at import. Unset, a fault point costs a function
call and a dictionary lookup. The points: ``save.written`` (every rank's shard files
written, before ``meta.pt``), ``save.full`` (a full checkpoint's file written, before its rename),
``collective.reduce_scatter`` (before a gradient bucket's reduce-scatter), ``materialize.unit`` (before a stage-3
unit is built), ``evaluation.step`` (at a validation/test/predict step), ``save.prepare`` (rank 0 about to clear
stale staging directories and make a sharded checkpoint's staging directory), ``save.shard`` (inside DCP's write,
as each piece of a shard is written), ``offload.create`` (a file of the disk tier about to be made) and
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

import torch.distributed as dist


def _parse(spec: Optional[str]) -> Optional[dict[str, str]]:
    if not spec:
        return None
    fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    if "point" not in fields:
        raise ValueError(f"LIGHTNING_ZERO_FAULT={spec!r} names no point; e.g. 'point=save.written,signal=SIGINT'.")
    return fields


_FAULT: Optional[dict[str, str]] = None  # parsed at the first fault point; {} when unset
_REACHED: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Deliver the signal ``LIGHTNING_ZERO_FAULT`` asks for here (see [Note: fault points]); otherwise nothing."""
    global _FAULT
    if _FAULT is None:
        _FAULT = _parse(os.environ.get("LIGHTNING_ZERO_FAULT")) or {}
    if _FAULT.get("point") != name:
        return
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if "rank" in _FAULT and int(_FAULT["rank"]) != rank:
        return
    _REACHED[name] = _REACHED.get(name, 0) + 1
    if _REACHED[name] != int(_FAULT.get("occurrence", "1")):
        return
    if "error" in _FAULT:
        code = getattr(errno, _FAULT["error"])
        raise OSError(code, f"{os.strerror(code)} (injected by LIGHTNING_ZERO_FAULT at {name})")
    signum = getattr(signal, _FAULT.get("signal", "SIGINT"))
    print(f"lightning-zero fault point {name}: sending {signum.name} at {time.time()}", file=sys.stderr, flush=True)
    if _FAULT.get("target", "self") == "group":
        os.killpg(os.getpgrp(), signum)
    else:
        os.kill(os.getpid(), signum)
