"""One rank of the universal-checkpoint chain (issue 25 part 3): one launch of 4 ranks, four runs, each resuming the
sharded checkpoint of the one before at another (data x tensor) shape:

    A  2 x 2  zero2, from the seed            -> a.ckpt
    B  4 x 1  zero3, resumes a.ckpt (t 2 -> 1) -> b.ckpt
    C  1 x 2  zero1, resumes b.ckpt (t 1 -> 2) -> c.ckpt   (ranks 0-1 in a process group of their own; 2-3 wait)
    D  2 x 2  zero3, resumes c.ckpt (same t, another data-parallel size)

Each run is a plain ``ZeroEngine`` loop on the project's GPT (``tests.models.TinyGPT``, cut over the mesh's tensor
dimension in ``configure_model``), compared with DDP's own resume of the same run: the model without tensor
parallelism under DDP over the run's data-parallel ranks, resumed from DDP's ``state_dict`` files of the run before,
on the same batches. Right after each load the engine's master pieces and Adam's moments are compared bit for bit
with the consolidated checkpoint (``load_full_checkpoint``, which joins the slices by another path), cut for this
run. Two refusals and one partial load of an Adafactor checkpoint written at 2 x 2, in run B's shape (t = 1).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from lightning_zero import CheckpointError, ZeroEngine
from lightning_zero.checkpoints.consolidate import load_full_checkpoint
from lightning_zero.checkpoints.shards import model_shards, optimizer_shards, stack_slices, Shard
from lightning_zero.engine import state as engine_state
from lightning_zero.tensor_parallel import cut, make_device_mesh, tensor_parallel_slice
from tests.compare import relative
from tests.models import TinyGPT
from examples.tiny_gpt import token_data

warnings.filterwarnings("ignore")

STEPS, GLOBAL_BATCH = 2, 8
DATA = token_data(n=GLOBAL_BATCH * STEPS * 4)


class AdafactorGPT(TinyGPT):
    """TinyGPT with Adafactor: factored statistics of its sliced weights, which do not re-cut."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(self.parameters(), lr=1e-2)


def _model(t: int, model_class: type = TinyGPT) -> TinyGPT:
    """The seed's model, cut over a (data x tensor) mesh of tensor size ``t`` (whole for ``t = 1``)."""
    mesh = make_device_mesh(t) if t > 1 else None
    torch.manual_seed(0)
    model = model_class(meta_init=True)
    model._device_mesh = mesh
    model.configure_model()
    return model


def _batch(step: int, data_rank: int, data_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global optimizer step ``step``'s rows of this data-parallel rank: the global batch is the same at any shape."""
    per = GLOBAL_BATCH // data_size
    rows = slice(step * GLOBAL_BATCH + data_rank * per, step * GLOBAL_BATCH + (data_rank + 1) * per)
    return DATA.tensors[0][rows], DATA.tensors[1][rows]


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _slice_of(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's slice of ``whole`` for ``param`` (itself for a replicated parameter)."""
    where = tensor_parallel_slice(param)
    return whole if where is None else cut(whole, where.size, where.dim, where.parts)[where.rank]


def zero_run(name: str, t: int, stage: int, first_step: int, resume: Optional[Path], out: Path) -> dict[str, Any]:
    """Train ``STEPS`` steps at tensor size ``t`` (from ``resume``), save ``out/<name>.ckpt``."""
    data_size = dist.get_world_size() // t
    data_rank = dist.get_rank() // t
    model = _model(t)
    optimizer = model.configure_optimizers()
    engine = ZeroEngine(model, [optimizer], stage=stage, tensor_parallel_size=t)
    result: dict[str, Any] = {"shape": (data_size, t)}
    if resume is not None:
        checkpoint = engine_state.read(resume)
        engine_state.load_model(engine, checkpoint)
        engine_state.load_optimizers(engine, checkpoint)
        result["not_exact"] = _not_exact(engine, optimizer, resume)
    losses = []
    for step in range(first_step, first_step + STEPS):
        with engine.forward_context():
            loss = _loss(model, _batch(step, data_rank, data_size))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine_state.save(engine, engine_state.states_entries(engine, [optimizer]), out / f"{name}.ckpt", "engine")
    with engine.gathered_parameters():
        result["params"] = _weights(model)
    result["marks"] = {n: tensor_parallel_slice(p) for n, p in model.named_parameters()}
    engine.teardown()
    result["losses"] = losses
    return result


def _not_exact(engine: ZeroEngine, optimizer: torch.optim.Optimizer, path: Path) -> list[str]:
    """What this rank loaded that differs (bitwise) from the consolidated checkpoint cut for this run: every master
    piece and every piece of Adam's per-element states, and the step counts."""
    full = load_full_checkpoint(path, verify=False)
    wrong = []
    for key, shard in model_shards(engine.module, engine.store.storages, full_copies=True).items():
        wrong += [f"model/{key}" for start, piece in shard.pieces
                  if not _piece_equal(stack_slices(full["state_dict"][key], shard), start, piece)]
    saved = full["optimizer_states"][0]["state"]
    for canon, entry in optimizer_shards(engine.sharded(optimizer)).items():
        for key, value in entry.items():
            expected = saved[canon][key]
            if isinstance(value, Shard) and value.pieces and value.pieces[0][1].dim() == 1 and expected.dim() > 0:
                wrong += [f"optimizer/{canon}/{key}" for start, piece in value.pieces
                          if not _piece_equal(stack_slices(expected, value), start, piece)]
            elif isinstance(value, Shard):
                wrong += [] if torch.equal(value.pieces[0][1].reshape(expected.shape), expected) else [f"{canon}/{key}"]
    return wrong


def _piece_equal(stacked: torch.Tensor, start: int, piece: torch.Tensor) -> bool:
    return torch.equal(stacked.reshape(-1)[start : start + piece.numel()], piece)


def ddp_run(name: str, t: int, first_step: int, resume: Optional[Path], out: Path) -> dict[str, Any]:
    """DDP's own resume of the same run: the whole model over this run's data-parallel ranks (each tensor rank of a
    group computes the same), from DDP's files of the run before; rank 0 saves ``out/<name>_ddp.pt``."""
    data_size = dist.get_world_size() // t
    data_rank = dist.get_rank() // t
    groups = [dist.new_group(list(range(j, dist.get_world_size(), t))) for j in range(t)]
    model = _model(1)
    optimizer = model.configure_optimizers()
    if resume is not None:
        saved = torch.load(resume, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    ddp = DistributedDataParallel(model, process_group=groups[dist.get_rank() % t])
    losses = []
    for step in range(first_step, first_step + STEPS):
        loss = _loss(ddp, _batch(step, data_rank, data_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, out / f"{name}_ddp.pt")
    dist.barrier()
    return {"losses": losses, "params": _weights(model)}


def compare(zero: dict[str, Any], ddp: dict[str, Any]) -> dict[str, Any]:
    """Per step the relative loss difference, per parameter the relative difference of this rank's slice."""
    return {"loss": [abs(a - e) / abs(e) for a, e in zip(zero["losses"], ddp["losses"])],
            "steps": (len(zero["losses"]), len(ddp["losses"])),
            "params": {n: relative(p, _slice_of(ddp["params"][n], _Marked(zero["marks"][n])))
                       for n, p in zero["params"].items()},
            "sliced": sorted(n for n, m in zero["marks"].items() if m is not None)}


class _Marked:
    """A stand-in carrying a recorded slice marker (the engine's parameters are gone after teardown)."""

    def __init__(self, mark: Any) -> None:
        if mark is not None:
            setattr(self, "_lightning_zero_tensor_parallel", mark)


def chain_step(name: str, t: int, stage: int, first_step: int, previous: Optional[str], out: Path) -> dict[str, Any]:
    zero = zero_run(name, t, stage, first_step, out / f"{previous}.ckpt" if previous else None, out)
    ddp = ddp_run(name, t, first_step, out / f"{previous}_ddp.pt" if previous else None, out)
    return {**compare(zero, ddp), "shape": zero["shape"], "not_exact": zero.get("not_exact", [])}


def adafactor_checkpoint(out: Path) -> None:
    """An Adafactor run at 2 x 2 (zero2), one step, saved."""
    model = _model(2, AdafactorGPT)
    optimizer = model.configure_optimizers()
    engine = ZeroEngine(model, [optimizer], stage=2, tensor_parallel_size=2)
    engine.backward(_loss(model, _batch(0, dist.get_rank() // 2, 2)))
    engine.step()
    engine_state.save(engine, engine_state.states_entries(engine, [optimizer]), out / "adafactor.ckpt", "engine")
    engine.teardown()


def adafactor_refusals(out: Path) -> dict[str, Any]:
    """At t = 1: resuming the Adafactor checkpoint of t = 2 is refused before anything is loaded (the weights and
    the optimizer's state are unchanged); its weights alone load, re-cut (the whole tensors of its slices)."""
    model = _model(1, AdafactorGPT)
    optimizer = model.configure_optimizers()
    engine = ZeroEngine(model, [optimizer], stage=2)
    before = _weights(model)
    checkpoint = engine_state.read(out / "adafactor.ckpt")
    found = {}
    for what, load in (("model", engine_state.load_model), ("optimizers", engine_state.load_optimizers)):
        try:
            load(engine, checkpoint)
            found[what] = ""
        except CheckpointError as error:
            found[what] = str(error)
    unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and not optimizer.state
    weights_only = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
    engine_state.load_model(engine, weights_only)
    full = load_full_checkpoint(out / "adafactor.ckpt", weights_only=True, verify=False)["state_dict"]
    loaded = all(torch.equal(p, full[n]) for n, p in model.named_parameters())
    engine.teardown()
    return {"refusals": found, "unchanged": unchanged, "weights_loaded": loaded}


_RETIRED: list[Any] = []


def in_group_of_two(out: Path, rank: int, run: Any) -> Any:
    """Run ``run()`` on ranks 0 and 1 in a job of their own (a process group of 2), then return to the 4 ranks."""
    dist.barrier()
    _RETIRED.append(dist.group.WORLD)  # alive, so that no later group reuses its id (groups are cached by it)
    dist.destroy_process_group()
    result = None
    if rank < 2:
        dist.init_process_group("gloo", init_method=f"file://{out}/group_of_two", rank=rank, world_size=2)
        result = run()
        dist.barrier()
        _RETIRED.append(dist.group.WORLD)
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{out}/group_of_four", rank=rank, world_size=4)
    return result


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    runs: dict[str, Any] = {}
    runs["A"] = chain_step("a", 2, 2, 0, None, out)
    adafactor_checkpoint(out)
    runs["B"] = chain_step("b", 1, 3, STEPS, "a", out)
    runs["adafactor"] = adafactor_refusals(out)
    runs["C"] = in_group_of_two(out, rank, lambda: chain_step("c", 2, 1, 2 * STEPS, "b", out))
    runs["D"] = chain_step("d", 2, 3, 3 * STEPS, "c", out)
    dist.destroy_process_group()
    torch.save(runs, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
