"""An engine released so that its model can be set up again (Fabric's ``fabric.setup(model)`` then
``fabric.setup(model, optimizer)``, or a notebook cell re-run: see ``lightning/fabric/resetup.py``).

[Note: setting up a model again]
Under ``ddp`` a second ``fabric.setup`` of the same raw model (or with an optimizer already set up) just wraps it
again. Here each setup gives its model an engine that takes over the model's parameters and its optimizers'
parameter groups and state, so before the new engine is made, every engine holding the model or one of the
optimizers is released as if the model had never been set up, with its current values:

- the optimizers' state is gathered into the per-parameter form of a ``ddp`` checkpoint (see [Note: the canonical
  form] in ``checkpoints/full.py``) and sent to every rank, while the engine still holds its shards;
- the engine's teardown gives the module its whole fp32 weights back (a collective);
- each optimizer gets back its class, its original parameter groups (the module's parameters, not the master
  shards) and that state, keyed by those parameters, as ``Optimizer.load_state_dict`` keys it;
- the engine leaves the strategy's list of engines.

The new engine then takes the optimizers as any optimizer with state: ``states_of`` keeps their state dicts
before the engine swaps their groups, and ``load_states`` loads them into the new shards (as ``fabric.load``
loads a ``ddp`` checkpoint), so training continues as if the model had been set up once.

A fresh optimizer (no state yet) hands back nothing but its groups. Under tensor parallelism a parameter is a
rank's slice and the canonical state holds the whole tensor, so an optimizer that has stepped is refused there.
Every rank sets up the same models in the same order, so every rank releases the same engines (the collectives
match).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch.optim import Optimizer

from lightning_zero.checkpoints import full
from lightning_zero.comm import collectives
from lightning_zero.comm.groups import ShardGroups
from lightning_zero.shards.optimizer import ShardedOptimizer
from lightning_zero.shards.optimizer_support import user_class


class Releasable(Protocol):
    """What a release reads and changes of an engine (a ``ZeroEngine``)."""

    optimizers: list[ShardedOptimizer]

    @property
    def shard_groups(self) -> ShardGroups: ...
    def sharded(self, optimizer: Optimizer) -> ShardedOptimizer: ...
    def teardown(self, gather: bool = True) -> None: ...


def release(engine: Releasable) -> None:
    """Tear ``engine`` down and give its optimizers back their parameter groups and state (a collective)."""
    states = [_canonical_state(engine, sharded) for sharded in engine.optimizers]
    engine.teardown(gather=True)
    for sharded, state in zip(engine.optimizers, states):
        _give_back(sharded, state)
    engine.optimizers = []


def states_of(optimizers: Sequence[Optimizer]) -> list[tuple[Optimizer, dict[str, Any]]]:
    """The ``state_dict()`` of each of ``optimizers`` that has state (before an engine takes them)."""
    return [(optimizer, optimizer.state_dict()) for optimizer in optimizers if optimizer.state]


def load_states(engine: Releasable, states: Sequence[tuple[Optimizer, dict[str, Any]]]) -> None:
    """Load the states kept by ``states_of`` into ``engine``'s shards of their optimizers."""
    for optimizer, state in states:
        optimizer.state.clear()  # keyed by the module's parameters, which the optimizer no longer steps
        full.load_optimizer_state(engine.sharded(optimizer), state)


def _canonical_state(engine: Releasable, sharded: ShardedOptimizer) -> dict[str, Any]:
    """The optimizer's state in ``Optimizer.state_dict()`` form on every rank (``{}`` if it has none)."""
    stepped = collectives.broadcast_object(bool(sharded.optimizer.state))
    if not stepped:
        return {}
    if engine.shard_groups.tensor is not None:
        raise RuntimeError(
            f"This model is already set up and its {type(sharded.optimizer).__name__} has stepped: "
            "under tensor parallelism its state cannot move back onto the parameters. Make a new "
            "optimizer before setting the model up again."
        )
    return collectives.broadcast_object(full.optimizer_state(sharded))


def _give_back(sharded: ShardedOptimizer, state: dict[str, Any]) -> None:
    """The user's optimizer as it was before ZeRO took it, with ``state`` (canonical form) keyed by its parameters."""
    optimizer = sharded.optimizer
    optimizer.state.clear()
    start = 0
    for group, size in zip(optimizer.param_groups, sharded.group_sizes):
        group["params"] = sharded.canonical[start : start + size]
        start += size
    optimizer.__class__ = user_class(optimizer)
    if "_zero_sharded" in vars(optimizer):
        del optimizer._zero_sharded  # type: ignore[attr-defined]
    if state:
        optimizer.load_state_dict(state)
