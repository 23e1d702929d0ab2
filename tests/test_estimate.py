"""The estimator prints DESIGN.md's table (the figures the measured bytes are held to in test_measure.py)."""

from __future__ import annotations

import logging

import lightning as L
import pytest

from lightning_zero import expected_model_state_bytes
from lightning_zero.cli import main as cli
from lightning_zero.estimate import count_parameters, largest_model, model_state_table, parse_bytes, parse_count
from tests.models import TinyGPT


def test_the_papers_7_5b_model_on_64_ranks():
    table = model_state_table(7_500_000_000, 64)["bf16-mixed"]
    # ZeRO paper, Figure 1: 120 GB for DDP, 31.4 GB (Pos), 16.6 GB (Pos+g), 1.9 GB (Pos+g+p)
    assert [round(table[k] / 1e9, 1) for k in ("ddp", "zero1", "zero2", "zero3")] == [120.0, 31.4, 16.6, 1.9]


def test_largest_model_inverts_the_table():
    fits = largest_model(80 * 2**30, 8)
    for precision, row in fits.items():
        for name, params in row.items():
            stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[name]
            assert expected_model_state_bytes(params, 8, stage, precision) <= 80 * 2**30
            assert expected_model_state_bytes(params + 1000, 8, stage, precision) > 80 * 2**30
    assert abs(fits["bf16-mixed"]["zero3"] - 8 * fits["bf16-mixed"]["ddp"]) <= 8  # stage 3 fits N times more


def test_count_parameters_builds_on_meta_and_runs_configure_model():
    assert count_parameters("tests.models.TinyGPT", {"width": 16}) == sum(p.numel() for p in TinyGPT(width=16).parameters())
    assert count_parameters("tests.models.TinyGPT", {"width": 16, "meta_init": True}) == count_parameters(
        "tests.models.TinyGPT", {"width": 16})
    with pytest.raises(ValueError, match="Cannot import tests.models.Nope"):
        count_parameters("tests.models.Nope")


def test_units():
    assert parse_count("1.5B") == 1_500_000_000 and parse_count("350M") == 350_000_000 and parse_count("7e9") == 7e9
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("16GB") == 16e9 and parse_bytes("1024B") == 1024


@pytest.mark.parametrize(("text", "match"), [
    ("32", r"not a size with a unit \(32GiB or 32GB\?\)"),  # 32 bytes was never what the user meant
    ("-5GiB", "not a positive size"), ("0GB", "not a positive size"), ("lotsGiB", "not a positive size"),
])
def test_sizes_need_a_unit_and_must_be_positive(text, match):
    with pytest.raises(ValueError, match=match):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["-5", "0", "abc", "0.4", "nan", "inf", ""])
def test_parameter_counts_must_be_positive_numbers(text):
    with pytest.raises(ValueError, match="is not a positive parameter count"):
        parse_count(text)


@pytest.mark.parametrize(("args", "message"), [
    (["--params", "-5"], "argument --params: '-5' is not a positive parameter count"),
    (["--params", "abc"], "argument --params: 'abc' is not a positive parameter count: write e.g. 350M"),
    (["--params", "1B", "--memory", "32"], "argument --memory: '32' is not a size with a unit (32GiB or 32GB?)"),
])
def test_estimate_command_rejects_bad_numbers_with_what_to_write(capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        cli(["estimate", *args, "-n", "2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "parse_" not in err, err


def test_estimate_command(capsys):
    assert cli(["estimate", "--model", "tests.models.TinyGPT", "--init-args", "{width: 512, depth: 6}", "-n", "2",
                "--memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    # the GPT of benchmarks/RESULTS.md: measured 288.84 / 216.63 / 180.52 / 144.51 MiB per rank at N=2, fp32
    assert "18,929,152 trainable parameters on 2 ranks" in out
    assert "| 32-true | 288.8 MiB | 216.6 MiB | 180.5 MiB | 144.4 MiB |" in out
    assert "Largest model whose model states fit in 1.0 GiB per rank" in out
    assert cli(["estimate", "--params", "1B", "-n", "0"]) == 2
    assert "--world-size must be at least 1" in capsys.readouterr().err


def test_fit_logs_one_summary_on_rank_zero(caplog):
    L.seed_everything(0)
    with caplog.at_level(logging.INFO):
        L.Trainer(strategy="zero2", accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False).fit(TinyGPT())
    lines = [r.getMessage() for r in caplog.records if "ZeRO stage" in r.getMessage()]
    psi = sum(p.numel() for p in TinyGPT().parameters())
    assert lines == [f"ZeRO stage 2 on 1 rank, precision 32-true: {psi:,} trainable parameters; model states "
                     f"{psi * 16 / 1024:.1f} KiB per rank (DDP: {psi * 16 / 1024:.1f} KiB, 100% of it)"]
