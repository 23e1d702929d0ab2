"""lightning-zero: ZeRO (arXiv:1910.02054) as a PyTorch Lightning strategy, a Fabric strategy and a plain engine.

Importing the package registers ``zero1``, ``zero2``, ``zero3`` (and ``_spawn`` / ``_fork`` variants) with the
Trainer and with Fabric, and ``zero_auto`` (the configuration chosen from the memory budget) with the Trainer,
so that ``Trainer(strategy="zero2")`` and ``Fabric(strategy="zero2")`` work;
``ZeroEngine`` runs the same steps from a plain PyTorch loop. Sharded checkpoints are read back with
``load_from_checkpoint``, ``consolidate`` (or ``lightning-zero consolidate``), ``export_pretrained`` (a
Hugging Face directory, or ``lightning-zero export``) and, under other strategies, ``ZeroCheckpointIO``.
``load_pretrained`` fills a model (sharded or not) from a Hugging Face ``save_pretrained`` directory, safetensors
files or a ``torch.save`` state dict, a tensor at a time.
"""

from lightning_zero.checkpoints.consolidate import consolidate, inspect_checkpoint, load_full_checkpoint
from lightning_zero.checkpoints.export import ExportResult, export_pretrained
from lightning_zero.checkpoints.storage import CheckpointError
from lightning_zero.comm.traffic import Traffic
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.construction import sharded_construction
from lightning_zero.engine.engine import ZeroEngine
from lightning_zero.lightning import install
from lightning_zero.lightning.fabric.precision import ZeroFabricPrecision
from lightning_zero.lightning.fabric.strategy import ZeroFabricStrategy
from lightning_zero.lightning.trainer.auto import ZeroAutoStrategy
from lightning_zero.lightning.trainer.checkpoint_io import ZeroCheckpointIO, load_from_checkpoint
from lightning_zero.lightning.trainer.precision import LossScaler, ZeroPrecision
from lightning_zero.lightning.trainer.strategy import ZeroStrategy
from lightning_zero.memory import account as _account
from lightning_zero.pretrained.loading import LoadResult, load_pretrained
from lightning_zero.shards.accounting import ModelStateBytes, expected_model_state_bytes, measure_model_states
from lightning_zero.stage3.guard import ParameterNotGatheredError

install()  # the strategy names and Lightning's hooks (see [Note: what importing the package does to Lightning])
_account.mark_imported()  # the level every account of this process's memory is read above

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
    "ZeroAutoStrategy",
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
