"""A model set up again under Fabric: every engine holding the model or one of its optimizers is released first (see
[Note: setting up a model again] in ``engine/release.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine.release import load_states, release, states_of
from lightning_zero.lightning.fabric.several import owns

if TYPE_CHECKING:
    from lightning_zero.engine.engine import ZeroEngine

__all__ = ["release_held", "states_of", "load_states"]


def release_held(engines: list[ZeroEngine], module: nn.Module, optimizers: Sequence[Optimizer]) -> None:
    """Release (see [Note: setting up a model again]) every engine of ``engines`` holding ``module`` or one of
    ``optimizers``, and remove it from ``engines`` (in place)."""
    held = [
        engine
        for engine in engines
        if engine.module is module or any(owns(engine, optimizer) for optimizer in optimizers)
    ]
    for engine in held:
        release(engine)
        engines.remove(engine)
