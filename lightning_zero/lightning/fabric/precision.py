"""``ZeroFabricPrecision``: Fabric's precision plugin for ``ZeroFabricStrategy``, and the translation of the plugin
Fabric builds from ``Fabric(precision=...)`` into it."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from typing_extensions import override

from lightning_zero.lightning.precision import LossScaler, PrecisionInput, UsesPrecisionMode


class ZeroFabricPrecision(UsesPrecisionMode, Precision):
    """Fabric's precision plugin for ``ZeroFabricStrategy`` (the numerics are ``PrecisionMode``'s).

    Inputs and outputs are cast as Fabric's own ``MixedPrecision`` / ``HalfPrecision`` cast them.
    """

    def __init__(
        self, precision: PrecisionInput = "32-true", device_type: str = "cpu", loss_scaler: Optional[LossScaler] = None
    ) -> None:
        super().__init__(precision, device_type, loss_scaler)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self.mode.working_dtype) if self.precision == "bf16-true" else nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.mode.working_dtype)

    @override
    def convert_output(self, data: Any) -> Any:
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())


def to_fabric_precision(plugin: Precision, device_type: str) -> ZeroFabricPrecision:
    """Fabric builds its own plugin from ``Fabric(precision=...)``; translate it to ours, or refuse it."""
    if isinstance(plugin, ZeroFabricPrecision):
        return plugin
    if isinstance(plugin, (MixedPrecision, HalfPrecision)) or type(plugin) is Precision:
        return ZeroFabricPrecision(getattr(plugin, "precision", "32-true"), device_type=device_type)
    raise ValueError(
        f"ZeroFabricStrategy does not support the precision plugin {type(plugin).__name__} "
        f"(precision={getattr(plugin, 'precision', '?')!r}). Use precision='32-true', 'bf16-mixed', '16-mixed' or "
        "'bf16-true'."
    )
