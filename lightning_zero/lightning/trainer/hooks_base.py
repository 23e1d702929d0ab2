"""The base that the Trainer strategy's hook mixins (``checkpoints.py``, ``steps.py``) are type-checked against.

At run time :data:`StrategyHooks` is ``object``: ``ZeroStrategy`` lists the mixins before ``ZeroProcesses`` and
Lightning's ``ParallelStrategy``, so ``self`` and ``super()`` in a hook reach those. The type checker sees the same
thing as a base class, with the engine and the LightningModule typed as present: Lightning calls these hooks only
after ``setup``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.strategies.parallel import ParallelStrategy

    from lightning_zero.engine.engine import ZeroEngine
    from lightning_zero.lightning.processes import ZeroProcesses

    class StrategyHooks(ZeroProcesses, ParallelStrategy):
        """What the hook mixins may use of the strategy they are mixed into."""

        engine: ZeroEngine
        lightning_module: LightningModule
else:
    StrategyHooks = object
