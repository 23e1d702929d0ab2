"""The common mistakes get one line that says what was wrong and what to do (docs/errors.md lists them).

Each case makes the mistake the way a user makes it and checks the line: in a LightningCLI YAML file (through a
plain ``LightningCLI`` script, as a user writes it), in Python, and from the package's own checks.
"""

from __future__ import annotations

import re

import pytest
from lightning.pytorch.cli import LightningCLI

import lightning_zero
from tests.models import TinyGPT

WRONG_OPTIONS = {  # the YAML line, the key the error names, what the error says (the Python API's words)
    "stage: 4": ("stage", r"ZeRO has no stage 4\. Pick one of \[1, 2, 3\]"),
    "stagee: 3": ("", r"Unknown ZeRO option 'stagee' \(`stagee`: did you mean `stage`\?\)"),
    "state_dict_type: half": ("state_dict_type", r"`state_dict_type` must be 'sharded' or 'full', got 'half'"),
    "reduce_bucket_size: lots": ("reduce_bucket_size", r"`reduce_bucket_size` must be a positive int"),
    "nonfinite: warn": ("nonfinite", r"`nonfinite` must be 'raise', 'skip' or None"),
}


@pytest.mark.parametrize("line", WRONG_OPTIONS)
def test_a_wrong_option_in_yaml_is_one_line_with_the_file_and_key(tmp_path, line, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("trainer:\n  accelerator: cpu\n  devices: 1\n  strategy:\n"
                      f"    class_path: lightning_zero.ZeroStrategy\n    init_args:\n      {line}\n")
    with pytest.raises(SystemExit) as exited:
        LightningCLI(TinyGPT, args=["--config", str(config)], run=False, save_config_callback=None)
    err = capsys.readouterr().err
    key, says = WRONG_OPTIONS[line]
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {config}: `trainer.strategy.init_args{'.' + key if key else ''}`: "), err
    assert re.search(says, err), err
    # the same mistake in Python says the same thing
    option, value = line.split(": ")
    with pytest.raises((ValueError, TypeError)) as raised:
        lightning_zero.ZeroStrategy(**{option: int(value) if value.isdigit() else value})
    assert str(raised.value).split("\n")[0] in err


def test_an_error_that_is_not_about_the_strategy_is_left_to_jsonargparse(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("trainer:\n  max_steps: many\n")
    with pytest.raises(SystemExit):
        LightningCLI(TinyGPT, args=["--config", str(config)], run=False, save_config_callback=None)
    assert "max_steps" in capsys.readouterr().err


@pytest.mark.parametrize("make", ["Trainer", "Fabric"])
@pytest.mark.parametrize("name", ["zero4", "zero_3", "Zero-2"])
def test_a_misspelled_zero_strategy_name_lists_ours_in_python(make, name):
    import lightning as L

    with pytest.raises(ValueError) as raised:
        getattr(L, make)(strategy=name, accelerator="cpu", devices=1)
    message = str(raised.value)
    assert message.startswith(f"There is no strategy {name!r}. lightning-zero registers zero1, zero2, zero3 (ZeRO stages 1-3), zero_auto")
    assert "\n" not in message
