"""LightningCLI: the registered names and the long form with typed, validated options."""

from __future__ import annotations

import re
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

import lightning_zero
from lightning_zero.cli import main as lightning_zero_command
from lightning_zero.lightning.trainer.cli_errors import unknown_zero_strategy
from tests.models import Block, TinyGPT

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

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
      nonfinite: skip
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
    assert strategy.config.nonfinite == "skip"


@pytest.mark.parametrize("bad", ["stage: 4", "stagee: 3", "reduce_bucket_size: lots", "state_dict_type: half",
                                 "nonfinite: warn"])
def test_a_wrong_option_is_a_cli_error(tmp_path, bad, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(f"trainer:\n  strategy:\n    class_path: lightning_zero.ZeroStrategy\n    init_args:\n      {bad}\n")
    with pytest.raises(SystemExit):
        _cli("--config", str(config))
    assert bad.split(":")[0] in capsys.readouterr().err


@pytest.mark.parametrize(("value", "expected"), [("60", timedelta(seconds=60)), ("2.5", timedelta(seconds=2.5)),
                                                 ("'0:05:00'", timedelta(minutes=5))])
def test_timeout_from_yaml_in_seconds_or_h_m_s(tmp_path, value, expected):
    config = tmp_path / "timeout.yaml"
    config.write_text(f"trainer:\n  strategy:\n    class_path: lightning_zero.ZeroStrategy\n    init_args:\n"
                      f"      timeout: {value}\n")
    assert _cli("--config", str(config)).trainer.strategy._timeout == expected


def test_a_misspelled_zero_name_lists_ours(capsys):
    assert unknown_zero_strategy("zero2") is None and unknown_zero_strategy("ddp") is None
    with pytest.raises(SystemExit):
        lightning_zero_command(["fit", "--model", "tests.models.TinyGPT", "--trainer.strategy", "zero4",
                                "--trainer.accelerator", "cpu", "--trainer.devices", "1"])
    err = capsys.readouterr().err
    assert "There is no strategy 'zero4'" in err and all(f"zero{s}," in err for s in (1, 2, 3)), err


def test_the_help_command_in_zero3_yaml_lists_the_strategy_options(capsys):
    comment = (EXAMPLES / "configs" / "zero3.yaml").read_text()
    flag, class_path = re.search(r"fit (--trainer\.strategy\.help) (\S+?)`", comment).groups()
    with pytest.raises(SystemExit) as exit_:
        _cli(flag, class_path)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(f"--trainer.strategy.{option}" in out for option in ("stage", "unit_classes", "timeout")), out


def test_sizes_in_yaml_may_be_written_1e6(tmp_path, capsys):
    config = tmp_path / "sizes.yaml"
    config.write_text("trainer:\n  strategy:\n    class_path: lightning_zero.ZeroStrategy\n    init_args:\n"
                      "      stage: 3\n      reduce_bucket_size: 1e6\n      prefetch_size: 2.5e6\n")
    strategy = _cli("--config", str(config), "--trainer.accelerator", "cpu", "--trainer.devices", "1").trainer.strategy
    assert strategy.config.reduce_bucket_size == 1_000_000 and type(strategy.config.reduce_bucket_size) is int
    assert strategy.config.prefetch_size == 2_500_000
    config.write_text("trainer:\n  strategy:\n    class_path: lightning_zero.ZeroStrategy\n    init_args:\n"
                      "      reduce_bucket_size: 1.5\n")
    with pytest.raises(ValueError, match="`reduce_bucket_size` must be a whole number of elements, got 1.5"):
        _cli("--config", str(config))


def test_a_misspelled_option_in_yaml_gets_a_did_you_mean(tmp_path, capsys):
    config = tmp_path / "typo.yaml"
    config.write_text("trainer:\n  accelerator: cpu\n  devices: 1\n  strategy:\n    class_path: "
                      "lightning_zero.ZeroStrategy\n    init_args:\n      reduce_bucket_sise: 1000\n")
    with pytest.raises(SystemExit):
        lightning_zero_command(["fit", "--model", "tests.models.TinyGPT", "--config", str(config)])
    assert "`reduce_bucket_sise`: did you mean `reduce_bucket_size`?" in capsys.readouterr().err


def test_a_missing_ckpt_path_is_found_before_the_model_is_built(tmp_path, capsys):
    with pytest.raises(SystemExit):
        lightning_zero_command(["fit", "--model", "tests.models.TinyGPT", "--trainer.strategy", "zero3",
                                "--trainer.accelerator", "cpu", "--trainer.devices", "1",
                                "--ckpt_path", str(tmp_path / "nothing.ckpt")])
    assert "`ckpt_path`: No checkpoint at" in capsys.readouterr().err


def _zero_cli(*args: str) -> LightningCLI:
    """``lightning-zero fit``'s CLI class with its command line as the command would pass it, not run."""
    from lightning_zero.lightning.cli import expand_short_strategy, zero_cli

    return zero_cli()(TinyGPT, args=expand_short_strategy(["--trainer.accelerator", "cpu", "--trainer.devices", "1",
                                                            *args]), run=False, save_config_callback=None)


@pytest.mark.parametrize("flags", [["--trainer.strategy", "zero3"], ["--trainer.strategy=zero3_spawn"]])
@pytest.mark.parametrize("option", ["--trainer.strategy.reduce_bucket_size", "--trainer.strategy.init_args.reduce_bucket_size"])
def test_options_override_a_short_name_on_the_command_line(flags, option):
    strategy = _zero_cli(*flags, option, "1e6", "--trainer.strategy.prefetch_size", "1000").trainer.strategy
    assert isinstance(strategy, lightning_zero.ZeroStrategy)
    assert (strategy.config.stage, strategy.config.reduce_bucket_size, strategy.config.prefetch_size) == (3, 10**6, 1000)
    assert strategy._start_method == ("spawn" if "spawn" in flags[0] else "popen")


def test_options_after_zero_auto_on_the_command_line_reach_its_own_class():
    strategy = _zero_cli("--trainer.strategy", "zero_auto", "--trainer.strategy.memory_budget", "12GiB",
                         "--trainer.strategy.prefetch_size", "1000").trainer.strategy
    assert type(strategy) is lightning_zero.ZeroAutoStrategy
    assert (strategy._auto_budget, strategy.config.prefetch_size) == (12 * 2**30, 1000)


@pytest.mark.parametrize("strategy", ["ZeroStrategy", "ZeroAutoStrategy"])
def test_a_misspelled_option_of_either_class_in_yaml_is_one_line(tmp_path, strategy, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("trainer:\n  accelerator: cpu\n  devices: 1\n  strategy:\n"
                      f"    class_path: lightning_zero.{strategy}\n    init_args:\n      prefetch_sise: 1\n")
    with pytest.raises(SystemExit):
        LightningCLI(TinyGPT, args=["--config", str(config)], run=False, save_config_callback=None)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`prefetch_sise`: did you mean `prefetch_size`?" in err, err


@pytest.mark.parametrize("name, stage", [("zero3", 3), ("zero2_spawn", 2)])
def test_options_after_a_short_name_in_yaml_override_it(tmp_path, name, stage):
    config = tmp_path / "short.yaml"
    config.write_text(f"trainer:\n  strategy: {name}\n")
    strategy = _zero_cli("--config", str(config), "--trainer.strategy.reduce_bucket_size", "1e6").trainer.strategy
    assert isinstance(strategy, lightning_zero.ZeroStrategy)
    assert (strategy.config.stage, strategy.config.reduce_bucket_size) == (stage, 10**6)
    assert strategy._start_method == ("spawn" if "spawn" in name else "popen")


def test_a_short_name_under_a_subcommand_in_yaml_is_found(tmp_path):
    from lightning_zero.lightning.cli import expand_short_strategy

    config = tmp_path / "short.yaml"
    config.write_text("fit:\n  trainer:\n    strategy: zero3\n")
    argv = ["--config", str(config), "fit", "--trainer.strategy.prefetch_size", "7"]
    assert expand_short_strategy(argv) == [*argv[:3], "--trainer.strategy", "lightning_zero.ZeroStrategy",
                                           "--trainer.strategy.stage", "3", *argv[3:]]
    assert expand_short_strategy(["--config", str(config), "fit"]) == ["--config", str(config), "fit"]


def test_options_after_a_short_name_in_yaml_without_the_command_get_the_form_that_works(tmp_path, capsys):
    from lightning_zero.lightning.cli import zero_cli

    config = tmp_path / "short.yaml"
    config.write_text("trainer:\n  strategy: zero3\n")
    with pytest.raises(SystemExit):
        zero_cli()(TinyGPT, args=["--config", str(config), "--trainer.strategy.reduce_bucket_size", "1e6"], run=False)
    err = capsys.readouterr().err
    assert "NestedArg(key='reduce_bucket_size'" in err and "--trainer.strategy lightning_zero.ZeroStrategy " \
        "--trainer.strategy.stage 3 --trainer.strategy.reduce_bucket_size 1e6" in err, err


def test_the_command_passes_its_command_line_without_lightnings_warning_about_args(monkeypatch, recwarn):
    monkeypatch.setattr(sys, "argv", ["lightning-zero", "fit", "--trainer.strategy", "zero3"])
    _zero_cli("--trainer.strategy", "zero3")
    assert not [w for w in recwarn if "args parameter" in str(w.message)]