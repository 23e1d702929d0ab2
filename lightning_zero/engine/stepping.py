"""The optimizer step of :class:`~lightning_zero.engine.engine.ZeroEngine`: reduce, clip, step, gather, zero the
gradients, for one optimizer or each of the engine's in turn.

[Note: the order of one optimizer step]
For one optimizer, :meth:`ZeroEngine.step` runs:
1. ``reduce`` (see [Note: the phases of one optimizer step] in ``optimizer.py``): what backward has not reduced yet
   is reduced (stage 1 after ``no_backward_sync``; every stage flushed at the end of the backward the step follows)
   and waited for; every master tensor gets its averaged gradient; under ``16-mixed`` the gradients are unscaled and
   every rank agrees on overflow (one all-reduce of a flag);
2. ``before_step`` (the Trainer's ``on_before_optimizer_step`` hooks and its clipping), then clipping by global norm
   or value over all shards;
3. the user's ``optimizer.step()``, skipped on every rank or none when the loss scaler found an overflow;
4. ``after_step``: the master gradients are dropped (the reduced ones stay in the shard until ``zero_grad``) and the
   updated shards reach the working parameters (stages 1 and 2 all-gather them; stage 3 casts the shard and
   gathers again whatever unit is gathered at that moment);
5. with ``zero_grad=True``, the gradients are dropped.
Step 1 moves the optimizer from ``ACCUMULATING`` to ``REDUCED``, where it stays until step 4, so clipping before
``step`` (Fabric's ``clip_gradients``, manual optimization) reduces once.

[Note: the non-finite guard]
With ``nonfinite="raise"`` or ``"skip"``, step 3 first asks whether the global norm of the optimizer's gradients is
finite. Every rank holds the same norm (it is all-reduced), so every rank decides alike and no rank can step alone:
``"raise"`` raises on every rank, with the step and this rank; ``"skip"`` skips the user's ``optimizer.step()`` on
every rank as an overflow does, counts it (``skipped_steps``, in ``summary()``) and warns. The norm is the one
clipping by norm computed in this step when it did (Lightning's ``gradient_clip_val``, Fabric's
``clip_gradients``): then the guard costs nothing. Without clipping the guard computes that norm itself, the same
way: one pass over this rank's gradient shard and an all-reduce of one number per optimizer (the only collective it
adds; a finiteness flag needs an agreement as much as a norm does, and no all-reduce runs in every step otherwise).
Under ``16-mixed`` the loss scaler has already unscaled the gradients and agreed on inf/NaN (step 1): such a step is
skipped there and the scale backed off, so the guard has nothing left to see and stays out of the scaler's way (it
never raises for an overflow the scaler handles by design). With the guard on, a closure runs before the step, as
under ``16-mixed`` (the update must be skippable after the gradients exist).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.comm import collectives
from lightning_zero.comm.groups import ShardGroups
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.amp import (
    PrecisionMode,
    clip_grad_norm,
    clip_grad_value,
    global_grad_norm,
    parameter_grad_norms,
)
from lightning_zero.memory.account import MemoryLedger
from lightning_zero.memory.host_memory import give_back_free_heap
from lightning_zero.shards import disk
from lightning_zero.shards.optimizer import ShardedOptimizer

if TYPE_CHECKING:
    from lightning_zero.stage3.units import UnitRuntime


class OptimizerSteps:
    """The step half of :class:`~lightning_zero.engine.engine.ZeroEngine` (a base class of it, kept apart so that
    each file stays readable): uses the engine's optimizers, precision, groups, device, module and stage 3 runtime."""

    module: nn.Module
    optimizers: list[ShardedOptimizer]
    precision: PrecisionMode
    shard_groups: ShardGroups
    device: torch.device
    runtime: Optional["UnitRuntime"]
    config: ZeroConfig
    skipped_steps: int
    completed_steps: int
    _step_norms: dict[int, Tensor]
    _heap_given_back: int
    memory: MemoryLedger

    def _give_back_heap_once(self) -> None:
        """After setup and after the first optimizer step, on a CPU: one trim of the host heap (see [Note: the engine
        gives back what its setup left behind] in ``memory/host_memory.py``); nothing at any later step."""
        if self._heap_given_back < 2:
            self._heap_given_back += 1
            if self.device.type == "cpu":
                give_back_free_heap()

    def sharded(self, optimizer: Optional[Optimizer] = None) -> ShardedOptimizer:
        """The shards of ``optimizer`` (the only one when ``None``)."""
        if optimizer is None:
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"This engine has {len(self.optimizers)} optimizers: name the one to step, clip or "
                    "zero (`engine.step(optimizer)`)."
                )
            return self.optimizers[0]
        # the optimizer itself, or the one inside Lightning's or Fabric's wrapper (both keep it as `_optimizer`)
        for candidate in (optimizer, getattr(optimizer, "_optimizer", None)):
            for sharded in self.optimizers:
                if sharded.optimizer is candidate:
                    return sharded
        raise ValueError(
            f"{type(optimizer).__name__} was not set up by this ZeRO engine: pass the optimizers to "
            "`ZeroEngine(module, [optimizer, ...])` (the Trainer: return them from `configure_optimizers`;"
            " Fabric: `fabric.setup(model, optimizer)`)."
        )

    def reduce(self, optimizer: Optional[Optimizer] = None) -> bool:
        """Step 1 of [Note: the order of one optimizer step]: the optimizer's gradients reduced (``REDUCED``, see
        [Note: the phases of one optimizer step]); returns whether the ``16-mixed`` loss scaler found an overflow
        (the step is then skipped on every rank). Reduces nothing when already ``REDUCED``."""
        scaler = self.precision.scaler
        sharded = self.sharded(optimizer)
        world = self.shard_groups.world
        unscale = (lambda grads: scaler.unscale_and_check(grads, self.device, world)) if scaler is not None else None
        return sharded.reduce(unscale)

    def clip_grad_norm(
        self,
        max_norm: float,
        optimizer: Optional[Optimizer] = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> Tensor:
        """Clip ``optimizer``'s gradients (all shards together) to a global ``norm_type``-norm of ``max_norm``;
        returns the norm before clipping. A non-finite norm raises with ``error_if_nonfinite``, unless the loss
        scaler found an overflow (that step is skipped anyway)."""
        overflow = self.reduce(optimizer)
        # see [Note: the norm over the shard group] and [Note: the norm over both dimensions] in amp.py
        sharded, groups = self.sharded(optimizer), self.shard_groups
        if groups.tensor is None:
            total = clip_grad_norm(sharded.grads(), max_norm, self.device, norm_type, groups.shard)
        else:
            sliced, replicated = sharded.grads_by_kind()
            total = clip_grad_norm(sliced, max_norm, self.device, norm_type, groups.shard, groups.tensor, replicated)
        self._step_norms[id(sharded)] = total  # for the non-finite guard of this step (any norm of a NaN is NaN)
        if error_if_nonfinite and not overflow and not torch.isfinite(total).all():
            raise RuntimeError(
                f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}),"
                " so it cannot be clipped. Pass `error_if_nonfinite=False` to clip anyway."
            )
        return total

    def grad_norms(self, norm_type: float = 2.0, optimizer: Optional[Optimizer] = None) -> dict[str, Tensor]:
        """Lightning's ``grad_norm(module, norm_type)`` for a sharded model: the ``norm_type``-norm of each trainable
        parameter's averaged gradient (``ddp``'s ``.grad``) under ``grad_{norm_type}_norm/{name}`` and their total
        under ``grad_{norm_type}_norm_total``, from the gradient shards. A collective; valid from the end of backward
        to the step (``on_before_optimizer_step``, after ``manual_backward``). ``optimizer``: only its parameters."""
        if self.shard_groups.tensor is not None:
            raise NotImplementedError("grad_norms() under tensor parallelism: use `clip_grad_norm` for the total norm.")
        targets = self.optimizers if optimizer is None else [self.sharded(optimizer)]
        for sharded in targets:
            self.reduce(sharded.optimizer)
        names = {id(p): name for name, p in self.module.named_parameters()}
        return parameter_grad_norms(targets, names, float(norm_type), self.shard_groups.shard, self.device)

    def clip_grad_value(self, clip_val: float, optimizer: Optional[Optimizer] = None) -> None:
        """Clamp ``optimizer``'s gradients into ``[-clip_val, clip_val]``."""
        self.reduce(optimizer)
        clip_grad_value(self.sharded(optimizer).grads(), clip_val)

    def step(
        self,
        optimizer: Optional[Optimizer] = None,
        *,
        clip_grad_norm: Optional[float] = None,
        clip_grad_value: Optional[float] = None,
        before_step: Optional[Callable[[], Any]] = None,
        zero_grad: bool = True,
        closure: Optional[Callable[[], Any]] = None,
        **step_kwargs: Any,
    ) -> Any:
        """One optimizer step in [Note: the order of one optimizer step]; ``optimizer`` ``None``: every optimizer
        of the engine in turn. Returns what ``optimizer.step`` returned (``None`` when the step was skipped), or what
        the ``closure`` returned if the step returned nothing. The closure runs once, with the first optimizer.

        [Note: the closure goes to the optimizer]
        A ``closure`` (Lightning's forward and backward) goes to the user's ``optimizer.step(closure=...)`` as under
        ``ddp``, wrapped so that steps 1 and 2 (reduce, ``before_step``, clipping) run right after it, inside the
        call: an optimizer that counts or wraps ``step`` sees one call with a closure. Under ``16-mixed`` the overflow
        check must come before the call, and a step in pieces cannot run a closure per piece: there the closure runs
        first, then the step.
        """
        clip = (before_step, clip_grad_norm, clip_grad_value)
        output = None
        guarded = self.config.nonfinite is not None
        # a disk fault in this step is raised by every rank at its end (see [Note: faults are agreed on every rank])
        with disk.agreed_faults(self.shard_groups.world, self.config.on_disk):
            for sharded in self.optimizers if optimizer is None else [self.sharded(optimizer)]:
                if closure is not None and self.precision.scaler is None and sharded.steps_once and not guarded:
                    overflow, output = False, self._step_with_closure(sharded, closure, clip, step_kwargs)
                else:
                    loss = closure() if closure is not None else None
                    overflow = self._before_step(sharded, *clip)
                    skip = overflow or self._nonfinite(sharded)
                    output = None if skip else sharded.step(lambda: sharded.optimizer.step(**step_kwargs))  # noqa: B023 - called in this iteration
                    output = loss if output is None else output
                    overflow = skip
                closure = None
                self._step_norms.pop(id(sharded), None)
                if self.precision.scaler is not None:
                    self.precision.scaler.update(overflow)
                sharded.after_step(stepped=not overflow)
                if self.runtime is not None:
                    self.runtime.refresh()
                if zero_grad:
                    sharded.optimizer.zero_grad()
        self.completed_steps += 1
        self.memory.note("the end of an optimizer step")
        self._give_back_heap_once()
        if self.runtime is not None:
            self.runtime.prefetch_root()  # [Note: the root is gathered ahead of the next step] in stage3/units.py
        return output

    def _nonfinite(self, sharded: ShardedOptimizer) -> bool:
        """The non-finite guard (see [Note: the non-finite guard]): whether to skip this step; raises under
        ``nonfinite="raise"``. Called on every rank after step 2 (the gradients reduced, unscaled and clipped)."""
        if self.config.nonfinite is None or self.precision.scaler is not None:
            return False
        norm = self._step_norms.get(id(sharded))
        if norm is None:
            groups = self.shard_groups
            if groups.tensor is None:
                norm = global_grad_norm(sharded.grads(), self.device, 2.0, groups.shard)
            else:
                sliced, replicated = sharded.grads_by_kind()
                norm = global_grad_norm(sliced, self.device, 2.0, groups.shard, groups.tensor, replicated)
        if bool(torch.isfinite(norm).all()):
            return False
        step, rank = self.completed_steps, collectives.rank()  # from 0: `trainer.global_step` in that step
        if self.config.nonfinite == "raise":
            raise FloatingPointError(
                f"The gradients of step {step} are not finite (global norm "
                f"{norm.item()}; raised on rank {rank}, as on every rank). Look for the inf/NaN in "
                "the loss of that step, or pass `nonfinite='skip'` to skip such steps."
            )
        self.skipped_steps += 1
        if rank == 0:
            warnings.warn(
                f"lightning-zero: step {step} skipped on every rank: its gradients are not finite "
                f"(global norm {norm.item()}); {self.skipped_steps} skipped so far.",
                stacklevel=2,
            )
        return True

    def _before_step(
        self,
        sharded: ShardedOptimizer,
        before_step: Optional[Callable[[], Any]],
        clip_grad_norm: Optional[float],
        clip_grad_value: Optional[float],
    ) -> bool:
        """Steps 1 and 2 of [Note: the order of one optimizer step]; returns whether the loss scaler overflowed."""
        overflow = self.reduce(sharded.optimizer)
        if before_step is not None:
            before_step()
        if clip_grad_norm is not None:
            self.clip_grad_norm(clip_grad_norm, sharded.optimizer)
        if clip_grad_value is not None:
            self.clip_grad_value(clip_grad_value, sharded.optimizer)
        return overflow

    def _step_with_closure(
        self, sharded: ShardedOptimizer, closure: Callable[[], Any], clip: tuple, step_kwargs: dict[str, Any]
    ) -> Any:
        """``optimizer.step(closure=...)`` with steps 1 and 2 inside (see [Note: the closure goes to the optimizer])."""
        losses: list[Any] = []

        def wrapped() -> Any:
            losses.append(closure())
            self._before_step(sharded, *clip)
            return losses[-1]

        output = sharded.step_once(lambda: sharded.optimizer.step(closure=wrapped, **step_kwargs))
        return losses[-1] if output is None and losses else output

    def zero_grad(self, optimizer: Optional[Optimizer] = None) -> None:
        """Drop the gradients of ``optimizer`` (every optimizer when ``None``), as ``optimizer.zero_grad()`` does."""
        for sharded in self.optimizers if optimizer is None else [self.sharded(optimizer)]:
            sharded.optimizer.zero_grad()
