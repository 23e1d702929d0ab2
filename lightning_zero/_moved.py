"""Module paths of the previous release, still importable for one release with a ``DeprecationWarning``.

[Note: moved modules]
The package's folders were reorganized by concern (``comm/``, ``shards/``, ``process/``, ``lightning/`` ...). A user
who typed a module path of the previous layout (``from lightning_zero.core.memory import measure_model_states``,
``lightning_zero.trainer.strategy.ZeroStrategy`` in a YAML ``class_path``) gets the module at its new path and a
warning naming it. A finder on ``sys.meta_path`` answers only for the names in :data:`MOVED`; the old packages
(``lightning_zero.core``, ``.trainer``, ``.fabric``) are empty stand-ins so that their submodules can be found.
Remove this module in the release after next.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Optional, Sequence

#: Old module path -> the module that replaced it.
MOVED: dict[str, str] = {
    f"lightning_zero.{old}": f"lightning_zero.{new}"
    for old, new in {
        "core.heap_pin": "memory.heap_pin",
        "core.host_memory": "memory.host_memory",
        "core.costs": "memory.costs",
        "core.collectives": "comm.collectives",
        "core.traffic": "comm.traffic",
        "core.groups": "comm.groups",
        "core.quantize": "comm.quantize",
        "core.shutdown": "process.shutdown",
        "core.deadline": "process.deadline",
        "core.faults": "process.faults",
        "core.user_calls": "process.user_calls",
        "engine.one_report": "process.one_report",
        "core.layout": "shards.layout",
        "core.slices": "shards.slices",
        "core.flat": "shards.flat",
        "core.store": "shards.store",
        "core.buckets": "shards.buckets",
        "core.bucket_slots": "shards.bucket_slots",
        "core.optimizer": "shards.optimizer",
        "core.optimizer_support": "shards.optimizer_support",
        "core.sharing": "shards.sharing",
        "core.offload": "shards.offload",
        "core.disk": "shards.disk",
        "core.mixins": "shards.mixins",
        "core.memory": "shards.accounting",
        "core.compiled": "shards.compiled",
        "core.activations": "activations.checkpointing",
        "core.blocks": "activations.blocks",
        "core.amp": "engine.amp",
        "checkpoints.pretrained": "pretrained.loading",
        "checkpoints.pretrained_files": "pretrained.files",
        "engine.processes": "lightning.processes",
        "engine.precision": "lightning.precision",
        **{
            f"{adapter}.{name}": f"lightning.{adapter}.{name}"
            for adapter, names in {
                "trainer": (
                    "auto",
                    "checkpoint_io",
                    "cli_errors",
                    "early_checks",
                    "grad_norm",
                    "lightning_loads",
                    "precision",
                    "strategy",
                ),
                "fabric": ("plain", "resetup", "several", "strategy"),
            }.items()
            for name in names
        },
    }.items()
}
#: The old packages: stand-ins without contents of their own.
OLD_PACKAGES = ("lightning_zero.core", "lightning_zero.trainer", "lightning_zero.fabric")


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names of :data:`MOVED` (and their packages) and loads each as its new module."""

    def __init__(self) -> None:
        self._own_specs: dict[str, Optional[importlib.machinery.ModuleSpec]] = {}

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[types.ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        if fullname in OLD_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        if spec.name in OLD_PACKAGES:
            return None  # a fresh, empty package
        new = MOVED[spec.name]
        warnings.warn(
            f"`{spec.name}` moved to `{new}`; the old path is removed in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._own_specs[new] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is the new one, already imported (or an empty stand-in package). The import
        system has just set the module's ``__spec__`` to the old name's; it is put back to its own."""
        if module.__name__ in self._own_specs:
            module.__spec__ = self._own_specs[module.__name__]


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
