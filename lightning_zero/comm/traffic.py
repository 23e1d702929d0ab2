"""What an engine's collectives move, counted per kind and scope (the counting half of ``collectives.py``).

[Note: what the counters count]
Each collective adds the *logical payload* it moves to its kind: the full input of a reduce-scatter, the full output
of an all-gather, the tensor of an all-reduce or broadcast. That is the unit of the ZeRO paper's traffic column: a
stage 1 or 2 step moves Ψ elements by reduce-scatter and Ψ by all-gather (2Ψ, the same as DDP's one all-reduce of
Ψ), stage 3 adds a second all-gather (less the unit forward ran last, which backward finds still gathered: see
[Note: the last unit stays gathered into backward] in ``stage3/units.py``). Bytes on the wire depend on the
algorithm (a ring moves about twice the payload times ``(N - 1) / N``) and are not what is compared. A process
group of one rank moves nothing and counts nothing.

Which ranks form which group (shard, replicate, tensor) is ``groups.py``; each group's traffic counts under its
scope in the counters of the ``ShardGroups`` that owns it (see
[Note: counted groups]).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


def _counts() -> defaultdict[str, int]:
    """A count per collective kind (a named function, not a lambda: a strategy holding a ``Traffic`` pickles)."""
    return defaultdict(int)


@dataclass
class Traffic:
    """Payload moved per collective kind since the last ``reset``, in bytes and in elements."""

    bytes: dict[str, int] = field(default_factory=_counts, init=False)
    elements: dict[str, int] = field(default_factory=_counts, init=False)
    calls: dict[str, int] = field(default_factory=_counts, init=False)
    scopes: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(_counts), init=False)
    """Elements per scope (``"world"``, ``"shard"``, ``"replicate"``, ``"tensor"``, ``"data"``) and kind: see
    [Note: hybrid sharding and its traffic] in ``groups.py``. ``elements`` is their sum over scopes."""

    def add(self, kind: str, tensor: torch.Tensor, scope: str = "world") -> None:
        """Count ``tensor`` as the payload of one ``kind`` collective under ``scope``."""
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.elements[kind] += tensor.numel()
        self.calls[kind] += 1
        self.scopes[scope][kind] += tensor.numel()

    def reset(self) -> None:
        """Start counting from zero."""
        self.bytes.clear()
        self.elements.clear()
        self.calls.clear()
        self.scopes.clear()

    def snapshot(self) -> dict[str, Any]:
        """A plain copy: ``{"bytes": {...}, "elements": {...}, "calls": {...}, "scopes": {scope: {...}}}``."""
        return {
            "bytes": dict(self.bytes),
            "elements": dict(self.elements),
            "calls": dict(self.calls),
            "scopes": {scope: dict(kinds) for scope, kinds in self.scopes.items()},
        }


@dataclass(frozen=True, eq=False)
class Group:
    """A process group whose collectives count into ``traffic`` under ``scope``.

    [Note: counted groups]
    The counters belong to the communication object of one set of shard groups
    (``ShardGroups``), not to the process: it hands out a ``Group`` for each
    of its process groups (``None`` here is the default group), all counting into its one ``Traffic``. Every
    function of ``collectives.py`` accepts a ``Group`` wherever it takes a ``group``; a bare process group (or
    ``None``) talks the same but counts nowhere, since nobody owns its counters. So the engine's collectives all go
    over the groups of its ``ShardGroups`` (the module's tensor-parallel layers included: the engine binds them at
    setup, see ``count_tensor_parallel``), and two engines, or two tests in
    one process, never count into each other's counters.
    """

    process_group: Optional[Any]
    scope: str
    traffic: Traffic
