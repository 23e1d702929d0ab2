"""Lightning's ``grad_norm`` in ``on_before_optimizer_step`` gives ``ddp``'s values under every stage (see
[Note: grad_norm reads the gradient shards] in ``lightning_zero/lightning/trainer/grad_norm.py``), for the whole module and for
a submodule, whatever the order of the imports. One process (world size 1) against ``ddp`` on one process: the same
sampler, seed and arithmetic.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities import grad_norm  # imported before any use of lightning_zero's, as users do

import lightning_zero  # noqa: F401  (registers the strategies)
from tests.models import TinyLM


class LogsGradNorms(TinyLM):
    """Records ``grad_norm`` of the whole module and of one block before each optimizer step."""

    def __init__(self) -> None:
        super().__init__(scheduler=False)
        self.recorded: list[dict[str, float]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norms = {**grad_norm(self, norm_type=2), **grad_norm(self.blocks[1], 1, group_separator=":")}
        self.recorded.append({k: float(v) for k, v in norms.items()})


def _norms(strategy: str) -> list[dict[str, float]]:
    L.seed_everything(0)
    model = LogsGradNorms()
    L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(model)
    return model.recorded


@pytest.fixture(scope="module")
def ddp() -> list[dict[str, float]]:
    return _norms("ddp")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_grad_norm_in_on_before_optimizer_step_gives_ddps_values(ddp, stage):
    zero = _norms(f"zero{stage}")
    assert len(zero) == len(ddp) == 2
    assert "grad_2.0_norm/blocks.0.1.weight" in ddp[0] and "grad_1.0_norm:0.weight" in ddp[0]
    for step_zero, step_ddp in zip(zero, ddp):
        assert step_zero.keys() == step_ddp.keys()
        for key, value in step_ddp.items():
            assert step_zero[key] == pytest.approx(value, rel=1e-5), key
