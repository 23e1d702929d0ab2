"""A checkpoint a plain loop writes with ``ZeroEngine`` resumes under the Trainer: weights, optimizer states and
the step counter (see [Note: a plain loop's step] in ``lightning_zero/lightning/trainer/strategy.py``).

One process (world size 1): the engine trains 3 steps on the first batches and saves as ``examples/engine_gpt.py``
does; the Trainer resumes it for 2 more steps, which it takes on the first 2 batches of its epoch; the engine's own
2 further steps on those batches are the reference.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_zero import ZeroEngine
from lightning_zero.engine import state as engine_state
from tests.compare import assert_losses_close, assert_params_close
from tests.models import TinyLM

SAVED_STEPS, MORE_STEPS = 3, 2


def _engine_steps(engine: ZeroEngine, model: TinyLM, steps: int) -> None:
    """``steps`` steps on the first batches of epoch 0 in the order the Trainer's ``DistributedSampler`` gives."""
    dataset = model.train_dataloader().dataset
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=model.hparams.batch_size, sampler=sampler)
    for index, batch in zip(range(steps), loader):
        engine.backward(model.training_step(batch, index))
        engine.step()


def _engine_run(stage: int, path: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train, save at ``SAVED_STEPS`` as the example does, train ``MORE_STEPS`` more; the final full weights and the
    losses after the save."""
    L.seed_everything(0)
    model = TinyLM(scheduler=False)
    optimizer = model.configure_optimizers()
    engine = ZeroEngine(model, [optimizer], stage=stage, device=torch.device("cpu"))
    _engine_steps(engine, model, SAVED_STEPS)
    checkpoint = {"state_dict": engine_state.model_state(engine),
                  "optimizer_states": [engine_state.optimizer_state(engine, optimizer)],
                  "global_step": SAVED_STEPS, "hyper_parameters": dict(model.hparams)}
    engine_state.save(engine, checkpoint, path, writer="engine")
    _engine_steps(engine, model, MORE_STEPS)
    engine.teardown()  # the full weights back in the module
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, model.losses[SAVED_STEPS:]


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_checkpoint_resumes_under_the_trainer(stage, tmp_path):
    path = tmp_path / "engine.ckpt"
    expected, losses = _engine_run(stage, path)
    trainer = L.Trainer(strategy=f"zero{stage}", accelerator="cpu", devices=1, max_steps=SAVED_STEPS + MORE_STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    model = TinyLM(scheduler=False)
    trainer.fit(model, ckpt_path=path)
    assert trainer.global_step == SAVED_STEPS + MORE_STEPS
    assert_losses_close(model.losses, losses, 1e-6)  # it went on from the saved step, not from 0
    trainer.strategy.teardown()
    assert_params_close(dict(model.state_dict()), expected, 1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_engine_resumes_its_own_checkpoint_with_its_methods(stage, tmp_path):
    # `checkpoint_entries` + `save_checkpoint`, then `load_checkpoint` into a fresh engine: the same further steps
    path = tmp_path / "engine.ckpt"
    L.seed_everything(0)
    model = TinyLM(scheduler=False)
    engine = ZeroEngine(model, [model.configure_optimizers()], stage=stage, device=torch.device("cpu"))
    _engine_steps(engine, model, SAVED_STEPS)
    engine.save_checkpoint({**engine.checkpoint_entries(), "global_step": SAVED_STEPS}, path)
    _engine_steps(engine, model, MORE_STEPS)
    engine.teardown()
    resumed = TinyLM(scheduler=False)
    again = ZeroEngine(resumed, [resumed.configure_optimizers()], stage=stage, device=torch.device("cpu"))
    assert again.load_checkpoint(path) == {"global_step": SAVED_STEPS}
    _engine_steps(again, resumed, MORE_STEPS)
    again.teardown()
    assert_losses_close(resumed.losses, model.losses[SAVED_STEPS:], 1e-6)
    assert_params_close(dict(resumed.state_dict()), dict(model.state_dict()), 1e-6)
