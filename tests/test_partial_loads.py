"""A load under ``strict=False`` that matches nothing is refused, one that matches under half of the model warns, and
both name the key prefix that would match (see [Note: a non-strict load says what it skipped] in
``lightning_zero/checkpoints/key_match.py``), on every sharded load path: the Trainer's resume,
``load_from_checkpoint``, the engine's load and Fabric's. One process (world size 1), a tiny model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import lightning as L
import pytest
import torch
from torch import nn

import lightning_zero
from lightning_zero import CheckpointError, ZeroEngine
from lightning_zero.checkpoints.key_match import PartialLoadWarning, prefix_hint
from lightning_zero.engine import state as engine_state
from tests.models import TinyGPT

STRIP = r"strip 'model\.' from the checkpoint's keys"


class Wrapped(L.LightningModule):
    """A TinyGPT held as ``self.model``: its checkpoint's keys are ``model.<TinyGPT key>``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model.training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        return self.model.train_dataloader()


class Larger(TinyGPT):
    """A TinyGPT with more new parameters than it has of its own: a TinyGPT checkpoint fills under half of it."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.ParameterList(nn.Parameter(torch.ones(2)) for _ in range(40))


def _trainer(**kwargs: Any) -> L.Trainer:
    defaults = dict(strategy="zero3", accelerator="cpu", devices=1, max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(**{**defaults, **kwargs})


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Sharded checkpoints of a Wrapped TinyGPT (``model.*`` keys) and of a plain TinyGPT."""
    out = tmp_path_factory.mktemp("partial")
    paths = {}
    for name, model in (("wrapped", Wrapped()), ("plain", TinyGPT())):
        trainer = _trainer()
        trainer.fit(model)
        trainer.save_checkpoint(out / f"{name}.ckpt")
        paths[name] = out / f"{name}.ckpt"
    return paths


def test_the_prefix_that_would_match_is_found():
    model = ["lm.wte.weight", "lm.head.weight", "lm.head.bias"]
    assert prefix_hint([f"model.{k}" for k in model], model).startswith("strip 'model.'")
    assert prefix_hint(model, [f"model.{k}" for k in model]).startswith("add 'model.'")
    assert prefix_hint(["a.weight"], ["b.weight"]) is None
    part = [f"model.{k}" for k in model[:2]]  # a checkpoint of a part of the model: its prefix explains it
    assert prefix_hint(part, model).startswith("strip 'model.'")


def test_no_prefix_is_advised_for_another_model_that_shares_a_few_names():
    gpt = ["wte.weight", "blocks.0.qkv.weight", "blocks.0.proj.weight", "ln_f.weight", "lm_head.weight"]
    llama = ["lm.model.embed_tokens.weight", "lm.model.layers.0.self_attn.q_proj.weight", "lm.model.norm.weight"]
    llama += ["lm.model.layers.0.mlp.up_proj.weight", "lm.lm_head.weight"]
    assert prefix_hint(gpt, llama) is None  # `lm.` would match `lm_head.weight` alone
    assert prefix_hint(llama, gpt) is None


def _trainer_resume(path: Path) -> None:
    model = TinyGPT()
    model.strict_loading = False
    _trainer(max_steps=2).fit(model, ckpt_path=path)


def _engine_load(path: Path) -> None:
    model = TinyGPT()
    engine = ZeroEngine(model, [model.configure_optimizers()], stage=3, device=torch.device("cpu"))
    engine_state.load_model(engine, engine_state.read(path), strict=False)


def _fabric_load(path: Path) -> None:
    fabric = L.Fabric(strategy="zero3", accelerator="cpu", devices=1)
    fabric.launch()
    model = fabric.setup_module(TinyGPT())
    fabric.load(path, {"model": model}, strict=False)


LOADS: dict[str, Callable[[Path], Any]] = {
    "Trainer resume": _trainer_resume,
    "load_from_checkpoint": lambda p: lightning_zero.load_from_checkpoint(TinyGPT, p, strict=False),
    "engine load": _engine_load,
    "Fabric load": _fabric_load,
}


@pytest.mark.parametrize("load", LOADS)
def test_a_non_strict_load_that_matches_nothing_is_refused_with_the_prefix(saved, load):
    with pytest.raises(CheckpointError, match=rf"fills 0 of this model's \d+ keys under `strict=False`; nothing was "
                                              rf"loaded\. To load it, {STRIP}"):
        LOADS[load](saved["wrapped"])


def test_the_strict_error_names_the_prefix_instead_of_strict_false(saved):
    with pytest.raises(CheckpointError, match=STRIP) as raised:
        lightning_zero.load_from_checkpoint(TinyGPT, saved["wrapped"])
    assert "strict=False" not in str(raised.value) and "\n" not in str(raised.value)


def test_a_non_strict_load_of_under_half_the_model_warns(saved):
    with pytest.warns(PartialLoadWarning, match=r"fills \d+ of this model's \d+ keys under `strict=False`; the rest "
                                                r"keep their initial values\. To load it, check that it is a "
                                                r"checkpoint of this model"):
        model = lightning_zero.load_from_checkpoint(Larger, saved["plain"], strict=False)
    reference = lightning_zero.load_from_checkpoint(TinyGPT, saved["plain"])
    assert torch.equal(model.wte.weight, reference.wte.weight)
