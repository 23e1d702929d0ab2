"""Stage 3 setup: bring a model's parameters into the sharded form one unit at a time.

[Note: never the whole model]
A model built in ``configure_model`` under zero3 is created on the meta device (shapes, no memory). Setup then
walks the units: it materializes one unit on the device (``reset_parameters`` of each of its modules, children first:
see [Note: children before parents]), broadcasts it from rank 0 so every rank starts from the same weights, copies
this rank's pieces into the master and working shards, and frees the unit again. The peak per rank is the shards
plus one unit. The root unit (parameters owned by the LightningModule itself, tied weights, small units) comes last
and is materialized in full. A model built in ``__init__`` is already full on every rank; it is sharded the same
way, but the full copy existed.

[Note: children before parents]
Materializing a module calls its ``reset_parameters``, and the order matters when a parent initializes a child's
parameters (GPT-2's ``normal_(std=0.02)`` on its token embedding, tied to the head). Built eagerly, a child runs its
own initialization in its constructor and the parent's code runs afterwards, so the parent's wins. Lightning's
``_materialize_meta_tensors`` walks ``module.modules()`` parents first: the parent's ``reset_parameters`` sees the
child still on the meta device (or initializes it, then the child's default initialization overwrites it). The
GPT of ``benchmarks/gpt.py`` (now ``benchmarks/_model.py``) then started zero3 with ``N(0, 1)`` embeddings instead
of ``N(0, 0.02)`` (a loss far above ``ln(vocabulary)`` before the first update, and subnormal gradients that slowed
every matmul: benchmarks/RESULTS.md, "What it was: a wrong initialization, then subnormal floats").
``materialize`` gives every meta tensor its memory first and then calls ``reset_parameters`` children first,
parents last, as eager construction does.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
from torch import nn

from lightning_zero.comm import collectives
from lightning_zero.comm.groups import ShardGroups
from lightning_zero.process.faults import fault_point
from lightning_zero.process.shutdown import GUARD
from lightning_zero.stage3 import guard
from lightning_zero.stage3.construction import Recording
from lightning_zero.stage3.partitioned import PartitionedStorage
from lightning_zero.stage3.plan import ROOT, UnitPlan

#: A model built outside ``configure_model`` with more parameters than this gets a warning under zero3.
LARGE_MODEL_PARAMS = 50_000_000


def move_materialized(module: nn.Module, device: torch.device) -> None:
    """Move the parameters and buffers that are not on the meta device (``Module.to`` refuses meta tensors)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if not tensor.is_meta and tensor.device != device:
                tensor.data = tensor.data.to(device)


def drop_meta(module: nn.Module, device: torch.device) -> None:
    """Make the tensors still on the meta device (a construction stopped part-way) empty tensors on ``device``, so
    that Lightning's teardown can move the module."""
    for m in module.modules():
        for name, param in m._parameters.items():
            if param is not None and guard.is_released(param):  # sharded, its unit freed: an empty tensor
                param.data = torch.empty(0, dtype=param.dtype, device=device)
                guard.restore([param])
            if param is not None and param.is_meta:
                m._parameters[name] = nn.Parameter(
                    torch.empty(0, dtype=param.dtype, device=device), requires_grad=param.requires_grad
                )
        for name, buffer in m._buffers.items():
            if buffer is not None and buffer.is_meta:
                m._buffers[name] = torch.empty(0, dtype=buffer.dtype, device=device)


def warn_if_built_in_full(module: nn.Module) -> None:
    """Warn when a large model was built outside ``configure_model`` (every rank then held it in full)."""
    full = sum(p.numel() for p in module.parameters() if not p.is_meta)
    if full > LARGE_MODEL_PARAMS:
        warnings.warn(
            f"zero3: the model has {full:,} parameters that were created in full on every rank (built in `__init__`). "
            "Build large models in `LightningModule.configure_model` so that each rank only ever holds its shard "
            "and one unit.",
            stacklevel=2,
        )


def materialize(module: nn.Module, device: torch.device, recording: Optional[Recording] = None) -> None:
    """Give every meta tensor of ``module`` memory on ``device`` and its initial values.

    With the ``recording`` of ``configure_model``, the values are those eager construction gave (see [Note: record
    and replay] in ``construction.py``). Without one (a module put on the meta device some other way), every module
    that owns a meta tensor runs its ``reset_parameters``, children before parents (see [Note: children before
    parents]).
    """
    pending = [m for m in _post_order(module) if _has_own_meta(m)]
    if recording is not None:
        _replay_into(pending, device, recording)
        return
    _empty_onto(pending, device)
    for m in pending:
        if not hasattr(m, "reset_parameters"):  # Lightning's own rule and message
            raise TypeError(
                f"Materialization requires that the `{type(m).__name__}.reset_parameters` method is implemented."
                " This method is used to initialize any children parameters or buffers in this module."
            )
        if callable(m.reset_parameters):
            m.reset_parameters()


def _replay_into(modules: list[nn.Module], device: torch.device, recording: Recording) -> None:
    """Materialize the meta tensors owned by ``modules`` with the values construction gave them.

    Each parameter object takes the replayed tensor's contents (``torch.utils.swap_tensors``: ties and optimizers
    keep the object, and no second copy of the unit is made); buffers are replaced, and a buffer registered under two
    names stays one tensor. Only ids and names are held while swapping (a swapped tensor must be referenced nowhere
    else).
    """
    params = [(m, n, id(t)) for m in modules for n, t in m._parameters.items() if t is not None and t.is_meta]
    buffers = [(m, n, id(t)) for m in modules for n, t in m._buffers.items() if t is not None and t.is_meta]
    unique = {id(t): t for m in modules for t in _own_tensors(m) if t.is_meta}
    dtypes = {i: t.dtype for i, t in unique.items()}
    values = dict(zip(unique, recording.values_of(list(unique.values()))))
    del unique
    with torch.no_grad():
        for m, name, i in params:
            param = m._parameters[name]
            if param is not None and param.is_meta:  # a tied parameter is swapped once, under its first name
                value = _owned(values.pop(i).to(device=device, dtype=dtypes[i]))
                replayed = nn.Parameter(value, requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, replayed)
                param.__dict__.update(replayed.__dict__)  # the swap took the attributes set at construction along
        for m, name, i in buffers:
            values[i] = values[i].to(device=device, dtype=dtypes[i])
            m._buffers[name] = values[i]


def _has_own_meta(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters or buffers (not its children's) are on the meta device."""
    return any(t is not None and t.is_meta for t in (*module._parameters.values(), *module._buffers.values()))


def _owned(value: torch.Tensor) -> torch.Tensor:
    """``value`` alone in a storage of its own size (a replayed tensor may be a view into a larger storage)."""
    whole = value.untyped_storage().nbytes() == value.numel() * value.element_size()
    return value if whole and value.is_contiguous() and value.storage_offset() == 0 else value.clone()


def _empty_onto(modules: list[nn.Module], device: torch.device) -> None:
    """Give the meta tensors owned by ``modules`` uninitialized memory on ``device``, keeping the tensor objects (tied
    weights and the optimizers hold them)."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for m in modules:
            if _has_own_meta(m):  # a tied weight may have come with a sibling
                m.to_empty(device=device, recurse=False)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]


def _post_order(module: nn.Module) -> list[nn.Module]:
    """Every submodule once (shared ones at their first place), each after all of its children."""
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        seen.add(id(m))
        for child in m.children():
            if id(child) not in seen:
                visit(child)
        order.append(m)

    visit(module)
    return order


def broadcast_module_states(module: torch.nn.Module, shard_groups: ShardGroups) -> None:
    """Start every rank from rank 0's parameters and buffers, as DDP does (under tensor parallelism: the first rank
    of its data-parallel group, which holds the same slices)."""
    _broadcast(list(module.parameters()) + list(module.buffers()), shard_groups)


def shard_by_units(
    module: nn.Module,
    plan: UnitPlan,
    storages: Sequence[PartitionedStorage],
    device: torch.device,
    recording: Optional[Recording] = None,
) -> None:
    """Materialize, broadcast and shard every unit in turn (see [Note: never the whole model]).

    Materialization swaps each meta parameter's contents in place (``torch.utils.swap_tensors``), so the parameter
    objects the optimizer holds, and tied weights, stay the same objects.
    """
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        _shard_by_units(module, plan, storages, device, recording)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    for storage in storages:
        storage.install_grad_hooks()


def _shard_by_units(
    module: nn.Module,
    plan: UnitPlan,
    storages: Sequence[PartitionedStorage],
    device: torch.device,
    recording: Optional[Recording],
) -> None:
    managed = {id(p) for storage in storages for p in storage.params}
    shard_groups = storages[0].groups if storages else ShardGroups()
    for unit in range(1, len(plan.names)):
        GUARD.safe_point(shard_groups)  # Ctrl-C between two units stops every rank here
        fault_point("materialize.unit")
        unit_module = plan.modules[unit]
        assert unit_module is not None
        materialize(unit_module, device, recording)
        params = [p for p in unit_module.parameters() if plan.unit(p) == unit and id(p) in managed]
        _broadcast(params, shard_groups)
        _fill(storages, unit)
    # the root: parameters of no unit, plus everything not managed by an optimizer and the buffers, in full
    materialize(module, device, recording)
    unit_params = {id(p) for p in module.parameters() if plan.unit(p) != ROOT and id(p) in managed}
    _broadcast([p for p in module.parameters() if id(p) not in unit_params] + list(module.buffers()), shard_groups)
    _fill(storages, ROOT)


def _broadcast(tensors: Sequence[torch.Tensor], shard_groups: ShardGroups) -> None:
    with torch.no_grad():
        for tensor in tensors:
            collectives.broadcast(tensor.data, src=shard_groups.data_source, group=shard_groups.data_group)


def _fill(storages: Sequence[PartitionedStorage], unit: int) -> None:
    for storage in storages:
        if storage.has_unit(unit):
            storage.fill_unit(unit)
