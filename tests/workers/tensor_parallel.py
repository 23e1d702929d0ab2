"""One rank of the ZeRO x tensor parallelism run: 4 ranks as 2 data x 2 tensor (``tensor_parallel_size=2``).

The model is the project's GPT (``tests.models.TinyGPT``, built in ``configure_model``), whose blocks cut themselves
over ``self.device_mesh["tensor_parallel"]`` (``examples/gpt.py``: ``Block.parallelize``). References, plain PyTorch
loops on the same seed and data:
- ``ddp_tp``: the same tensor-parallel model under torch's DDP over the data-parallel
  group, clipped by the norm over both dimensions computed here from the definition;
- ``full``: the model without tensor parallelism under DDP over the data-parallel group (each tensor rank computes
  the same), clipped by ``torch.nn.utils.clip_grad_norm_``: the oracle for the tensor parallelism itself.
With the arguments ``resume <checkpoint> ...`` (2 ranks: 1 data x 2 tensor) it only resumes each checkpoint under zero2,
and the first also at 2 data x 1 tensor (the slices re-cut to whole tensors);
with ``hybrid`` it runs zero1-3 with two replicas of the data dimension (``shard_group_size`` = d / 2: 2 x 1 x 2 at
4 ranks, 2 x 2 x 2 at 8) and ``ddp_tp``.
Then the Trainer: zero1-3 with ``tensor_parallel_size=2`` (the module parallelizes its blocks over
``self.device_mesh`` in ``configure_model``), zero3 with activation checkpointing (Pa over the tensor group by
default), and checkpoints: zero3's resumed by zero1 (same mesh), consolidated to one file that a zero2 run loads
(the slices cut again), Adafactor's checkpoint refused by a run without tensor parallelism (its factored statistics
do not re-cut), ``load_from_checkpoint`` of the whole model.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from lightning_zero import (
    CheckpointError,
    Traffic,
    ZeroEngine,
    ZeroFabricStrategy,
    ZeroStrategy,
    consolidate,
    load_from_checkpoint,
    measure_model_states,
)
from lightning_zero.tensor_parallel import make_device_mesh, tensor_parallel_slice
from tests.compare import last_unit_elements
from tests.models import TinyGPT

warnings.filterwarnings("ignore")

WORLD, T = int(os.environ["WORLD_SIZE"]), 2
STEPS, MICRO, CLIP, BATCH = 3, 2, 0.05, 4
FIT = dict(gradient_clip_val=CLIP, accumulate_grad_batches=MICRO, limit_train_batches=MICRO)


class Probe(L.Callback):
    """The collective payload of every training batch, and the weights when training starts (after a restore)."""

    def __init__(self) -> None:
        self.traffic: list[dict[str, Any]] = []
        self.last = 0
        """Elements of the stage 3 unit a forward runs last (0: none)."""
        self.start: dict[str, torch.Tensor] = {}
        self.batches: list[list[torch.Tensor]] = []
        self.states: dict[str, int] = {}
        self.inside: dict[str, torch.Tensor] = {}
        self.inside_again: dict[str, torch.Tensor] = {}
        self.held: list[int] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if getattr(trainer.strategy, "runtime", None) is None:  # stage 3's parameters are not gathered here
            self.start = _weights(pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.last = last_unit_elements(trainer.strategy)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *args: Any) -> None:
        self.counters = getattr(trainer.strategy, "traffic", Traffic())  # ddp: counts nothing
        self.counters.reset()
        self.batches.append([t.clone() for t in batch])

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.traffic.append(self.counters.snapshot())
        if trainer.global_step == trainer.max_steps and not self.inside:  # the weights between steps, read whole
            held = lambda: sum(getattr(e, "gathered_bytes", 0) for e in trainer.strategy.storages)  # noqa: E731
            self.held = [held()]
            with trainer.strategy.gathered_parameters():
                self.held.append(held())
                self.inside = _weights(pl_module)
                with torch.no_grad():  # a forward inside frees nothing
                    pl_module(self.batches[-1][0])
                self.inside_again = _weights(pl_module)
            self.held.append(held())

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == 1 and not self.states:
            self.states = measure_model_states(pl_module, trainer.optimizers).as_dict()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


class AdafactorGPT(TinyGPT):
    """TinyGPT with Adafactor: whole tensors per rank and factored statistics (states that are not per element)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(self.parameters(), lr=1e-2)


def fit(stage: int, steps: int, ckpt: Optional[Path] = None, resume: Optional[Path] = None, t: int = T,
        precision: str = "32-true", model_class: type = TinyGPT, **options: Any) -> dict[str, Any]:
    """Train ``model_class`` to ``steps`` optimizer steps (from ``resume``), then save ``ckpt``."""
    L.seed_everything(0, verbose=False)
    model, probe = model_class(meta_init=True), Probe()
    # few buckets: parameters span buckets (stages 1-2), units split into several (stage 3)
    sizes = dict(persistence_threshold=0, reduce_bucket_size=1500) if stage == 3 else dict(reduce_bucket_size=700)
    strategy = ZeroStrategy(stage=stage, tensor_parallel_size=t, **sizes, **options)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=steps, callbacks=[probe],
                        precision=precision,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **FIT)
    trainer.fit(model, ckpt_path=resume)
    if ckpt is not None:
        trainer.save_checkpoint(ckpt)
    engines = trainer.strategy.storages
    activations = trainer.strategy.activations
    return {"losses": list(model.losses), "params": _weights(model), "start": probe.start, "traffic": probe.traffic,
            "batches": probe.batches, "states": probe.states, "inside": probe.inside,
            "inside_again": probe.inside_again, "held": probe.held,
            "trainable": sum(p.numel() for e in engines for p in e.params),
            "padded": sum(e.layout.total for e in engines), "shard": sum(e.layout.shard_size for e in engines),
            "last": probe.last,
            "root": sum(b.chunk_size * e.layout.world_size for e in engines for b in e.layout.buckets if b.unit == 0),
            "sampler": trainer.strategy.distributed_sampler_kwargs,
            "pa_group_is_tensor": activations is not None and activations.store.group is strategy.shard_groups.tensor,
            "pa_stats": vars(activations.store.stats).copy() if activations is not None else {}}


def _model(mesh: Any, model_class: type = TinyGPT) -> TinyGPT:
    L.seed_everything(0, verbose=False)
    model = model_class(meta_init=True)
    model._device_mesh = mesh
    model.configure_model()
    return model


def _batches(model: TinyGPT, mesh: Any, step: int, count: int = MICRO) -> list[Any]:
    """The Trainer's micro-batches of optimizer step ``step`` (one step per epoch here): a shuffled
    ``DistributedSampler`` over the data dimension, seed 0."""
    dataset = model.train_dataloader().dataset
    sampler = DistributedSampler(dataset, num_replicas=WORLD // T, rank=mesh["data_parallel"].get_local_rank(),
                                 shuffle=True, seed=0)
    sampler.set_epoch(step)
    return list(DataLoader(dataset, batch_size=BATCH, sampler=sampler))[:count]


def reference(tensor_parallel: bool, steps: int, last: Optional[list[Any]] = None,
              model_class: type = TinyGPT) -> dict[str, Any]:
    """A plain loop: DDP over the data-parallel group, AdamW, accumulation and clipping as the Trainer's; ``last``:
    the micro-batches of the last step (those a resumed run took: Lightning resumes mid-epoch)."""
    mesh = make_device_mesh(T)
    model = _model(mesh if tensor_parallel else None, model_class)
    ddp = DistributedDataParallel(model, process_group=mesh.get_group("data_parallel"))
    optimizer = model.configure_optimizers()
    losses = []
    for step in range(steps):
        batches = last if last is not None and step == steps - 1 else _batches(model, mesh, step)
        for i, (x, y) in enumerate(batches):
            with (ddp.no_sync() if i < len(batches) - 1 else torch.enable_grad()):
                loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
                (loss / MICRO).backward()
            losses.append(loss.item())
        params = [p for p in model.parameters() if p.grad is not None]
        if tensor_parallel:  # the definition: every element of the full model once
            sliced = sum(p.grad.pow(2).sum() for p in params if tensor_parallel_slice(p) is not None)
            replicated = sum(p.grad.pow(2).sum() for p in params if tensor_parallel_slice(p) is None)
            dist.all_reduce(sliced, group=mesh.get_group("tensor_parallel"))
            norm = (sliced + replicated).sqrt()
            for p in params:
                p.grad.mul_(torch.clamp(CLIP / (norm + 1e-6), max=1.0))
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": _weights(model), "norm": float(norm)}


def engine_run(stage: int) -> dict[str, Any]:
    """The plain loop of ``ZeroEngine``: the mesh first (``make_device_mesh``), the model over it, then the engine
    with the same ``tensor_parallel_size`` (it finds the same mesh)."""
    mesh = make_device_mesh(T)
    model = _model(mesh)
    optimizer = model.configure_optimizers()
    engine = ZeroEngine(model, [optimizer], stage=stage, tensor_parallel_size=T)
    losses = []
    for step in range(STEPS):
        for x, y in _batches(model, mesh, step):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            engine.backward(loss / MICRO)
            losses.append(loss.item())
        engine.step(clip_grad_norm=CLIP)
    engine.teardown()
    return {"losses": losses, "params": _weights(model), "same_mesh": engine.shard_groups.mesh is mesh}


def fabric_run(stage: int) -> dict[str, Any]:
    """Fabric: ``fabric.strategy.device_mesh`` for the model, ``setup_dataloaders`` samples over the data
    dimension, ``clip_gradients`` takes the norm over both dimensions."""
    fabric = L.Fabric(strategy=ZeroFabricStrategy(stage=stage, tensor_parallel_size=T), accelerator="cpu",
                      devices=WORLD)
    fabric.launch()
    mesh = fabric.strategy.device_mesh
    L.seed_everything(0, verbose=False)
    model = TinyGPT(meta_init=True)
    model._device_mesh = mesh
    with fabric.init_module():
        model.configure_model()
    model, optimizer = fabric.setup(model, model.configure_optimizers())
    loader = fabric.setup_dataloaders(DataLoader(model.train_dataloader().dataset, batch_size=BATCH, shuffle=True))
    losses = []
    for step in range(STEPS):
        loader.sampler.set_epoch(step)
        for i, (x, y) in zip(range(MICRO), loader):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            fabric.backward(loss / MICRO)
            losses.append(loss.item())
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
    fabric.strategy.teardown()
    return {"losses": losses, "params": _weights(model.module)}


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    if sys.argv[2:3] == ["resume"]:  # another data-parallel size: resume zero3 checkpoints with zero2
        runs = [fit(2, STEPS + 1, resume=Path(path)) for path in sys.argv[3:]]
        runs.append(fit(2, STEPS + 1, resume=Path(sys.argv[3]), t=1))  # and another tensor-parallel size (2 x 1)
        torch.save(runs, out / f"rank{rank}.pt")
        return
    if sys.argv[2:3] == ["hybrid"]:  # 2 replicas x (d / 2) shard x 2 tensor
        k = WORLD // T // 2
        hybrid = {f"zero{stage}": fit(stage, STEPS, out / f"hybrid{stage}.ckpt", shard_group_size=k)
                  for stage in (1, 2, 3)}
        hybrid["ddp_tp"] = reference(True, STEPS)
        hybrid["ckpt_dir"] = str(out)
        torch.save(hybrid, out / f"rank{rank}.pt")
        return
    runs: dict[str, Any] = {}
    for stage in (1, 2, 3):
        runs[f"zero{stage}"] = fit(stage, STEPS, out / f"zero{stage}.ckpt")
    runs["ddp_tp"] = reference(True, STEPS)
    runs["full"] = reference(False, STEPS)
    runs["engine2"] = engine_run(2)
    runs["fabric3"] = fabric_run(3)
    runs["zero3_pa"] = fit(3, STEPS, activation_checkpointing=True)
    runs["zero3_offload"] = fit(3, STEPS, offload_optimizer=True, offload_params=True)
    runs["zero2_bf16"] = fit(2, STEPS, precision="bf16-mixed")
    runs["zero1_resumed"] = fit(1, STEPS + 1, resume=out / "zero3.ckpt")
    runs["ddp_tp_resumed"] = reference(True, STEPS + 1, last=runs["zero1_resumed"]["batches"])
    runs.update(adafactor_runs(out, rank))
    if rank == 0:
        consolidate(out / "zero3.ckpt", out / "zero3_full.ckpt")
        runs["inference"] = _weights(load_from_checkpoint(TinyGPT, out / "zero3.ckpt"))
    dist.barrier()
    runs["zero2_from_file"] = fit(2, STEPS + 1, resume=out / "zero3_full.ckpt")
    try:  # Adafactor's factored statistics of the slices do not re-cut to t = 1 (universal checkpoints refuse them)
        fit(2, STEPS + 1, resume=out / "adafactor.ckpt", t=1, model_class=AdafactorGPT)
        runs["mismatch"] = ""
    except Exception as error:  # noqa: BLE001 - the test reads the message
        runs["mismatch"] = f"{type(error).__name__}: {error}"
    runs["dtensor"] = dtensor_error()
    runs["unsliced_warning"] = unsliced_warning()
    runs["parallelize"] = parallelize_plan()
    runs["ckpt_dir"] = str(out)
    torch.save(runs, out / f"rank{rank}.pt")


def adafactor_runs(out: Path, rank: int) -> dict[str, Any]:
    """zero2 with Adafactor: saved, resumed (its factored statistics are stacked per tensor rank), against DDP with
    the same tensor parallelism; the consolidation of its optimizer state refused, of its weights done."""
    runs = {"adafactor": fit(2, STEPS, out / "adafactor.ckpt", model_class=AdafactorGPT)}
    runs["adafactor_resumed"] = fit(2, STEPS + 1, resume=out / "adafactor.ckpt", model_class=AdafactorGPT)
    runs["adafactor_ddp_tp"] = reference(True, STEPS + 1, last=runs["adafactor_resumed"]["batches"],
                                         model_class=AdafactorGPT)
    if rank == 0:
        try:
            consolidate(out / "adafactor.ckpt", out / "adafactor_full.ckpt")
            runs["adafactor_consolidate"] = ""
        except CheckpointError as error:
            runs["adafactor_consolidate"] = str(error)
        consolidate(out / "adafactor.ckpt", out / "adafactor_weights.ckpt", weights_only=True)
    return runs


def parallelize_plan() -> dict[str, Any]:
    """``parallelize`` with a plan of torch's styles, against the layers cut by hand and the whole MLP."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_zero.tensor_parallel import ColumnParallelLinear, RowParallelLinear, parallelize

    mesh = make_device_mesh(T)
    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    group = mesh.get_group("tensor_parallel")
    by_hand = [ColumnParallelLinear.from_linear(whole[0], group), RowParallelLinear.from_linear(whole[2], group)]
    cut = parallelize(copy.deepcopy(whole), mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    return {"types": [type(cut[0]).__name__, type(cut[2]).__name__],
            "same_as_by_hand": all(torch.equal(a, b) for layer, hand in zip((cut[0], cut[2]), by_hand)
                                   for a, b in zip(layer.parameters(), hand.parameters())),
            "output": float((cut(x) - whole(x)).abs().max() / whole(x).abs().max())}


def unsliced_warning() -> str:
    """What ZeRO says when ``tensor_parallel_size`` is set but the module cut nothing (rank 0 only)."""
    model = TinyGPT()  # built whole in __init__; no mesh is handed to it here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = ZeroEngine(model, [model.configure_optimizers()], stage=1, tensor_parallel_size=T)
    engine.teardown()
    return " ".join(str(w.message) for w in caught if "no parameter" in str(w.message))


def dtensor_error() -> str:
    """What ZeRO says to a module parallelized with DTensors (``parallelize_module``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = make_device_mesh(T)
    layer = parallelize_module(torch.nn.Linear(8, 8), mesh["tensor_parallel"], ColwiseParallel())
    try:
        ZeroEngine(layer, [torch.optim.SGD(layer.parameters(), lr=0.1)], stage=2, tensor_parallel_size=T)
    except TypeError as error:
        return str(error)
    return ""


if __name__ == "__main__":
    main()
