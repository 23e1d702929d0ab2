"""``strategy="zero_auto"``: the activation probe, the choice from the budget, and two launches of a small GPT at
N = 2 whose budgets are chosen around the predicted peaks (one per precision, both constructions in each)."""

from __future__ import annotations

import contextlib
import re
from dataclasses import replace

import pytest
import torch
from lightning.pytorch.cli import LightningCLI

import lightning_zero
from benchmarks._model import BenchGPT, GPTSize
from lightning_zero.config import ZeroConfig
from lightning_zero.shards.accounting import human_bytes
from lightning_zero.engine.auto.choice import HEADROOM, BudgetTooSmall, ModelFacts, choose
from lightning_zero.engine.auto.probe import LiveBytes, probe_activations
from lightning_zero.lightning.trainer.auto import ZeroAutoStrategy
from lightning_zero.testing.launch import launch
from tests.models import TinyGPT

WORLD_SIZE = 2
#: Predicted within this fraction of the measured peak.
TOLERANCE = 0.15


def test_the_probe_on_fake_tensors_counts_what_a_real_step_makes_alive():
    """Also: a gradient dies once accumulated (weights heavier than the activations: kept, they would be the peak)."""
    model = BenchGPT(GPTSize(width=64, depth=2, vocab=16, seq=8, batch=1), samples=4, meta_init=False)
    batch = next(iter(model.train_dataloader()))
    fake = probe_activations(model, batch, None, contextlib.nullcontext, torch.device("cpu"))
    handles = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in model.parameters()]
    with LiveBytes() as real:
        model.training_step(batch, 0).backward()
    for handle in handles:
        handle.remove()
    assert fake == real.peak > 0
    assert all(p.grad is None for p in model.parameters())  # the probe left the module's own tensors alone


def test_the_probe_counts_no_view_of_a_parameter():
    """A micro-batch of one short sequence (and a vocabulary of 16: no large embedding gradient) makes far fewer
    bytes alive than the weights hold: ``W.t()`` in every linear layer is a view of a parameter, not an activation."""
    model = BenchGPT(GPTSize(width=64, depth=2, vocab=16, seq=8, batch=1), samples=2, meta_init=False)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = probe_activations(model, next(iter(model.train_dataloader())), None, contextlib.nullcontext,
                             torch.device("cpu"))
    assert 0 < peak < weights / 2, (peak, weights)


def test_the_probe_runs_a_model_on_the_meta_device():
    model = BenchGPT(GPTSize(width=64, depth=2, vocab=512, seq=32, batch=2), samples=4, meta_init=True)
    with torch.device("meta"):
        model.configure_model()
    batch = next(iter(model.train_dataloader()))
    assert probe_activations(model, batch, torch.bfloat16, contextlib.nullcontext, torch.device("cpu")) > 0


FACTS = ModelFacts(num_params=10_000_000, buffer_bytes=0, root_elements=100_000, unit_elements=(1_000_000,) * 9,
                   activation_bytes=50 * 2**20, accumulates=True)


def test_the_cheapest_candidate_that_fits_is_chosen():
    config = ZeroConfig(stage=3, prefetch_size=1_000_000)
    peaks = choose(FACTS, 2, "32-true", config, 1e12, on_host=True).by_name()
    assert peaks["zero1"] > peaks["zero2"] > peaks["zero3"]
    for name in ("zero1", "zero2", "zero3"):
        chosen = choose(FACTS, 2, "32-true", config, peaks[name] * (1 + HEADROOM), on_host=True)
        assert chosen.chosen.candidate.name == name
        assert chosen.line().startswith(f"zero_auto chose {name}: predicted peak")
        # the setup summary's "model states" figure is ZeRO's table; this line's parts are named apart from it
        assert "model states" not in chosen.line() and "gradients held between steps" in chosen.line()
    # on a GPU the offloaded bytes leave the budget: zero3 with offload fits below zero3
    on_gpu = choose(FACTS, 2, "32-true", config, 1e12, on_host=False).by_name()
    below = choose(FACTS, 2, "32-true", config, on_gpu["zero3"] * (1 + HEADROOM) - 1, on_host=False)
    assert below.chosen.candidate.name == "zero3+offload_optimizer"


def test_without_accumulation_zero1_is_chosen_wherever_zero2_fits():
    """Stepping after every micro-batch, stage 1 holds the gradient shard between steps as stage 2 does (what a run
    measures: ``tests/test_memory.py``), so zero_auto never pays zero2's traffic for memory zero1 does not use; with
    accumulation stage 1 holds full gradients, and a budget between the two gives zero2."""
    config = ZeroConfig(stage=3, prefetch_size=1_000_000)
    plain = replace(FACTS, accumulates=False)
    for world_size in (2, 4, 8):
        peaks = choose(plain, world_size, "32-true", config, 1e12, on_host=True).by_name()
        grads = 4 * FACTS.num_params * (1 - 1 / world_size)  # full fp32 gradients less the shard
        accumulating = choose(FACTS, world_size, "32-true", config, 1e12, on_host=True).by_name()
        assert accumulating["zero1"] - peaks["zero1"] == pytest.approx(grads)
        assert peaks["zero1"] == pytest.approx(peaks["zero2"])
        budget = peaks["zero2"] * (1 + HEADROOM)
        assert choose(plain, world_size, "32-true", config, budget, on_host=True).chosen.candidate.name == "zero1"
        between = (accumulating["zero1"] + accumulating["zero2"]) / 2 * (1 + HEADROOM)
        assert choose(FACTS, world_size, "32-true", config, between, on_host=True).chosen.candidate.name == "zero2"


def test_a_budget_nothing_fits_names_the_smallest_that_would():
    config = ZeroConfig(stage=3)
    smallest = min(choose(FACTS, 2, "32-true", config, 1e12, on_host=True).by_name().values()) * (1 + HEADROOM)
    with pytest.raises(BudgetTooSmall, match=r"no configuration fits .* set `memory_budget` to at least "
                       + re.escape(human_bytes(smallest))):
        choose(FACTS, 2, "32-true", config, smallest - 1, on_host=True)
    choose(FACTS, 2, "32-true", config, smallest, on_host=True)


def test_the_auto_strategy_takes_a_budget_and_the_fixed_one_refuses_it():
    strategy = lightning_zero.ZeroAutoStrategy(memory_budget="20GiB")
    assert strategy._auto_budget == 20 * 2**30 and strategy.config.stage == 3  # recorded as zero3 until setup
    for wrong in ({"stage": 2, "memory_budget": "20GiB"}, {"stage": "auto"}):
        with pytest.raises(ValueError, match=r"is `ZeroAutoStrategy\(memory_budget=...\)` \(or `strategy='zero_auto'`\)"):
            lightning_zero.ZeroStrategy(**wrong)
    with pytest.raises(ValueError, match="chooses the stage itself: leave `stage` out, got 2"):
        lightning_zero.ZeroAutoStrategy(stage=2)
    with pytest.raises(ValueError, match="`offload_optimizer` is chosen by `zero_auto` itself"):
        lightning_zero.ZeroAutoStrategy(offload_optimizer=True)
    with pytest.raises(ValueError, match="not a size with a unit"):
        lightning_zero.ZeroAutoStrategy(memory_budget="20")


def test_zero_auto_in_lightning_cli_yaml(tmp_path):
    config = tmp_path / "auto.yaml"
    config.write_text("trainer:\n  accelerator: cpu\n  devices: 1\n  strategy:\n    class_path: "
                      "lightning_zero.ZeroAutoStrategy\n    init_args:\n      memory_budget: 12GiB\n")
    cli = LightningCLI(TinyGPT, args=["--config", str(config)], run=False, save_config_callback=None)
    assert isinstance(cli.trainer.strategy, ZeroAutoStrategy) and cli.trainer.strategy._auto_budget == 12 * 2**30
    short = LightningCLI(TinyGPT, args=["--trainer.strategy", "zero_auto", "--trainer.accelerator", "cpu",
                                        "--trainer.devices", "1"], run=False, save_config_callback=None)
    assert isinstance(short.trainer.strategy, ZeroAutoStrategy)


FITS = "default:init,zero2:configure,zero3:init,nothing:configure"


@pytest.fixture(scope="module", params=["32-true", "bf16-mixed"])
def auto_runs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"auto-{request.param}")
    return request.param, launch("auto.py", WORLD_SIZE, out, ("test", request.param, FITS), timeout=500)


@pytest.mark.timeout(600)
def test_each_budget_gives_its_stage_and_the_run_stays_under_it(auto_runs):
    _, ranks = auto_runs
    records = {r["spec"]: r for r in ranks[0]}
    expected = {"cold": "zero1", "default": "zero1", "zero2": "zero2", "zero3": "zero3"}
    assert {spec: records[spec].get("chosen") for spec in expected} == expected
    for rank in ranks:  # every rank chose the same
        assert [r.get("chosen") for r in rank] == [r.get("chosen") for r in ranks[0]]
    for spec in ("zero2", "zero3"):
        assert records[spec]["measured"] <= records[spec]["budget"], records[spec]


@pytest.mark.timeout(600)
def test_the_prediction_is_within_15_percent_of_the_measured_peak(auto_runs):
    precision, ranks = auto_runs
    for record in ranks[0]:
        if record["spec"] == "nothing":
            continue
        predicted = record["predictions"][record["chosen"]]
        error = (predicted - record["measured"]) / record["measured"]
        assert abs(error) <= TOLERANCE, (precision, record["spec"], record["construction"], f"{error:+.1%}")


@pytest.mark.timeout(600)
def test_a_budget_nothing_fits_stops_before_the_first_step(auto_runs):
    _, ranks = auto_runs
    for rank in ranks:
        refused = next(r for r in rank if r["spec"] == "nothing")
        assert refused["steps"] == 0
        assert "zero_auto: no configuration fits the memory budget" in refused["error"]
        assert "set `memory_budget` to at least" in refused["error"] and "\n" not in refused["error"]


def test_the_estimate_command_prints_the_same_recommendation(capsys):
    from lightning_zero.cli import main as cli

    assert cli(["estimate", "--model", "tests.models.TinyGPT", "--init-args", "{width: 256, depth: 8, meta_init: true}",
                "-n", "2", "--memory", "60MiB"]) == 0
    out = capsys.readouterr().out
    assert "- 32-true: zero_auto would choose zero3+offload_optimizer: predicted peak" in out
    assert "zero1 would need" in out and "zero3 would need" in out  # the cheaper ones, with their peaks
    assert cli(["estimate", "--params", "1B", "-n", "2", "--memory", "8MiB"]) == 0  # below the bucket buffers
    assert "32-true: zero_auto: no configuration fits the memory budget of 8.0 MiB" in capsys.readouterr().out


def test_every_rank_chooses_from_the_largest_activations_and_a_rank_without_a_batch_measures_none():
    from types import SimpleNamespace

    from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
    from torch.utils.data import DataLoader

    from lightning_zero.lightning.trainer.auto import choose_at_setup
    from lightning_zero.lightning.trainer.precision import ZeroPrecision

    model, precision, config = TinyGPT(), ZeroPrecision("32-true"), ZeroConfig(stage=3)

    def trainer(loader: DataLoader) -> SimpleNamespace:
        return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), accumulate_grad_batches=1,
                               fit_loop=SimpleNamespace(_data_source=_DataLoaderSource(loader, "train_dataloader")))

    own = choose_at_setup(trainer(model.train_dataloader()), model, precision, config, 1e12, lambda x, op: x, (2, 2))
    measured = own.choice.chosen.activations
    assert measured > 0
    asked = []

    def other_rank_measured_more(x: float, op: str) -> float:  # the ranks' maximum (activations), minimum (budget)
        asked.append((op, x))
        return max(x, 2 * measured) if op == "max" else x

    empty = choose_at_setup(trainer(DataLoader([])), model, precision, config, 1e12, other_rank_measured_more, (2, 2))
    assert ("max", 0) in asked and empty.choice.chosen.activations == 2 * measured
