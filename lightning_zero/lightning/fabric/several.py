"""Several models on one ``ZeroFabricStrategy`` (a GAN's generator and discriminator, teacher and student, an EMA
copy): each ``fabric.setup`` gives its own ``ZeroEngine`` over the same process
groups, and a checkpoint of several of them is one sharded checkpoint.

[Note: several models in one checkpoint]
``fabric.save(path, {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d, "step": n})`` with several set-up models writes
the checkpoint a LightningModule holding them as attributes ``g`` and ``d`` would: ``state_dict`` keys prefixed with
the state's key of their model (``g.net.0.weight``), ``optimizer_states`` the engines' optimizers in the order the
models were set up (each engine's in its own order), every other entry as itself, and under ``MODELS_KEY`` the
state keys of the models. ``EngineGroup`` shows the engines to the format's functions (``engine/state.py``) as
one engine whose module is a ``ModuleDict`` of the models (with the engine's checkpoint methods that Fabric's
``save`` and ``load`` call), so a directory is written by every rank in one go and
``lightning-zero inspect`` / ``consolidate`` read it as any other (the consolidated file loads into such a
LightningModule). ``fabric.load`` restores every model and optimizer of the state from it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine import state

if TYPE_CHECKING:
    from lightning_zero.engine.engine import ZeroEngine

#: The checkpoint entry that lists the state keys of the models of a several-model checkpoint, in setup order.
MODELS_KEY = "zero_fabric_models"


@dataclass
class _Storages:
    storages: list[Any]
    """The engines' ``ShardedStorage`` objects."""


class _Runtimes:
    """Stage 3's unit runtimes of several engines, as the checkpoint loader asks one for its gathered units."""

    def __init__(self, runtimes: Sequence[Any]) -> None:
        self.runtimes = list(runtimes)

    def wait_for_unshard(self) -> None:
        for runtime in self.runtimes:
            runtime.wait_for_unshard()

    def refresh(self) -> None:
        for runtime in self.runtimes:
            runtime.refresh()


class EngineGroup:
    """Several engines seen as one by the checkpoint format (see [Note: several models in one checkpoint]): their
    module a ``ModuleDict`` keyed by the state's keys, their optimizers and storages in setup order."""

    def __init__(self, named: dict[str, "ZeroEngine"]) -> None:
        bad = [key for key in named if not key.isidentifier()]
        if bad:
            raise ValueError(
                f"`fabric.save`/`fabric.load` of several models names each by its key in the state, and "
                f"{bad[0]!r} cannot name a submodule. Use keys such as 'generator' and 'discriminator'."
            )
        engines = list(named.values())
        self.engines = engines
        self.config, self.shard_groups, self.precision = (
            engines[0].config,
            engines[0].shard_groups,
            engines[0].precision,
        )
        self.module = nn.ModuleDict({key: engine.module for key, engine in named.items()})
        self.optimizers: list[Any] = [o for engine in engines for o in engine.optimizers]
        self.store = _Storages([s for engine in engines for s in engine.store.storages])
        runtimes = [engine.runtime for engine in engines if engine.runtime is not None]
        self.runtime: Optional[_Runtimes] = _Runtimes(runtimes) if runtimes else None

    def sharded(self, optimizer: Optimizer) -> Any:
        """The shards of ``optimizer``, from the engine that owns it."""
        return engine_of_optimizer(self.engines, optimizer).sharded(optimizer)

    def checkpoint_entries(self, optimizers: Sequence[Optimizer]) -> dict[str, Any]:
        """``ZeroEngine.checkpoint_entries`` of the models together (``optimizers`` in setup order)."""
        return state.states_entries(self, optimizers)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Path, writer: state.Writer) -> None:
        """``ZeroEngine.save_checkpoint`` of the models together (a collective)."""
        state.save(self, checkpoint, path, writer)

    def load_model_state(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """``ZeroEngine.load_model_state`` of the models together (a collective)."""
        state.load_model(self, checkpoint, strict)

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        """``ZeroEngine.load_optimizer_states`` of the models together."""
        state.load_optimizers(self, checkpoint)


def owns(engine: "ZeroEngine", optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` (or the one inside Lightning's or Fabric's wrapper) is one of ``engine``'s."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    return any(sharded.optimizer is optimizer or sharded.optimizer is inner for sharded in engine.optimizers)


def engine_of_optimizer(engines: Sequence["ZeroEngine"], optimizer: Optimizer) -> "ZeroEngine":
    """The engine stepping ``optimizer``."""
    for engine in engines:
        if owns(engine, optimizer):
            return engine
    raise ValueError(
        "This optimizer was not set up by `fabric.setup` / `fabric.setup_optimizers`: step, clip, save "
        "and load the optimizers returned by them."
    )


def engine_of_params(engines: Sequence["ZeroEngine"], optimizer: Optimizer) -> "ZeroEngine":
    """For ``fabric.setup_optimizers`` after ``setup_module``: the engine whose module holds ``optimizer``'s
    parameters."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for engine in reversed(engines):
        if any(id(p) in params for p in engine.module.parameters()):
            return engine
    raise ValueError(
        "`fabric.setup_optimizers`: the optimizer's parameters belong to no model set up with "
        "`fabric.setup_module`. Set up the model first, then make the optimizer from its parameters."
    )


def engine_of_module(engines: Sequence["ZeroEngine"], module: nn.Module) -> "ZeroEngine":
    """The engine of ``module`` (the module ``fabric.setup`` returned, unwrapped)."""
    for engine in engines:
        if engine.module is module:
            return engine
    raise ValueError(
        "ZeroFabricStrategy saves and loads the models it set up: pass the modules returned by `fabric.setup`."
    )


@contextmanager
def all_gathered(engines: Sequence["ZeroEngine"]) -> Iterator[None]:
    """Every parameter of every engine whole inside (a collective)."""
    with ExitStack() as stack:
        for engine in engines:
            stack.enter_context(engine.gathered_parameters())
        yield
