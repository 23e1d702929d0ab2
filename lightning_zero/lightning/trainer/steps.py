"""The step half of :class:`~lightning_zero.ZeroStrategy`: Lightning's training, evaluation and backward hooks,
handed to the engine (stage 3 gathers and frees its units around them) at points where every rank agrees on signals.

Kept apart from ``strategy.py`` so that each file stays readable. ``ZeroStrategy`` lists this class among its bases
before Lightning's, so these hooks override ``ParallelStrategy``'s and ``super()`` here reaches Lightning's. The
optimizer step itself is the engine's, reached through the precision plugin (``precision.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

from torch import Tensor
from typing_extensions import override

from lightning_zero.lightning.trainer.hooks_base import StrategyHooks


class StepHooks(StrategyHooks):
    """Uses the strategy's ``engine``, ``lightning_module`` and ``_step_boundary`` (``lightning/processes.py``)."""

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._step_boundary()
        self.engine.begin_step()
        self.engine.completed_steps = self.lightning_module.trainer.global_step  # named by the non-finite guard
        output = super().training_step(*args, **kwargs)
        if not self.lightning_module.automatic_optimization:
            self.engine.end_step()
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
        self._step_boundary("evaluation.step")
        self.engine.begin_step()
        try:
            return step(*args, **kwargs)
        finally:
            self.engine.end_step()

    @override
    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """The micro-batches ``accumulate_grad_batches`` runs before the one the step follows."""
        with self.engine.no_backward_sync():
            yield

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # manual optimization may run more forwards before its `optimizer.step()`: the root stays until the step ends
        self.engine.finish_backward(include_root=self.lightning_module.automatic_optimization)
