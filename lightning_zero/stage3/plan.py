"""Stage 3: which modules are gathered together ("units"): the plan, made once at setup.

[Note: units]
A unit is a module whose parameters are all-gathered together before it runs and freed right after. By default the
units are the repeated blocks (children of ``nn.ModuleList`` / ``nn.Sequential``, outermost first) and every other
module with parameters that contains no block (embeddings, heads, final norms); ``unit_classes`` names the block
classes instead. Whatever is left forms the *root* unit (unit 0): parameters owned directly by the LightningModule,
parameters shared by two units (tied embeddings live in both the embedding and the head), and units smaller than
``persistence_threshold`` elements (norms and biases are not worth a collective each). The root unit is gathered
once per step, from the end of the optimizer step before it (see [Note: the root is gathered ahead of the next
step] in ``units.py``), and kept until the step's backward is done.

[Note: one algorithm at every size]
``persistence_threshold=None`` (the default) is ``DEFAULT_PERSISTENCE_THRESHOLD`` elements for every model,
whatever its size (as DeepSpeed's ``param_persistence_threshold``): units of that many elements or fewer join the
root, larger ones are gathered around their use. A default that gathered a small model whole once per step (as
earlier versions did under 16M parameters) made the small benchmark fast by another algorithm and changed nothing
at real sizes; with unit memory taken from the pool (see [Note: the engine owns its memory] in ``pool.py``) a gather
unit by unit costs its collective and nothing else, at every size. A number above the model's size gathers it
whole (one root unit), for a user who wants that trade.

[Note: the blocks a user names are units]
``unit_classes`` names the blocks to gather one at a time: under the default threshold they are units whatever their
size (a decoder layer of 61K elements would otherwise join the root, and the whole model would be one unit, against
the option the user set). The threshold still decides for the other modules (embeddings, heads, norms), and a
``persistence_threshold`` the user sets decides for the named blocks too.

[Note: units and torch.compile]
The gather/free hooks issue asynchronous collectives and resize storages: dynamo cannot trace them, so every hook
always runs eagerly (see [Note: hooks under torch.compile] in ``shards/compiled.py``). Where the hooks sit decides
what a compiled model costs. A block compiled by the user (``self.blocks[i] = torch.compile(block)``) is an
``OptimizedModule`` wrapping the original block; the unit is the *wrapper*, whose module hooks run in
``nn.Module.__call__`` before and after the compiled call, outside the graph: the graph sees only the block's
computation over gathered parameters (their tensors, shapes and strides never change, only their storage is resized,
so dynamo's guards hold and it compiles once). A unit *inside* a compiled region (a compiled ``forward`` around the
blocks, ``module.compile()`` of a block, ``torch.compile(self.model)``) has its hooks called from compiled code:
dynamo splits the graph at each of them (the pieces are compiled once and reused, no recompilation). That works and
gives the same results, but compiles pieces between units; ``units_under_compile`` names such units so that
setup can say so. ``module.compile()`` of a unit compiles its ``_call_impl``, hooks included, and is such a case
too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence, Union

import torch
from torch import nn

from lightning_zero.activations.blocks import compiled_inner, find_blocks, has_params

ROOT = 0
#: ``persistence_threshold=None``: units of at most this many elements join the root, at every model size.
DEFAULT_PERSISTENCE_THRESHOLD = 100_000


@dataclass
class UnitPlan:
    """Modules and parameters of every unit; unit 0 is the root."""

    names: list[str] = field(default_factory=lambda: ["<root>"])
    modules: list[Optional[nn.Module]] = field(default_factory=lambda: [None])
    unit_of: dict[int, int] = field(default_factory=dict)
    """``id(parameter)`` to unit index."""

    def unit(self, param: torch.Tensor) -> int:
        return self.unit_of.get(id(param), ROOT)


def resolve_persistence_threshold(configured: Optional[int]) -> int:
    """The ``persistence_threshold`` option, or ``DEFAULT_PERSISTENCE_THRESHOLD`` for ``None``: the same for every
    model (see [Note: one algorithm at every size])."""
    return configured if configured is not None else DEFAULT_PERSISTENCE_THRESHOLD


@dataclass(frozen=True)
class UnitPolicy:
    """What stage 3's unit plan and its runtime (``UnitRuntime``) read of the
    options, derived once by the engine (``engine/policies.py``)."""

    unit_classes: tuple[Union[type, str], ...]
    """The block classes (or class names) gathered as one unit; empty: the default units (see [Note: units])."""
    persistence_threshold: int
    """Units of at most this many elements join the root (already resolved: see [Note: one algorithm at every
    size])."""
    prefetch_size: int
    """Elements of the next units that may be all-gathered ahead of their use."""
    lockstep_check: Union[bool, Literal["strict"]]
    """Whether (and how strictly) the ranks check that they run the same unit (see ``lockstep.py``)."""
    block_threshold: Optional[int] = None
    """The same for the blocks of ``unit_classes`` (``None``: ``persistence_threshold``); 0 when the user named
    the blocks and left the threshold at its default (see [Note: the blocks a user names are units])."""

    def plan(self, module: nn.Module) -> UnitPlan:
        """The units of ``module`` under this policy (see ``plan_units``)."""
        return plan_units(module, self.unit_classes, self.persistence_threshold, self.block_threshold)


def plan_units(
    module: nn.Module,
    unit_classes: Sequence[Union[type, str]] = (),
    persistence_threshold: int = 0,
    block_threshold: Optional[int] = None,
) -> UnitPlan:
    """Choose the units of ``module`` (see [Note: units]); ``unit_classes`` holds classes or class names.
    ``block_threshold``: ``persistence_threshold`` for the blocks (``None``: the same; see [Note: the blocks a user
    names are units])."""
    chosen = find_blocks(module, unit_classes)
    blocks = {id(m) for _, m in chosen}
    thresholds = [persistence_threshold if block_threshold is None else block_threshold] * len(chosen)

    def contains_block(mod: nn.Module) -> bool:
        return any(id(m) in blocks for m in mod.modules())

    def leftovers(name: str, mod: nn.Module) -> None:
        for child_name, child in mod.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if id(child) in blocks:
                continue
            if contains_block(child):
                leftovers(full, child)
            elif has_params(child):
                chosen.append((full, child))

    leftovers("", module)
    thresholds += [persistence_threshold] * (len(chosen) - len(thresholds))
    return _assign(chosen, thresholds)


def _runs_compiled(module: nn.Module) -> bool:
    """Whether ``module``'s ``forward`` (instance attribute) or whole call (``module.compile()``) is compiled."""
    compiled_call = module.__dict__.get("_compiled_call_impl")
    forward = module.__dict__.get("forward")
    return (
        compiled_call is not None
        or hasattr(forward, "_torchdynamo_orig_callable")
        or compiled_inner(module) is not module
    )


def units_under_compile(root: nn.Module, plan: UnitPlan) -> list[str]:
    """Names of the units whose hooks run inside a region compiled by ``torch.compile`` (see [Note: units and
    torch.compile]): below a compiled ancestor, or compiled with ``module.compile()`` themselves."""
    units = {id(m): name for name, m in zip(plan.names, plan.modules) if m is not None}
    found: list[str] = []

    def visit(mod: nn.Module, compiled_above: bool) -> None:
        own_call = mod.__dict__.get("_compiled_call_impl") is not None
        if id(mod) in units and (compiled_above or own_call):
            found.append(units[id(mod)])
        for child in mod.children():
            visit(child, compiled_above or _runs_compiled(mod))

    visit(root, False)
    return found


def _assign(chosen: list[tuple[str, nn.Module]], thresholds: list[int]) -> UnitPlan:
    """Give each parameter to the one unit that holds it; shared ones and units too small to keep (at most
    ``thresholds[i]`` elements for ``chosen[i]``) go to the root."""
    owners: dict[int, set[int]] = {}
    numel: dict[int, int] = {}
    for index, (_, mod) in enumerate(chosen):
        for p in mod.parameters():
            owners.setdefault(id(p), set()).add(index)
            numel[id(p)] = p.numel()
    exclusive: dict[int, list[int]] = {index: [] for index in range(len(chosen))}
    for pid, units in owners.items():
        if len(units) == 1:
            exclusive[next(iter(units))].append(pid)
    plan = UnitPlan()
    for index, (name, mod) in enumerate(chosen):
        if sum(numel[pid] for pid in exclusive[index]) > thresholds[index]:
            unit = len(plan.names)
            plan.names.append(name)
            plan.modules.append(mod)
            plan.unit_of.update({pid: unit for pid in exclusive[index]})
    return plan
