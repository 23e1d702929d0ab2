"""What the Trainer's and Fabric's precision plugins share: the numerics are the engine's
``PrecisionMode`` (dtypes, autocast, loss scaling); each plugin adds only what its
Lightning base class asks differently."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Optional

import torch

from lightning_zero.engine.amp import LossScaler, PrecisionInput, PrecisionMode

if TYPE_CHECKING:
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR

__all__ = ["LossScaler", "PrecisionInput", "PrecisionMode", "UsesPrecisionMode"]


class UsesPrecisionMode:
    """Mixin of the Trainer's and Fabric's precision plugins: the numerics are ``self.mode``'s (a
    ``PrecisionMode``); each plugin adds only what its Lightning base class asks differently."""

    mode: PrecisionMode
    precision: _PRECISION_INPUT_STR  # Lightning's attribute (one of ours, in its wider type)

    def __init__(
        self, precision: PrecisionInput = "32-true", device_type: str = "cpu", loss_scaler: Optional[LossScaler] = None
    ) -> None:
        self.mode = PrecisionMode(precision, loss_scaler)
        self.precision = self.mode.precision
        self.device_type = device_type

    @property
    def scaler(self) -> Optional[LossScaler]:
        return self.mode.scaler

    @property
    def working_dtype(self) -> torch.dtype:
        """dtype of the parameters the model computes with."""
        return self.mode.working_dtype

    @property
    def master_dtype(self) -> torch.dtype:
        """dtype of the weights and states the optimizer steps on."""
        return self.mode.master_dtype

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.mode.convert_module(module)

    def forward_context(self) -> AbstractContextManager:
        return self.mode.forward_context(self.device_type)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        return self.mode.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.mode.load_state_dict(state_dict)
