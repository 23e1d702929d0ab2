"""The Lightning precision plugin of ZeRO: 16-bit working parameters, master shards, the step's order of events.

[Note: the order of one optimizer step]
``ZeroPrecision.optimizer_step`` runs, for the optimizer at hand:
1. the closure (forward and backward; stage 2 reduce-scatters buckets during backward),
2. ``prepare_step``: stage 1 reduce-scatters the full ``.grad`` now; every master tensor gets its averaged gradient,
3. for ``16-mixed``: unscale the master gradients and agree on overflow across ranks (one all-reduce of a flag),
4. Lightning's ``on_before_optimizer_step`` hooks and gradient clipping (global norm over all shards),
5. the user's ``optimizer.step()``, skipped on every rank or none when the loss scaler found an overflow,
6. ``after_step``: the master gradients are dropped (the reduced ones stay in the shard until ``zero_grad``) and the
   updated shards all-gathered into the working parameters (of every engine the optimizer stepped on).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero import collectives

ZeroPrecisionInput = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}
_WORKING_DTYPE = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16,
                  "bf16-true": torch.bfloat16}


def normalize_precision(precision: Union[str, int]) -> str:
    """Map Lightning's precision spellings to ours; raise for what ZeRO does not support."""
    value = _ALIASES.get(precision, precision)
    if value not in SUPPORTED_PRECISION:
        raise ValueError(
            f"ZeroStrategy does not support precision={precision!r}. Choose one of {', '.join(SUPPORTED_PRECISION)}."
        )
    return str(value)


class LossScaler:
    """Dynamic loss scaling for ``16-mixed``, with the overflow decision shared by all ranks."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.scale = init_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

    def unscale_and_check(self, grads: list[Tensor], device: torch.device) -> bool:
        """Divide ``grads`` by the scale in place; ``True`` when any rank saw an inf or NaN.

        ``device`` is the collectives' device; the gradients may be elsewhere (on the host with offload).
        """
        at = grads[0].device if grads else device
        found = torch.zeros(1, device=at)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((1,), 1.0 / self.scale, device=at))
        found = collectives.all_reduce(found.to(device), op=collectives.MAX)
        return bool(found.item())

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
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class ZeroPrecision(Precision):
    """Precision plugin for :class:`~lightning_zero.ZeroStrategy`.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"``. In the mixed modes the
            working parameters and gradients are 16-bit and the optimizer steps on fp32 master shards, the forward
            runs under autocast; in ``"bf16-true"`` everything is bf16.
        device_type: the autocast device type (``"cpu"`` or ``"cuda"``); set by the strategy.
        loss_scaler: the scaler for ``"16-mixed"``; a default dynamic one is made when omitted.
    """

    def __init__(self, precision: ZeroPrecisionInput = "32-true", device_type: str = "cpu",
                 loss_scaler: Optional[LossScaler] = None) -> None:
        self.precision = normalize_precision(precision)  # type: ignore[assignment]
        self.device_type = device_type
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

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # Mixed: parameters managed by an optimizer are cast into the engine's 16-bit buffer; the rest stay fp32 and
        # autocast handles them. True: the whole module is converted, as Lightning's HalfPrecision does.
        if self.precision == "bf16-true":
            return module.to(dtype=self.working_dtype)
        return module

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision == "bf16-true":
            return apply_to_collection(data, Tensor, lambda t: t.to(self.working_dtype) if t.is_floating_point() else t)
        return data

    @override
    def forward_context(self) -> AbstractContextManager:
        if self.is_mixed:
            return torch.autocast(self.device_type, dtype=self.working_dtype)
        return nullcontext()

    @override
    def pre_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:  # type: ignore[override]
        tensor = super().pre_backward(tensor, module)
        return tensor * self.scaler.scale if self.scaler is not None else tensor

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: "pl.LightningModule", closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """See [Note: the order of one optimizer step]."""
        engine = _engine_of(optimizer)
        closure_result = closure()
        engine.prepare_step()
        overflow = False
        if self.scaler is not None:
            overflow = self.scaler.unscale_and_check(engine.grads(), engine.device)
        self._after_closure(model, optimizer)
        step_output = None
        if not overflow:
            step_output = engine.step(lambda: optimizer.step(**kwargs))
        if self.scaler is not None:
            self.scaler.update(overflow)
        engine.after_step(stepped=not overflow)
        return closure_result if step_output is None else step_output

    @override
    def clip_gradients(self, optimizer: Optimizer, clip_val: Union[int, float] = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if clip_val <= 0:
            return
        engine = _engine_of(optimizer)
        engine.prepare_step()
        grads = engine.grads()
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            for g in grads:
                g.clamp_(-clip_val, clip_val)
        elif gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            clip_grad_norm(grads, clip_val, engine.device, engine.group)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def global_grad_norm(grads: list[Tensor], device: Optional[torch.device] = None, group: Optional[Any] = None,
                     ) -> Tensor:
    """The 2-norm of all gradients of all ranks (each rank passes its shard); identical on every rank.

    ``device``: where the all-reduce runs (the collectives' device), when the gradients are elsewhere (offload).
    ``group``: the shard group (``None``: the world). [Note: the norm over the shard group] Under hybrid sharding
    every shard group holds all gradients once and its replicas hold the same again, so the squares are summed over
    the shard group only: summed over the world, each would count N/k times.
    """
    at = grads[0].device if grads else (device or torch.device("cpu"))
    local = torch.zeros(1, dtype=torch.float32, device=at)
    for g in grads:
        local += g.detach().float().pow(2).sum()
    return collectives.all_reduce(local.to(device or at), group=group).sqrt()


def clip_grad_norm(grads: list[Tensor], max_norm: float, device: Optional[torch.device] = None,
                   group: Optional[Any] = None) -> Tensor:
    """Scale ``grads`` in place so that their global norm is at most ``max_norm`` (``clip_grad_norm_``'s rule);
    ``group``: the shard group the grads are sharded over (see :func:`global_grad_norm`)."""
    total = global_grad_norm(grads, device, group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def _engine_of(optimizer: Optimizer) -> Any:
    engine = getattr(optimizer, "_zero_engine", None)
    if engine is None:
        raise RuntimeError(
            f"{type(optimizer).__name__} was not set up by ZeroStrategy. Create optimizers in `configure_optimizers`;"
            " ZeroPrecision only works together with ZeroStrategy."
        )
    return engine


def to_zero_precision(plugin: Precision) -> ZeroPrecision:
    """Lightning builds its own plugin from ``Trainer(precision=...)``; translate it to ours, or refuse it."""
    if isinstance(plugin, ZeroPrecision):
        return plugin
    if isinstance(plugin, MixedPrecision):
        return ZeroPrecision(plugin.precision, device_type=plugin.device)
    if isinstance(plugin, HalfPrecision):
        return ZeroPrecision(plugin.precision)
    if type(plugin) is Precision:
        return ZeroPrecision("32-true")
    raise ValueError(
        f"ZeroStrategy does not support the precision plugin {type(plugin).__name__} "
        f"(precision={getattr(plugin, 'precision', '?')!r}). Use precision='32-true', 'bf16-mixed', '16-mixed' or "
        "'bf16-true', or pass `lightning_zero.ZeroPrecision(...)` in `plugins`."
    )
