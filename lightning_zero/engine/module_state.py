"""``model.state_dict()`` and ``model.load_state_dict(...)`` on a set-up model, at every stage.

[Note: the module's own state dict methods after setup]
Client code calls the module's own methods around the step: LitGPT's ``load_checkpoint`` is ``setup`` then
``model.load_state_dict(sd)``, Hugging Face's ``save_pretrained`` reads ``model.state_dict()``. After setup the
weights the optimizer steps on are the master shards, so both are redirected there by hooks on the set-up module
(the hooks are the module's own: Fabric's wrapper and the LightningModule reach them unchanged):

- ``load_state_dict``: a pre-hook takes the managed parameters' entries out of the dict, checks their shapes (a mismatch
  joins torch's own "Error(s) in loading state_dict"), writes each rank's pieces into its master shards
  (``ZeroEngine.load_model_state``, as a full checkpoint file loads), and refreshes the working parameters (a
  collective: every rank calls it, as every rank calls it under ``ddp``). Buffers and parameters no optimizer holds load
  as torch loads them. A post-hook takes the handled names out of ``missing_keys``, so ``strict`` means what it means
  under ``ddp``.
- ``state_dict`` (stage 3 only; stages 1 and 2 hold every parameter whole): the parameters' entries are filled
  after torch's walk, one unit at a time: gathered (a collective), copied to host memory, released. A device never
  holds more than one unit; the values are the working parameters (fp32 in ``32-true``; the fp32 masters of mixed
  precision are in the checkpoints). ``keep_vars=True`` returns the parameter objects themselves, as torch does,
  without gathering (the package's own code uses that form).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional, Protocol

import torch
from torch import Tensor, nn

from lightning_zero.checkpoints.shards import Shard
from lightning_zero.process import user_calls
from lightning_zero.shards.store import ParameterStore
from lightning_zero.stage3.units import UnitRuntime


class ShardedModule(Protocol):
    """What the hooks read of the engine, when they run (stage 3's store and runtime change when Fabric adds the
    optimizers after the module): a ``ZeroEngine``."""

    @property
    def module(self) -> nn.Module: ...
    @property
    def store(self) -> ParameterStore: ...
    @property
    def runtime(self) -> Optional[UnitRuntime]: ...
    @property
    def torn_down(self) -> bool: ...
    def load_model_state(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None: ...


def attach(engine: ShardedModule) -> list[Any]:
    """Install the hooks of [Note: the module's own state dict methods after setup]; returns their handles."""
    module = engine.module
    keys: dict[str, list[str]] = {"handled": [], "given": []}
    handles = [
        module.register_load_state_dict_pre_hook(_load_pre_hook(engine, keys)),
        module.register_load_state_dict_post_hook(_load_post_hook(engine, keys)),
    ]
    if engine.runtime is not None:
        streaming: list[bool] = []
        handles += [
            module.register_state_dict_pre_hook(_save_pre_hook(engine, streaming)),
            module.register_state_dict_post_hook(_save_post_hook(engine, streaming)),
        ]
    return handles


# ---------------------------------------------------------------------- load
def _load_pre_hook(engine: ShardedModule, keys: dict[str, list[str]]) -> Any:
    def hook(
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        keys["handled"], keys["given"] = [], []
        if module is not engine.module or engine.torn_down:  # a deep copy of the module, or after teardown
            return
        shapes = _managed_shapes(engine)
        given = {
            key[len(prefix) :]: state_dict.pop(key)
            for key in list(state_dict)
            if key.startswith(prefix) and key[len(prefix) :] in shapes
        }
        keys["handled"], keys["given"] = [prefix + key for key in shapes], [prefix + key for key in given]
        wrong = [
            f"size mismatch for {prefix + key}: copying a param with shape {value.shape} from checkpoint, the "
            f"shape in current model is {torch.Size(shapes[key])}."
            for key, value in given.items()
            if isinstance(value, Tensor) and tuple(value.shape) != shapes[key]
        ]
        if wrong:
            error_msgs.extend(wrong)
            return
        engine.load_model_state({"state_dict": given}, strict=False)  # into the shards, then the working parameters

    return hook


def _managed_shapes(engine: ShardedModule) -> dict[str, tuple[int, ...]]:
    """The whole shape of every parameter an optimizer holds, under each of its names (a tensor-parallel slice: the
    joined tensor's)."""
    managed = {id(p) for p in engine.store.params}
    return {
        name: Shard.placed(param, param.dtype)[0].full_shape
        for name, param in engine.module.named_parameters(remove_duplicate=False)
        if id(param) in managed
    }


def _load_post_hook(engine: ShardedModule, keys: dict[str, list[str]]) -> Any:
    """Torch reports the entries the pre-hook took out as missing: keep only those the dict really lacked."""

    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        if module is not engine.module or not keys["handled"]:
            return
        handled, given = set(keys["handled"]), set(keys["given"])
        missing = [key for key in incompatible_keys.missing_keys if key not in handled]
        incompatible_keys.missing_keys[:] = missing + [key for key in keys["handled"] if key not in given]
        keys["handled"], keys["given"] = [], []

    return hook


# ---------------------------------------------------------------------- save
def _save_pre_hook(engine: ShardedModule, streaming: list[bool]) -> Any:
    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        # torch's walk leaves guarded placeholders (the released parameters' `detach()`); the post-hook fills them
        streaming.append(not keep_vars and module is engine.module and engine.runtime is not None)

    return hook


def _save_post_hook(engine: ShardedModule, streaming: list[bool]) -> Any:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if not streaming.pop():
            return
        user_calls.check_every_rank_calls(user_calls.STATE_DICT)  # see [Note: a collective called on one rank]
        for unit, entries in _entries_by_unit(engine, prefix).items():
            with _gathered(engine, unit):
                for key, param in entries:
                    if key in state_dict:
                        state_dict[key] = param.detach().to("cpu", copy=True)

    return hook


def _entries_by_unit(engine: ShardedModule, prefix: str) -> dict[int, list[tuple[str, Tensor]]]:
    """The managed parameters under each of their names, grouped by stage 3 unit (in unit order)."""
    units = engine.store.param_units()
    out: dict[int, list[tuple[str, Tensor]]] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        if id(param) in units:
            out.setdefault(units[id(param)], []).append((prefix + name, param))
    return dict(sorted(out.items()))


@contextmanager
def _gathered(engine: ShardedModule, unit: int) -> Iterator[None]:
    """``unit`` gathered inside (a collective); released after unless it was gathered before."""
    runtime = engine.runtime
    assert runtime is not None
    before = runtime.units[unit].gathered
    runtime.unshard(runtime.units[unit])
    try:
        yield
    finally:
        if not before:
            runtime.reshard(runtime.units[unit])
