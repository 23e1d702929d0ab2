"""The adapters: the only code that imports Lightning.

``trainer/`` is the Trainer's strategy (``ZeroStrategy``, and ``ZeroAutoStrategy`` for ``zero_auto``), its precision
plugin and CheckpointIO;
``fabric/`` is Fabric's (``ZeroFabricStrategy``); ``processes.py`` and ``precision.py`` are what the two share (the
process group and launcher, the precision plugins' common half); ``cli.py`` is ``LightningCLI`` for the
``lightning-zero fit`` command. Everything here is a thin layer over ``ZeroEngine``:
it may import every folder below it, and nothing outside this folder imports Lightning (``tests/test_layers.py``).
``install`` is what ``import lightning_zero`` does to Lightning.
"""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.lightning.fabric.strategy import ZeroFabricStrategy
from lightning_zero.lightning.trainer import cli_errors, early_checks, grad_norm, lightning_loads
from lightning_zero.lightning.trainer.auto import ZeroAutoStrategy
from lightning_zero.lightning.trainer.strategy import ZeroStrategy


def install() -> None:
    """Register the strategy names with the Trainer and Fabric, and the hooks into Lightning's own code paths.

    [Note: what importing the package does to Lightning]
    ``Trainer(strategy="zero2")`` needs the names in Lightning's registries before the Trainer is built, so the
    package registers them when it is imported, as Lightning's own strategies are. The four hooks read sharded
    checkpoints in Lightning's loaders, make Lightning's ``grad_norm`` read gradient shards, shorten a LightningCLI
    error about a ZeRO option to one line, and check the Trainer's ``ckpt_path`` before the model is built. Each is
    installed once, however many times this is called.
    """
    ZeroStrategy.register_strategies(StrategyRegistry)
    ZeroAutoStrategy.register_strategies(StrategyRegistry)
    lightning_loads.install()  # MyModule.load_from_checkpoint(dir) and ddp's ckpt_path=dir read sharded directories
    grad_norm.install()  # Lightning's grad_norm reads the gradient shards (see trainer/grad_norm.py)
    cli_errors.install()  # a wrong ZeroStrategy option in a LightningCLI config: one line (see cli_errors.py)
    early_checks.install()  # the Trainer's ckpt_path is checked before the model is built (see early_checks.py)
    ZeroFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
