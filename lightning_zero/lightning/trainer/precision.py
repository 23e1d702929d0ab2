"""The Trainer's precision plugin of ZeRO: a thin adapter that hands Lightning's optimizer step to the engine.

Its numerics (dtypes, autocast, loss scaling, clipping over shards) are
``PrecisionMode``'s; the order of one optimizer step is ``ZeroEngine.step``'s (see
[Note: the order of one optimizer step] in ``engine.py``). Lightning's ``on_before_optimizer_step`` hooks and its
gradient clipping run as the step's ``before_step``, after the gradients were reduced and unscaled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Union, cast

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.lightning.precision import LossScaler, PrecisionInput, UsesPrecisionMode

if TYPE_CHECKING:
    from lightning_zero.engine.engine import ZeroEngine


class ZeroPrecision(UsesPrecisionMode, Precision):
    """Precision plugin for ``ZeroStrategy``.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"``. In the mixed modes the
            working parameters and gradients are 16-bit and the optimizer steps on fp32 master shards, the forward
            runs under autocast; in ``"bf16-true"`` everything is bf16.
        device_type: the autocast device type (``"cpu"`` or ``"cuda"``); set by the strategy.
        loss_scaler: the scaler for ``"16-mixed"``; a default dynamic one is made when omitted.
    """

    def __init__(
        self, precision: PrecisionInput = "32-true", device_type: str = "cpu", loss_scaler: Optional[LossScaler] = None
    ) -> None:
        super().__init__(precision, device_type, loss_scaler)
        self.engine: Optional["ZeroEngine"] = None
        """Set by the strategy at setup."""

    @override
    def convert_input(self, data: Any) -> Any:
        return self.mode.convert_input(data)

    @override
    def pre_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:  # type: ignore[override]
        return self.mode.scale_loss(super().pre_backward(tensor, module))

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: "pl.LightningModule", closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """The engine's step with Lightning's hooks as ``before_step``; the closure (forward and backward) runs
        inside the user's ``optimizer.step``, as under ``ddp`` (see [Note: the closure goes to the optimizer] in
        ``engine.py``)."""
        return self._engine().step(
            optimizer,
            closure=closure,
            before_step=lambda: self._after_closure(model, optimizer),
            zero_grad=False,
            **kwargs,
        )

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self._engine().clip_grad_value(clip_val, optimizer)
        elif gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            self._engine().clip_grad_norm(clip_val, optimizer)

    def _engine(self) -> "ZeroEngine":
        if self.engine is None:
            raise RuntimeError(
                "ZeroPrecision only works together with ZeroStrategy, which sets it up; create the "
                "optimizers in `configure_optimizers`."
            )
        return self.engine


def to_zero_precision(plugin: Precision) -> ZeroPrecision:
    """Lightning builds its own plugin from ``Trainer(precision=...)``; translate it to ours, or refuse it."""
    if isinstance(plugin, ZeroPrecision):
        return plugin
    # Lightning's spellings are wider than ours: PrecisionMode refuses what ZeRO does not support
    if isinstance(plugin, MixedPrecision):
        return ZeroPrecision(cast(PrecisionInput, plugin.precision), device_type=plugin.device)
    if isinstance(plugin, HalfPrecision):
        return ZeroPrecision(cast(PrecisionInput, plugin.precision))
    if type(plugin) is Precision:
        return ZeroPrecision("32-true")
    raise ValueError(
        f"ZeroStrategy does not support the precision plugin {type(plugin).__name__} "
        f"(precision={getattr(plugin, 'precision', '?')!r}). Use precision='32-true', 'bf16-mixed', '16-mixed' or "
        "'bf16-true', or pass `lightning_zero.ZeroPrecision(...)` in `plugins`."
    )
