"""Stage 3: which modules are gathered together ("units"), and the hooks that gather them around their use.

[Note: units]
A unit is a module whose parameters are all-gathered together before it runs and freed right after. By default the
units are the repeated blocks (children of ``nn.ModuleList`` / ``nn.Sequential``, outermost first) and every other
module with parameters that contains no block (embeddings, heads, final norms); ``unit_classes`` names the block
classes instead. Whatever is left forms the *root* unit (unit 0): parameters owned directly by the LightningModule,
parameters shared by two units (tied embeddings live in both the embedding and the head), and units smaller than
``persistence_threshold`` elements (norms and biases are not worth a collective each). The root unit is gathered
once at the start of a step and kept until the step's backward is done.

[Note: gather, free, and autograd]
Each unit's parameters are views of one flat buffer per optimizer; freeing resizes that buffer's *storage* to zero
and gathering resizes it back and all-gathers into it. The tensor objects never change, so the tensors autograd
saved in forward (the weights, and views of them such as ``W.t()``) read the re-gathered values in backward. A hook
on each unit output re-gathers the unit when the gradient reaches it; the unit is freed again once all of its
parameters have their gradient. Inside backward (activation checkpointing recomputes a forward) the post-forward
hook does not free: the backward that follows needs the parameters, and the pre-forward hook prefetches in backward
order. A block checkpointed by the strategy (:mod:`lightning_zero.engine.activations`) recomputes its original ``forward``
without its hooks; the unit is gathered once in backward, by the hook on its output, before the recomputation.

[Note: lockstep and prefetch]
Every rank must issue the same all-gathers in the same order. The order of units in the first forward is recorded;
afterwards the next units in that order (the previous ones in backward) are gathered asynchronously while the
current one computes, up to ``prefetch_size`` elements in flight. A rank whose control flow runs a different unit
than the others cannot be matched: its collective fails after the process group timeout, and the error names the
unit.

[Note: units and torch.compile]
The gather/free hooks issue asynchronous collectives and resize storages: dynamo cannot trace them, so every hook
always runs eagerly (see [Note: hooks under torch.compile] in ``engine/compiled.py``). Where the hooks sit decides
what a compiled model costs. A block compiled by the user (``self.blocks[i] = torch.compile(block)``) is an
``OptimizedModule`` wrapping the original block; the unit is the *wrapper*, whose module hooks run in
``nn.Module.__call__`` before and after the compiled call, outside the graph: the graph sees only the block's
computation over gathered parameters (their tensors, shapes and strides never change, only their storage is resized,
so dynamo's guards hold and it compiles once). A unit *inside* a compiled region (a compiled ``forward`` around the
blocks, ``module.compile()`` of a block, ``torch.compile(self.model)``) has its hooks called from compiled code:
dynamo splits the graph at each of them (the pieces are compiled once and reused, no recompilation). That works and
gives the same results, but compiles pieces between units; :func:`units_under_compile` names such units so that
setup can say so. ``module.compile()`` of a unit compiles its ``_call_impl``, hooks included, and is such a case
too.
"""

from __future__ import annotations

import difflib
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_zero.engine import collectives
from lightning_zero.engine.compiled import eager_hook

if TYPE_CHECKING:
    from lightning_zero.stage3.partitioned import PartitionedOptimizer

ROOT = 0


@dataclass
class UnitPlan:
    """Modules and parameters of every unit; unit 0 is the root."""

    names: list[str] = field(default_factory=lambda: ["<root>"])
    modules: list[Optional[nn.Module]] = field(default_factory=lambda: [None])
    unit_of: dict[int, int] = field(default_factory=dict)
    """``id(parameter)`` to unit index."""

    def unit(self, param: torch.Tensor) -> int:
        return self.unit_of.get(id(param), ROOT)


def find_blocks(module: nn.Module, unit_classes: Sequence[Union[type, str]] = (),
                option: str = "unit_classes") -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``module``, outermost first: modules of ``unit_classes`` (classes or class names) if
    given, else the children of ``nn.ModuleList`` / ``nn.Sequential``; only those with parameters. A block compiled
    with ``torch.compile(block)`` is found as its wrapper (see [Note: units and torch.compile]). Classes that match
    nothing, and containers, are refused with an error that names ``option``."""
    chosen: list[tuple[str, nn.Module]] = []

    def is_unit_class(m: nn.Module) -> bool:
        cls = type(m)
        return any(c is cls or (isinstance(c, type) and isinstance(m, c)) or c in (cls.__name__, cls.__qualname__,
                   f"{cls.__module__}.{cls.__qualname__}") for c in unit_classes)

    def visit(name: str, mod: nn.Module, in_container: bool) -> None:
        is_block = is_unit_class(compiled_inner(mod)) if unit_classes else in_container
        if name and is_block and _has_params(mod):
            chosen.append((name, mod))  # a compiled block: its wrapper (see [Note: units and torch.compile])
            return
        if mod is not compiled_inner(mod):  # a wrapper that is not a block: look inside as if it were not there
            visit(f"{name}._orig_mod" if name else "_orig_mod", compiled_inner(mod), in_container)
            return
        container = isinstance(mod, (nn.ModuleList, nn.Sequential))
        for child_name, child in mod.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, container)

    visit("", module, False)
    if unit_classes:
        _check_unit_classes(module, unit_classes, chosen, option)
    return chosen


#: Modules whose ``forward`` is never called (containers): hooks on them never run.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _class_names(cls: type) -> tuple[str, ...]:
    return cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"


def _check_unit_classes(module: nn.Module, unit_classes: Sequence[Union[type, str]],
                        chosen: list[tuple[str, nn.Module]], option: str) -> None:
    """Refuse ``unit_classes`` entries that match no submodule (with a "did you mean") and units that are containers
    (their forward never runs, so they would never be gathered)."""
    classes = {type(compiled_inner(m)) for m in module.modules()}
    for entry in unit_classes:
        if not any(c is entry or (isinstance(entry, type) and issubclass(c, entry)) or entry in _class_names(c)
                   for c in classes):
            names = sorted({c.__name__ for c in classes})
            close = difflib.get_close_matches(str(getattr(entry, "__name__", entry)), names, n=3)
            hint = f" Did you mean {' or '.join(repr(n) for n in close)}?" if close else ""
            raise ValueError(
                f"`{option}` names {entry!r}, but no submodule of {type(module).__name__} is of that class.{hint} "
                f"The model's classes: {', '.join(names)}.")
    for name, mod in chosen:
        if isinstance(compiled_inner(mod), _CONTAINERS):
            inner = sorted({type(c).__name__ for c in mod.children()})
            raise ValueError(
                f"`{option}` makes '{name}' ({type(mod).__name__}) a block, but a container's forward is never called"
                ", so hooks on it never run (stage 3 would never gather its parameters). Name the class of the blocks"
                f" inside it instead: {option}=[{', '.join(repr(n) for n in inner)}].")


def plan_units(module: nn.Module, unit_classes: Sequence[Union[type, str]] = (),
               persistence_threshold: int = 0) -> UnitPlan:
    """Choose the units of ``module`` (see [Note: units]); ``unit_classes`` holds classes or class names."""
    chosen = find_blocks(module, unit_classes)
    blocks = {id(m) for _, m in chosen}

    def contains_block(mod: nn.Module) -> bool:
        return any(id(m) in blocks for m in mod.modules())

    def leftovers(name: str, mod: nn.Module) -> None:
        for child_name, child in mod.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if id(child) in blocks:
                continue
            if contains_block(child):
                leftovers(full, child)
            elif _has_params(child):
                chosen.append((full, child))

    leftovers("", module)
    return _assign(chosen, persistence_threshold)


def compiled_inner(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wrapper (``OptimizedModule``) runs, else ``module`` itself."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return module


def _runs_compiled(module: nn.Module) -> bool:
    """Whether ``module``'s ``forward`` (instance attribute) or whole call (``module.compile()``) is compiled."""
    compiled_call = module.__dict__.get("_compiled_call_impl")
    forward = module.__dict__.get("forward")
    return compiled_call is not None or hasattr(forward, "_torchdynamo_orig_callable") or \
        compiled_inner(module) is not module


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


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _assign(chosen: list[tuple[str, nn.Module]], persistence_threshold: int) -> UnitPlan:
    """Give each parameter to the one unit that holds it; shared ones and units too small to keep go to the root."""
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
        if sum(numel[pid] for pid in exclusive[index]) > persistence_threshold:
            unit = len(plan.names)
            plan.names.append(name)
            plan.modules.append(mod)
            plan.unit_of.update({pid: unit for pid in exclusive[index]})
    return plan


@dataclass
class _UnitState:
    gathered: bool = False
    pending: list[Any] = field(default_factory=list)
    grads_expected: int = 0
    grads_seen: int = 0


class UnitRuntime:
    """Gathers and frees units around their forward and backward (see [Note: gather, free, and autograd])."""

    def __init__(self, plan: UnitPlan, engines: list["PartitionedOptimizer"], prefetch_size: int) -> None:
        self.plan = plan
        self.engines = engines
        self.prefetch_size = prefetch_size
        self.states = [_UnitState() for _ in plan.names]
        self.forward_order: list[int] = []
        self._recorded = False
        self.peak_gathered_bytes = 0
        """High-water mark of gathered unit bytes (root, current unit, prefetch): bounded by options, not depth."""
        self._held = False
        """Inside :meth:`all_gathered`: the hooks free nothing."""
        self._handles: list[Any] = []
        for engine in engines:
            for j, p in enumerate(engine.params):
                unit = engine.param_units[j]
                self.states[unit].grads_expected += 1
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(unit)))
        for unit, mod in enumerate(plan.modules):
            if mod is not None:
                self._handles.append(mod.register_forward_pre_hook(self._pre_forward_hook(unit)))
                self._handles.append(mod.register_forward_hook(self._post_forward_hook(unit)))

    # ------------------------------------------------------------------ gather / free
    def gather(self, unit: int, wait: bool = True) -> None:
        """All-gather ``unit`` (asynchronously unless ``wait``); waiting on a prefetched gather."""
        state = self.states[unit]
        if not state.gathered:
            state.pending = [w for engine in self.engines for w in engine.gather_unit(unit)]
            state.gathered = True
            live = sum(engine.gathered_bytes for engine in self.engines)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)
        if wait and state.pending:
            for work in state.pending:
                collectives.wait(work, f"gather stage 3 unit '{self.plan.names[unit]}'")
            state.pending = []

    def release(self, unit: int) -> None:
        """Free ``unit``'s gathered storage (the root stays until :meth:`end_step`)."""
        if unit != ROOT and not self._held:
            self._free(unit)

    def release_now(self, unit: int) -> None:
        """Free ``unit`` now, the root too, whatever the step is doing (the caller gathered it outside a step)."""
        self._free(unit)

    @contextmanager
    def all_gathered(self) -> Iterator[None]:
        """Every unit gathered inside (a collective), so that every parameter holds its full value; the units that
        were not gathered before are freed after. A forward inside frees nothing."""
        before = {unit for unit, state in enumerate(self.states) if state.gathered}
        for unit in range(len(self.states)):
            self.gather(unit)
        self._held = True
        try:
            yield
        finally:
            self._held = False
            for unit in range(len(self.states)):
                if unit not in before:
                    self._free(unit)

    def _free(self, unit: int) -> None:
        state = self.states[unit]
        if not state.gathered:
            return
        self.gather(unit)  # a prefetch still in flight must land before its buffer goes
        for engine in self.engines:
            engine.release_unit(unit)
        state.gathered = False

    def end_backward(self, include_root: bool) -> None:
        """After a backward: the forward order is known from now on; free what is still gathered."""
        self._recorded = bool(self.forward_order)
        self.release_all(include_root)

    def end_step(self) -> None:
        """After an evaluation step or a manual-optimization training step: free everything, the root too."""
        self.release_all(include_root=True)

    def release_all(self, include_root: bool) -> None:
        """Free every gathered unit (end of backward; with ``include_root`` also the end of a step)."""
        for unit, state in enumerate(self.states):
            state.grads_seen = 0
            if unit != ROOT or include_root:
                self._free(unit)

    def refresh(self) -> None:
        """After an optimizer step the gathered units hold old values: gather them again from the new shards."""
        for unit, state in enumerate(self.states):
            if state.gathered:
                self.gather(unit)  # let a prefetch in flight land first
                state.gathered = False
                self.gather(unit)

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ hooks
    def _pre_forward_hook(self, unit: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            recompute = _in_backward()
            if torch.is_grad_enabled() and not recompute and not self._recorded and unit not in self.forward_order:
                self.forward_order.append(unit)
            self.gather(unit)
            # a recomputed forward (activation checkpointing) runs inside backward: prefetch the units backward
            # needs next, not the ones after this unit, which backward has already finished with
            self._prefetch(unit, step=-1 if recompute else 1)

        return eager_hook(hook, "stage 3's pre-forward hook (gathers the unit)")

    def _post_forward_hook(self, unit: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _in_backward():
                return  # recomputation under activation checkpointing: backward needs the parameters next
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(self._pre_backward_hook(unit))
            self.release(unit)

        return eager_hook(hook, "stage 3's post-forward hook (frees the unit)")

    def _pre_backward_hook(self, unit: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self.gather(unit)
            self._prefetch(unit, step=-1)

        return eager_hook(hook, "stage 3's pre-backward hook (gathers the unit)")

    def _grad_hook(self, unit: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            state = self.states[unit]
            state.grads_seen += 1
            if state.grads_seen == state.grads_expected:
                state.grads_seen = 0
                self.release(unit)

        return eager_hook(hook, "stage 3's gradient hook (frees the unit)")

    def _prefetch(self, unit: int, step: int) -> None:
        if unit not in self.forward_order or self.prefetch_size <= 0:
            return
        position = self.forward_order.index(unit) + step
        budget = self.prefetch_size
        while 0 <= position < len(self.forward_order):
            candidate = self.forward_order[position]
            size = sum(engine.unit_numel(candidate) for engine in self.engines)
            if size > budget:
                return
            if not self.states[candidate].gathered:
                self.gather(candidate, wait=False)
            budget -= size
            position += step


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def warn_if_units_compiled_inside(module: nn.Module, plan: UnitPlan) -> None:
    """Say once (rank 0) that a compiled region around stage 3 units is split at each of them."""
    inside = units_under_compile(module, plan)
    if inside and collectives.rank() == 0:
        shown = ", ".join(f"'{name}'" for name in inside[:4]) + (", ..." if len(inside) > 4 else "")
        warnings.warn(
            f"zero3: {len(inside)} stage 3 units ({shown}) run inside a region compiled by torch.compile (a compiled "
            "`forward` around them, `torch.compile(self.model)` or `module.compile()`). Their gather/free hooks "
            "issue collectives that dynamo cannot trace: they run eagerly and dynamo splits the compiled graph at each "
            "of them (results unchanged, compiled once, not every step; but the region is compiled in pieces, not "
            "as one graph). To compile whole blocks, compile the units themselves in `configure_model`: "
            "`self.blocks[i] = torch.compile(block)`.",
            UserWarning, stacklevel=4)
