"""Calls a user makes that need every rank (a stage 3 ``state_dict()``, a checkpoint save): checked on entry, so that
one made on one rank only fails within seconds instead of waiting for the process group timeout.

[Note: a collective called on one rank]
``if trainer.is_global_zero: torch.save(model.state_dict(), ...)`` is a common pattern that is right under ``ddp``
and wrong under a sharded stage: the call gathers pieces from every rank, and the other ranks never join it; the
job waits for the process group's timeout (30 minutes). So each such call first tells every rank which call it is,
through the job's key-value store (the ``n``-th checked call of each rank under its own key, ``n`` counted in that
store: a process group made again, on some ranks only or with a fresh store, starts its count again), and waits at
most ``CALL_TIMEOUT`` seconds for the other ranks' ``n``-th call. When they do not come, or come to another call,
the rank raises ``OneRankCallError``, which says what to do. The store and not a collective: a wait that ends
leaves no operation pending in a process group (a pending gloo collective would keep the process from exiting).
The other ranks wait in their next collective with this rank, which fails when this rank's process ends.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

from lightning_zero.comm import collectives

#: Seconds a call waits for every rank to make it too. Calls every rank makes meet within a step's skew; a rank that
#: works alone for longer before the call (an evaluation on rank 0 only, then a save on every rank) needs more.
CALL_TIMEOUT = 30.0

#: The calls that are checked, by their index.
CALLS = ("`model.state_dict()`", "a checkpoint save (`save_checkpoint`)")
STATE_DICT, SAVE = 0, 1

_PREFIX = "lightning_zero/user_call"

_ADVICE = (
    "Call it on every rank, outside `if trainer.is_global_zero:` (a sharded stage gathers from every rank); or "
    "save a checkpoint on every rank and turn it into one file with `lightning_zero.consolidate(path, out)` "
    "(or `lightning-zero consolidate`)."
)


_LATE = (
    "If the other ranks only come later (a long evaluation on one rank before a save), set "
    "`lightning_zero.process.user_calls.CALL_TIMEOUT` to more seconds."
)


class OneRankCallError(RuntimeError):
    """A call that needs every rank was made on some ranks only (see [Note: a collective called on one rank])."""


def check_every_rank_calls(call: int) -> None:
    """Raise ``OneRankCallError`` unless every rank makes call ``call`` (of ``CALLS``) as its next checked
    call within ``CALL_TIMEOUT`` seconds (see [Note: a collective called on one rank])."""
    store = _store()
    if store is None:
        return
    me, world = collectives.rank(), collectives.world_size()
    n = store.add(f"{_PREFIX}/count/{me}", 1)  # this rank's calls under this store (see the note)
    store.set(f"{_PREFIX}/{n}/{me}", str(call))
    try:
        store.wait([f"{_PREFIX}/{n}/{r}" for r in range(world)], timedelta(seconds=CALL_TIMEOUT))
    except RuntimeError:  # torch's DistStoreError, a RuntimeError: the other ranks did not come
        raise OneRankCallError(
            f"{CALLS[call]} was called on rank {me} and not on every rank within "
            f"{CALL_TIMEOUT:g} s: it is a collective under a sharded stage. {_ADVICE} {_LATE}"
        ) from None
    calls = [int(store.get(f"{_PREFIX}/{n}/{r}")) for r in range(world)]
    if any(c != call for c in calls):
        doing = ", ".join(f"rank {r}: {CALLS[c]}" for r, c in enumerate(calls))
        raise OneRankCallError(f"The ranks made different calls that need every rank ({doing}). {_ADVICE}")


def _store() -> Optional[Any]:
    """The job's key-value store; ``None`` without a process group of more than one rank."""
    if not collectives.is_distributed():
        return None
    return collectives.job_store()
