"""lightning-zero: ZeRO (arXiv:1910.02054) as a PyTorch Lightning strategy, a Fabric strategy and a plain engine.

Importing the package registers ``zero1``, ``zero2``, ``zero3`` (and ``_spawn`` / ``_fork`` variants) with the
Trainer and with Fabric, and ``zero_auto`` (the configuration chosen from the memory budget) with the Trainer,
so that ``Trainer(strategy="zero2")`` and ``Fabric(strategy="zero2")`` work;
:class:`ZeroEngine` runs the same steps from a plain PyTorch loop. Sharded checkpoints are read back with :func:`load_from_checkpoint`,
:func:`consolidate` (or ``lightning-zero consolidate``), :func:`export_pretrained` (a Hugging Face directory, or ``lightning-zero export``) and, under other strategies, :class:`ZeroCheckpointIO`. :func:`load_pretrained` fills a model (sharded or not) from a
Hugging Face ``save_pretrained`` directory, safetensors files or a ``torch.save`` state dict, a tensor at a time.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.checkpoints.storage import CheckpointError
from lightning_zero.core.traffic import Traffic
from lightning_zero.config import ZeroConfig
from lightning_zero.trainer.checkpoint_io import ZeroCheckpointIO, load_from_checkpoint
from lightning_zero.checkpoints.consolidate import consolidate, inspect_checkpoint, load_full_checkpoint
from lightning_zero.checkpoints.export import ExportResult, export_pretrained
from lightning_zero.engine.construction import sharded_construction
from lightning_zero.engine.engine import ZeroEngine
from lightning_zero.fabric.strategy import ZeroFabricPrecision, ZeroFabricStrategy
from lightning_zero.core.memory import ModelStateBytes, expected_model_state_bytes, measure_model_states
from lightning_zero.trainer.precision import LossScaler, ZeroPrecision
from lightning_zero.checkpoints.pretrained import LoadResult, load_pretrained
from lightning_zero.stage3.guard import ParameterNotGatheredError
from lightning_zero.trainer.strategy import ZeroStrategy

from lightning_zero.trainer import cli_errors, early_checks, grad_norm, lightning_loads

ZeroStrategy.register_strategies(StrategyRegistry)
lightning_loads.install()  # MyModule.load_from_checkpoint(dir) and ddp's ckpt_path=dir read sharded directories
grad_norm.install()  # Lightning's grad_norm reads the gradient shards (see trainer/grad_norm.py)
cli_errors.install()  # a wrong ZeroStrategy option in a LightningCLI config: one line (see cli_errors.py)
early_checks.install()  # the Trainer's ckpt_path is checked before the model is built (see early_checks.py)
ZeroFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ZeroCheckpointIO",
    "consolidate",
    "export_pretrained",
    "ExportResult",
    "inspect_checkpoint",
    "load_from_checkpoint",
    "load_full_checkpoint",
    "load_pretrained",
    "LoadResult",
    "LossScaler",
    "ModelStateBytes",
    "ParameterNotGatheredError",
    "Traffic",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroFabricPrecision",
    "ZeroFabricStrategy",
    "ZeroPrecision",
    "ZeroStrategy",
    "expected_model_state_bytes",
    "measure_model_states",
    "sharded_construction",
]
