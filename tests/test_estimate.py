"""The estimator prints the table in docs/stages.md (the figures the measured bytes are held to in test_measure.py)."""

from __future__ import annotations

import logging

import lightning as L
import pytest

from lightning_zero import expected_model_state_bytes
from lightning_zero.cli import main as cli
from lightning_zero.estimate import count_parameters, format_estimate, largest_model, model_state_table, parse_bytes, parse_count
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
    assert "| 32-true | 288.8 MiB (302.9 MB) | 216.6 MiB (227.1 MB) | 180.5 MiB (189.3 MB) | 144.4 MiB (151.4 MB) |" in out
    assert "Largest model whose model states fit in 1.0 GiB (1.1 GB) per rank" in out
    assert cli(["estimate", "--params", "1B", "-n", "0"]) == 2
    assert "--world-size must be at least 1" in capsys.readouterr().err


def test_the_papers_table_in_gb():
    # the paper's 7.5B model on 64 ranks in decimal GB as its Figure 1 gives them: 120 / 31.4 / 16.6 / 1.88 GB
    out = format_estimate(7_500_000_000, 64)
    assert "| bf16-mixed | 111.8 GiB (120.0 GB) | 29.2 GiB (31.4 GB) | 15.5 GiB (16.6 GB) | 1.7 GiB (1.9 GB) |" in out


@pytest.mark.parametrize(("init_args", "message"), [
    ("{width: 16", "argument --init-args: '{width: 16' is not YAML or JSON"),
    ("[16]", "argument --init-args: '[16]' is not a mapping of init arguments: write e.g. '{width: 512, depth: 12}'"),
    ("{widht: 16}", "Building tests.models.TinyGPT(**{'widht': 16}) on the meta device failed: TypeError: "),
])
def test_bad_init_args_get_a_clear_error_not_a_traceback(capsys, init_args, message):
    try:
        code = cli(["estimate", "--model", "tests.models.TinyGPT", "--init-args", init_args, "-n", "2"])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    if "widht" in init_args:  # the class's own arguments, with the one meant
        assert "TinyGPT takes (" in err and "width" in err and "did you mean `width`?" in err, err


class FineTune(L.LightningModule):
    """The README's fine-tuning pattern: a Hugging Face model built and loaded in ``configure_model``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def configure_model(self) -> None:
        import transformers

        import lightning_zero

        if getattr(self, "lm", None) is not None:
            return
        self.lm = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(self.path))
        lightning_zero.load_pretrained(self.lm, self.path)


def test_estimate_runs_the_readmes_fine_tuning_pattern_without_reading_weights(tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    expected = sum(p.numel() for p in transformers.GPT2LMHeadModel(config).parameters())
    assert cli(["estimate", "--model", f"{__name__}.FineTune", "--init-args", f"{{path: '{tmp_path / 'gpt2'}'}}",
                "-n", "2"]) == 0
    assert f"{expected:,} trainable parameters on 2 ranks" in capsys.readouterr().out
    # the names and shapes are still checked against the files: another size is refused, naming the shapes
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100,
                                                         n_positions=16)).save_pretrained(tmp_path / "other")
    (tmp_path / "other" / "config.json").write_text((tmp_path / "gpt2" / "config.json").read_text())
    assert cli(["estimate", "--model", f"{__name__}.FineTune", "--init-args", f"{{path: '{tmp_path / 'other'}'}}",
                "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert "on the meta device failed: ValueError" in err and "shape" in err and "Traceback" not in err, err


def test_fit_logs_one_summary_on_rank_zero(caplog):
    L.seed_everything(0)
    with caplog.at_level(logging.INFO):
        L.Trainer(strategy="zero2", accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False).fit(TinyGPT())
    lines = [r.getMessage() for r in caplog.records if "ZeRO stage" in r.getMessage()]
    psi = sum(p.numel() for p in TinyGPT().parameters())
    assert lines == [f"ZeRO stage 2 on 1 rank, precision 32-true: {psi:,} trainable parameters; model states "
                     f"{psi * 16 / 1024:.1f} KiB per rank (DDP: {psi * 16 / 1024:.1f} KiB, 100% of it)"]


def test_zeropp_bytes_follow_the_quantization_ratio():
    from lightning_zero.estimate import zeropp_traffic_table

    psi = 1_000_000
    table = zeropp_traffic_table(psi, block=256)
    q = psi * (1 + 4 / 256)  # int8 codes and one fp32 scale per block
    assert table["fp32"] == {"zero3": 12 * psi, "qwZ": 2 * q + 4 * psi, "qgZ": 8 * psi + q, "qwZ+qgZ": 3 * q}
    assert table["bf16/fp16"]["zero3"] == 6 * psi
    # qwZ halves (a little more than halves, for the scales) the forward all-gather of bf16 weights
    assert table["bf16/fp16"]["zero3"] / 3 / (q) == pytest.approx(2 / (1 + 4 / 256))
    assert "qwZ+qgZ" in format_estimate(psi, 8)
