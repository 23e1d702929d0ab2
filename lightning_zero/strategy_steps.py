"""The step half of :class:`~lightning_zero.ZeroStrategy`: Lightning's training, evaluation, backward and optimizer
step hooks, around which stage 3 gathers and frees its units and every rank agrees on signals.

Kept apart from ``strategy.py`` so that each file stays readable. ``ZeroStrategy`` lists this class among its bases
before Lightning's, so these hooks override ``ParallelStrategy``'s and ``super()`` here reaches Lightning's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.faults import fault_point
from lightning_zero.shutdown import GUARD
from lightning_zero.units import ROOT


class StepHooks:
    """Uses the strategy's ``engines``, ``runtime`` and ``lightning_module``."""

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        GUARD.safe_point()
        if self.runtime is not None:
            self.runtime.gather(ROOT)
        output = super().training_step(*args, **kwargs)
        assert self.lightning_module is not None
        if self.runtime is not None and not self.lightning_module.automatic_optimization:
            self.runtime.end_step()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().predict_step, *args, **kwargs)

    def _evaluation_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        GUARD.safe_point()
        fault_point("evaluation.step")
        if self.runtime is None:
            return step(*args, **kwargs)
        self.runtime.gather(ROOT)
        try:
            return step(*args, **kwargs)
        finally:
            self.runtime.end_step()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        for engine in self.engines:
            engine.finish_backward()
        if self.runtime is not None:
            assert self.lightning_module is not None
            self.runtime.end_backward(include_root=self.lightning_module.automatic_optimization)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.runtime is not None:
            self.runtime.refresh()
        return output
