"""The engine's numerics, without Lightning: the precision modes, dynamic loss scaling and gradient clipping over
shards. The Trainer's and Fabric's precision plugins are thin wrappers of ``PrecisionMode``.

[Note: the precision modes]
``32-true``: everything fp32. ``bf16-mixed`` / ``16-mixed``: the working parameters and gradients the engine manages
are 16-bit, the forward runs under autocast, the optimizer steps on fp32 master shards; parameters no optimizer
manages stay fp32 (autocast casts them). ``16-mixed`` scales the loss (``LossScaler``). ``bf16-true``: the whole
module is bf16, the master shard too (no second copy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, Optional, Union, cast

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from lightning_zero.comm import collectives

PrecisionInput = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}
_WORKING_DTYPE = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
}


def normalize_precision(precision: Union[str, int]) -> PrecisionInput:
    """Map Lightning's precision spellings to ours; raise for what ZeRO does not support."""
    value = _ALIASES.get(precision, precision)
    if value not in SUPPORTED_PRECISION:
        raise ValueError(
            f"ZeRO does not support precision={precision!r}. Choose one of {', '.join(SUPPORTED_PRECISION)}."
        )
    return cast(PrecisionInput, str(value))  # one of SUPPORTED_PRECISION


class LossScaler:
    """Dynamic loss scaling for ``16-mixed``, with the overflow decision shared by all ranks."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.scale = init_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

    def unscale_and_check(self, grads: list[Tensor], device: torch.device, group: Optional[Any] = None) -> bool:
        """Divide ``grads`` by the scale in place; ``True`` when any rank of ``group`` (``None``: the world) saw an
        inf or NaN.

        ``device`` is the collectives' device; the gradients may be elsewhere (on the host with offload).
        """
        at = grads[0].device if grads else device
        found = torch.zeros(1, device=at)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found, torch.full((1,), 1.0 / self.scale, device=at)
            )
        found = collectives.all_reduce(found.to(device), op=collectives.MAX, group=group)
        # a simulated rank's gradients were never reduced: see [Note: one rank of a simulated world] in simulated.py
        return bool(found.item()) and not collectives.simulated()

    def update(self, overflow: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` clean steps."""
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class PrecisionMode:
    """One precision mode (see [Note: the precision modes]): its dtypes, autocast, input casting and loss scaler.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"`` (Lightning's aliases too).
        loss_scaler: the scaler for ``"16-mixed"``; a default dynamic one is made when omitted.
    """

    def __init__(self, precision: Union[str, int] = "32-true", loss_scaler: Optional[LossScaler] = None) -> None:
        self.precision = normalize_precision(precision)
        self.scaler = loss_scaler if loss_scaler is not None or self.precision != "16-mixed" else LossScaler()

    @property
    def working_dtype(self) -> torch.dtype:
        """dtype of the parameters the model computes with."""
        return _WORKING_DTYPE[self.precision]

    @property
    def master_dtype(self) -> torch.dtype:
        """dtype of the weights and states the optimizer steps on."""
        return torch.float32 if self.precision in ("32-true", "bf16-mixed", "16-mixed") else self.working_dtype

    @property
    def is_mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """``bf16-true`` converts the whole module; the mixed modes leave it to the engine and autocast."""
        return module.to(dtype=self.working_dtype) if self.precision == "bf16-true" else module

    def convert_input(self, data: Any) -> Any:
        """``bf16-true`` casts floating-point inputs to bf16."""
        if self.precision != "bf16-true":
            return data
        return tree_map(
            lambda t: t.to(self.working_dtype) if isinstance(t, Tensor) and t.is_floating_point() else t, data
        )

    def forward_context(self, device_type: str) -> AbstractContextManager:
        """Autocast to the working dtype in the mixed modes."""
        return torch.autocast(device_type, dtype=self.working_dtype) if self.is_mixed else nullcontext()

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call ``backward`` on (multiplied by the loss scale under ``16-mixed``)."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def global_grad_norm(
    grads: list[Tensor],
    device: Optional[torch.device] = None,
    norm_type: float = 2.0,
    group: Optional[Any] = None,
    tensor_group: Optional[Any] = None,
    replicated: Sequence[Tensor] = (),
) -> Tensor:
    """The ``norm_type``-norm of all gradients of all ranks (each rank passes its shard); identical on every rank.

    ``device``: where the all-reduce runs (the collectives' device), when the gradients are elsewhere (offload).
    ``group``: the ranks whose shards together make one copy of the gradients (default: all).
    ``tensor_group``, ``replicated``: under tensor parallelism, ``grads`` are slices of tensors cut over
    ``tensor_group`` and ``replicated`` the gradients of parameters every rank of it holds whole.

    [Note: the norm over the shard group]
    Under hybrid sharding every shard group holds all gradients once and its replicas hold the same again, so the
    powers are summed over the shard group only: summed over the world, each would count N/k times.

    [Note: the norm over both dimensions]
    Under tensor parallelism the shard group holds one copy of this rank's *slices*; the t tensor-parallel ranks
    hold the other slices, and each holds the same copy of the replicated parameters (LayerNorms, embeddings). The
    norm counts every element of the full model once: the powers of the slices are summed over the shard group and
    then over the tensor group, those of the replicated gradients enter each tensor rank's sum divided by t (the t
    equal shares add up to one copy; t is a power of two in practice, so the division is exact). The inf-norm takes
    the maximum over both groups. ``torch.nn.utils.clip_grad_norm_`` on the full model under DDP gives the same norm.
    """
    at = grads[0].device if grads else (replicated[0].device if replicated else (device or torch.device("cpu")))
    local = torch.zeros(1, dtype=torch.float32, device=at)
    t = collectives.world_size(tensor_group) if tensor_group is not None else 1
    if math.isinf(norm_type):
        for g in [*grads, *replicated]:
            if g.numel():
                local = torch.maximum(local, g.detach().float().abs().max().to(at).reshape(1))
        total = collectives.all_reduce(local.to(device or at), op=collectives.MAX, group=group)
        return collectives.all_reduce(total, op=collectives.MAX, group=tensor_group) if t > 1 else total
    for g in grads:
        local += g.detach().float().abs().pow(norm_type).sum().to(at)
    for g in replicated:
        local += g.detach().float().abs().pow(norm_type).sum().to(at) / t
    total = collectives.all_reduce(local.to(device or at), group=group)
    if t > 1:
        total = collectives.all_reduce(total, group=tensor_group)
    return total.pow(1.0 / norm_type)


def clip_grad_norm(
    grads: list[Tensor],
    max_norm: float,
    device: Optional[torch.device] = None,
    norm_type: float = 2.0,
    group: Optional[Any] = None,
    tensor_group: Optional[Any] = None,
    replicated: Sequence[Tensor] = (),
) -> Tensor:
    """Scale ``grads`` (and ``replicated``) in place so that their global norm is at most ``max_norm``
    (``clip_grad_norm_``'s rule); returns the norm before clipping."""
    total = global_grad_norm(grads, device, norm_type, group, tensor_group, replicated)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in [*grads, *replicated]:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def clip_grad_value(grads: list[Tensor], clip_val: float) -> None:
    """Clamp every gradient element into ``[-clip_val, clip_val]`` (elementwise: each rank its shard)."""
    for g in grads:
        g.clamp_(-clip_val, clip_val)


def parameter_grad_norms(
    optimizers: Sequence[Any], names: dict[int, str], norm_type: float, group: Any, device: torch.device
) -> dict[str, Tensor]:
    """Lightning's ``grad_norm`` for the owned parameters of ``optimizers`` (``ShardedOptimizer`` objects, reduced):
    each parameter's ``norm_type``-norm from this rank's pieces of the master gradients, completed by one
    all-reduce of a number per parameter over the shard group, then their total. ``names``: ``id(param)`` to name."""
    params = [p for sharded in optimizers for p in sharded.params if id(p) in names]
    index = {id(p): i for i, p in enumerate(params)}
    inf = norm_type == float("inf")
    local = torch.zeros(len(params), dtype=torch.float64, device=device)
    for sharded in optimizers:
        for slot, master in sharded.own_masters():
            if master.grad is None:
                continue
            flat = master.grad.detach().reshape(-1)
            for p, _, length, offset in slot.pieces:
                at = index.get(id(sharded.members[p]))
                if at is None or not length:
                    continue
                piece = flat[offset : offset + length].double().abs()
                local[at] = torch.maximum(local[at], piece.max()) if inf else local[at] + piece.pow(norm_type).sum()
    collectives.all_reduce(local, op=collectives.MAX if inf else None, group=group)
    norms = local if inf else local.pow(1.0 / norm_type)
    out = {f"grad_{norm_type}_norm/{names[id(p)]}": norms[i].float() for i, p in enumerate(params)}
    if out:
        out[f"grad_{norm_type}_norm_total"] = torch.stack(list(out.values())).norm(norm_type)
    return out
