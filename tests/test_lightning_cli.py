"""LightningCLI: the registered names and the long form with typed, validated options."""

from __future__ import annotations

import pytest
from lightning.pytorch.cli import LightningCLI

import lightning_zero
from tests.models import Block, TinyGPT

LONG_FORM = """
trainer:
  accelerator: cpu
  devices: 1
  strategy:
    class_path: lightning_zero.ZeroStrategy
    init_args:
      stage: 3
      reduce_bucket_size: 1000
      unit_classes: [tests.models.Block]
      state_dict_type: full
"""


def _cli(*args: str) -> LightningCLI:
    return LightningCLI(TinyGPT, args=list(args), run=False, save_config_callback=None)


def test_short_name_in_the_trainer_config():
    cli = _cli("--trainer.strategy", "zero3", "--trainer.accelerator", "cpu", "--trainer.devices", "1")
    assert isinstance(cli.trainer.strategy, lightning_zero.ZeroStrategy) and cli.trainer.strategy.config.stage == 3


def test_long_form_yaml_sets_typed_options(tmp_path):
    config = tmp_path / "zero3.yaml"
    config.write_text(LONG_FORM)
    strategy = _cli("--config", str(config)).trainer.strategy
    assert isinstance(strategy, lightning_zero.ZeroStrategy)
    assert (strategy.config.stage, strategy.config.reduce_bucket_size) == (3, 1000)
    assert strategy.config.unit_classes == (Block,) and strategy.config.state_dict_type == "full"


@pytest.mark.parametrize("bad", ["stage: 4", "stagee: 3", "reduce_bucket_size: lots", "state_dict_type: half"])
def test_a_wrong_option_is_a_cli_error(tmp_path, bad, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(f"trainer:\n  strategy:\n    class_path: lightning_zero.ZeroStrategy\n    init_args:\n      {bad}\n")
    with pytest.raises(SystemExit):
        _cli("--config", str(config))
    assert bad.split(":")[0] in capsys.readouterr().err
