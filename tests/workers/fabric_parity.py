"""One rank of the Fabric and plain-loop parity suite: the same models, seed and data as the Trainer's parity suite,
trained by a Fabric loop under ``ddp`` (the oracle), ``zero1/2/3``, and by a plain PyTorch loop over
:class:`~lightning_zero.ZeroEngine` (``engine1/2/3``). Each run accumulates two micro-batches per step (under
``fabric.no_backward_sync``), clips by norm and steps a per-step LR schedule. Also writes the checkpoints of the
cross-API round trip (see tests/test_fabric.py). Saves losses, final weights and learning rates per run.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy

import lightning_zero
from lightning_zero import ZeroEngine, ZeroFabricStrategy, ZeroStrategy, load_full_checkpoint, sharded_construction
from tests.models import TinyGPT, TinyLM
from tests.workers.parity import bucket_size

warnings.filterwarnings("ignore")

STEPS = 3  # optimizer steps of two micro-batches each
CLIP = 0.05


def zero_options(stage: int, model: torch.nn.Module) -> dict[str, Any]:
    """The options the Trainer's parity suite uses (about 12 buckets; small real stage 3 units)."""
    if stage == 3:
        return {"persistence_threshold": 0, "reduce_bucket_size": 1500}
    return {"reduce_bucket_size": bucket_size(model)}


def make_model(scenario: str, runner: str) -> L.LightningModule:
    """The scenario's model, seeded; zero3 runners build the GPT sharded (``init_module`` / recorded)."""
    L.seed_everything(0, verbose=False)
    if scenario == "adafactor":
        return TinyLM(optimizer="adafactor")
    if scenario in ("adamw", "adamw_separate"):
        return TinyLM(frozen=True)
    if scenario == "bf16_mixed":
        return TinyLM(scheduler=False, lr=1e-2)  # as test_parity.py's bf16 scenario (tests/compare.py's bound)
    return TinyGPT(meta_init=True)  # built in configure_model below (sharded under zero3)


def optimizers_of(model: L.LightningModule) -> tuple[torch.optim.Optimizer, Any]:
    config = model.configure_optimizers()
    if isinstance(config, dict):
        return config["optimizer"], config["lr_scheduler"]["scheduler"]
    return config, None


def precision_of(scenario: str) -> str:
    return "bf16-mixed" if scenario == "bf16_mixed" else "32-true"


def result(model: L.LightningModule, optimizer: Any) -> dict:
    return {"losses": list(model.losses),
            "params": {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()},
            "lr": [g["lr"] for g in optimizer.param_groups]}


def batches(model: L.LightningModule, rank: int, world_size: int) -> list[Any]:
    """This rank's micro-batches, as a DistributedSampler without shuffling deals them (the Trainer's split)."""
    data = model.train_dataloader().dataset
    size = model.train_dataloader().batch_size
    mine = list(range(rank, len(data), world_size))
    return [data[mine[i : i + size]] for i in range(0, 2 * STEPS * size, size)]


# ---------------------------------------------------------------------- Fabric
def fabric_run(scenario: str, runner: str, world_size: int) -> dict:
    if runner == "ddp":
        strategy: Any = DDPStrategy(find_unused_parameters=True)
    else:
        stage = int(runner[-1])
        with torch.device("meta"):
            options = zero_options(stage, make_model(scenario, runner) if scenario != "gpt" else TinyGPT())
        strategy = ZeroFabricStrategy(stage=stage, **options)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision=precision_of(scenario))
    fabric.launch()
    with fabric.init_module():
        model = make_model(scenario, runner)
        model.configure_model()
    if scenario == "adamw_separate":  # FSDP's order: the model first, then optimizers over its parameters
        model = fabric.setup_module(model)
        optimizer, scheduler = optimizers_of(model.module)
        optimizer = fabric.setup_optimizers(optimizer)
    else:
        optimizer, scheduler = optimizers_of(model)
        model, optimizer = fabric.setup(model, optimizer)
    for step in range(STEPS):
        for micro, batch in enumerate(batches(model.module, fabric.global_rank, world_size)[2 * step : 2 * step + 2]):
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = model.training_step(fabric.to_device(batch), 2 * step + micro)
                fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    if runner != "ddp":
        fabric.strategy.teardown()  # full fp32 weights back in the module (a collective), as after the Trainer's fit
    return result(model.module, optimizer)


# ---------------------------------------------------------------------- the plain loop
def engine_run(scenario: str, runner: str, world_size: int) -> dict:
    stage = int(runner[-1])
    if not torch.distributed.is_initialized():  # a plain loop sets up torch.distributed itself (torchrun's env)
        torch.distributed.init_process_group("gloo")
    with torch.device("meta"):
        options = zero_options(stage, make_model(scenario, runner) if scenario != "gpt" else TinyGPT())
    recording = None
    if stage == 3:
        with sharded_construction(torch.device("cpu")) as recording:
            model = make_model(scenario, runner)
            model.configure_model()
    else:
        model = make_model(scenario, runner)
        model.configure_model()
    optimizer, scheduler = optimizers_of(model)
    engine = ZeroEngine(model, [optimizer], stage=stage, precision=precision_of(scenario), recording=recording,
                        **options)
    rank = torch.distributed.get_rank()
    for step in range(STEPS):
        for micro, batch in enumerate(batches(model, rank, world_size)[2 * step : 2 * step + 2]):
            with engine.forward_context():
                loss = model.training_step(batch, 2 * step + micro)
            engine.backward(loss)
        engine.step(clip_grad_norm=CLIP)  # reduce, clip, step, gather, zero_grad
        if scheduler is not None:
            scheduler.step()
    engine.teardown()
    return result(model, optimizer)


# ---------------------------------------------------------------------- checkpoints across APIs
def fabric_saves(out: Path, world_size: int) -> None:
    """Fabric under zero2 trains 2 steps and saves ``fabric-ws<N>``."""
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(stage=2, reduce_bucket_size=500))
    fabric.launch()
    model = make_model("adamw", "zero2")
    optimizer, _ = optimizers_of(model)
    model, optimizer = fabric.setup(model, optimizer)
    for step in range(2):
        for batch in batches(model.module, fabric.global_rank, world_size)[2 * step : 2 * step + 2]:
            fabric.backward(model.training_step(fabric.to_device(batch), 0))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(out / f"fabric-ws{world_size}", {"model": model, "optimizer": optimizer, "step": 2})


class _SaveOnTrainStart(L.Callback):
    """Saves the state the Trainer restored, before it trains."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def trainer_saves(out: Path, world_size: int) -> None:
    """The Trainer under zero3 trains 2 steps and saves ``trainer-ws<N>``."""
    model = make_model("adamw", "zero3")
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, persistence_threshold=0, reduce_bucket_size=700),
                        accelerator="cpu", devices=world_size, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    trainer.save_checkpoint(out / f"trainer-ws{world_size}")


def trainer_resumes_fabric(out: Path, saved_at: int, world_size: int) -> None:
    """The Trainer (zero3) resumes Fabric's checkpoint and writes what it restored to ``trainer-from-fabric``."""
    model = make_model("adamw", "zero3")
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, persistence_threshold=0, reduce_bucket_size=700),
                        accelerator="cpu", devices=world_size, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[_SaveOnTrainStart(out / "trainer-from-fabric")])
    trainer.fit(model, ckpt_path=out / f"fabric-ws{saved_at}")


def fabric_resumes_trainer(out: Path, saved_at: int, world_size: int) -> dict:
    """Fabric (zero1) loads the Trainer's checkpoint and saves what it restored to ``fabric-from-trainer``."""
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(stage=1))
    fabric.launch()
    model = make_model("adamw", "zero1")
    optimizer, _ = optimizers_of(model)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer}
    remainder = fabric.load(out / f"trainer-ws{saved_at}", state)
    fabric.save(out / "fabric-from-trainer", {"model": model, "optimizer": optimizer})
    return {"global_step": remainder.get("global_step"), "keys": sorted(remainder)}


def fabric_loads_raw(out: Path, saved_at: int, world_size: int) -> None:
    """``fabric.load_raw``: a plain state dict file (the Trainer's weights) into a fresh zero3 model, saved again."""
    raw = out / "raw_model.pt"
    if torch.distributed.get_rank() == 0:
        torch.save(load_full_checkpoint(out / f"trainer-ws{saved_at}", weights_only=True)["state_dict"], raw)
    torch.distributed.barrier()
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(stage=3))
    fabric.launch()
    L.seed_everything(1, verbose=False)  # other initial weights than the file's
    model = fabric.setup_module(TinyLM(frozen=True))
    fabric.load_raw(raw, model)
    fabric.save(out / "fabric-raw", {"model": model})


def fabric_plain_round_trip(out: Path, world_size: int) -> None:
    """A model saved before ``fabric.setup`` (a plain file, as ``ddp`` writes it), loaded into a set-up zero3 model
    and saved sharded, then loaded from that directory into a model never set up, whose weights are written out."""
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(stage=3))
    fabric.launch()
    L.seed_everything(2, verbose=False)
    fabric.save(out / "plain-before.pt", {"model": TinyLM(frozen=True), "step": 3})
    L.seed_everything(3, verbose=False)  # other initial weights than the file's
    model = fabric.setup_module(TinyLM(frozen=True))
    state: dict[str, Any] = {"model": model, "step": 0}
    fabric.load(out / "plain-before.pt", state)
    assert state["step"] == 3, state["step"]
    fabric.save(out / "plain-loaded", {"model": model})
    L.seed_everything(4, verbose=False)
    fresh = TinyLM(frozen=True)
    fabric.load(out / "plain-loaded", {"model": fresh})
    if torch.distributed.get_rank() == 0:
        torch.save(fresh.state_dict(), out / "plain-reloaded.pt")
    fabric.barrier()


RUNNERS: dict[str, Callable[[str, str, int], dict]] = {
    "ddp": fabric_run, "zero1": fabric_run, "zero2": fabric_run, "zero3": fabric_run,
    "engine1": engine_run, "engine2": engine_run, "engine3": engine_run,
}


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2].split(",")
    runners = sys.argv[3].split(",")
    world_size = int(__import__("os").environ["WORLD_SIZE"])
    results: dict[str, Any] = {}
    for name in names:
        for runner in runners:
            if name == "adamw_separate" and runner.startswith("engine"):
                continue  # a Fabric call order; the plain loop has one way in
            results.setdefault(name, {})[runner] = RUNNERS[runner](name, runner, world_size)
    if world_size == 2:
        fabric_saves(out, world_size)
        trainer_saves(out, world_size)
    else:  # each API resumes the other's checkpoint, written at world size 2
        trainer_resumes_fabric(out, 2, world_size)
        results["fabric_from_trainer"] = fabric_resumes_trainer(out, 2, world_size)
        fabric_loads_raw(out, 2, world_size)
        fabric_plain_round_trip(out, world_size)
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    assert lightning_zero.__version__
    main()
