"""Module paths of the previous layout still import, as the same module, with a warning naming the new path."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import pytest

import lightning_zero
from lightning_zero import _moved


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_path_imports_the_new_module_with_a_warning(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"`{old}` moved to `{_moved.MOVED[old]}`"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(_moved.MOVED[old])
    assert module.__spec__ is not None and module.__spec__.name == _moved.MOVED[old]  # its own spec, not the alias's


def test_what_users_typed_before_still_works_in_a_fresh_process() -> None:
    """The names the previous README and docs showed, imported as a user's script would, in a fresh interpreter."""
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "import lightning_zero\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from lightning_zero.trainer.strategy import ZeroStrategy\n"
        "from lightning_zero.core.memory import measure_model_states\n"
        "from lightning_zero.checkpoints.pretrained import load_pretrained\n"
        "from lightning_zero.fabric.strategy import ZeroFabricStrategy\n"
        "assert ZeroStrategy is lightning_zero.ZeroStrategy and load_pretrained is lightning_zero.load_pretrained\n"
        "assert ZeroFabricStrategy is lightning_zero.ZeroFabricStrategy\n"
        "assert measure_model_states is lightning_zero.measure_model_states\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_old_path_names_a_module_that_exists() -> None:
    for old, new in _moved.MOVED.items():
        assert importlib.util.find_spec(new) is not None, f"{old} -> {new}: no such module"
    assert lightning_zero.__name__ == "lightning_zero"
