"""One rank of the offload suite: every scenario with ``offload_optimizer=True`` next to its DDP (or non-offloaded)
reference, all in one launch (each launch costs seconds of imports). Saves losses, final weights and what a
callback saw of the host buffers."""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import LossScaler, ZeroPrecision, ZeroStrategy, measure_model_states
from lightning_zero.shards import disk
from tests.models import OverflowOnRank1, SharedOptimizers, TinyGAN, TinyLM

warnings.filterwarnings("ignore")

STAGES = (1, 2, 3)


def strategy(name: str, model_numel: int, **options: Any) -> Any:
    """``"ddp"``, or ``"zero<stage>"`` with ``"+offload"`` (the optimizer) and/or ``"+params"`` (stage 3's parameter
    shards) in host memory, ``"+disk"`` / ``"+pdisk"`` the same on disk: about 8 buckets, so parameters span
    buckets."""
    if name == "ddp":
        return "ddp_find_unused_parameters_true"
    stage = int(name[4])
    extra: dict[str, Any] = {"persistence_threshold": 0} if stage == 3 else {}  # tiny blocks stay real units
    optimizer = "disk" if "+disk" in name else "+offload" in name  # "+disk": offload_optimizer="disk"
    params = "disk" if "+pdisk" in name else "+params" in name  # "+pdisk": offload_params="disk"
    return ZeroStrategy(stage=stage, offload_optimizer=optimizer, offload_params=params,
                        reduce_bucket_size=max(200, model_numel // 8), **extra, **options)


class HostBufferProbe(L.Callback):
    """Before every optimizer step (gradients reduced and on the host, not yet clipped): checks that the host
    buffers are storages of their own, on the CPU, and that the gradient shard exists only there (the reducer keeps
    none on the device)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, bool]] = []
        self.states: dict[str, int] = {}

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_step == 2 and not self.states:  # optimizer states exist, no master gradient is alive
            self.states = measure_model_states(module, trainer.optimizers).as_dict()
            self.states["numel"] = sum(p.numel() for o in trainer.optimizers for p in o._zero_sharded.storage.params)
            managed = {id(p) for o in trainer.optimizers for p in o._zero_sharded.storage.params}
            self.states["unmanaged"] = sum(p.numel() * p.element_size() for p in module.parameters()
                                           if id(p) not in managed)  # kept whole on the device

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        sharded_optimizer = getattr(optimizer, "_optimizer", optimizer)._zero_sharded
        engine = sharded_optimizer.storage
        if engine.host_grads is None:
            return  # offload_params alone: ParamShardProbe checks it
        working = {p.untyped_storage().data_ptr() for p in module.parameters() if p.numel()}
        sharded = getattr(engine, "sharded", None)  # stage 3's parameter storage
        device_shard = engine.working_shard if not engine.params_offloaded else None  # a host shard may alias
        for t in (getattr(engine, "flat", None), device_shard, *(sharded.buffers.values() if sharded else ())):
            if t is not None:
                working.add(t.untyped_storage().data_ptr())
        working.discard(0)  # freed unit buffers
        master = engine.master_storage
        states = [v for m in engine.masters for v in optimizer.state.get(m, {}).values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        grads = [m.grad for m in engine.masters if m.grad is not None]
        self.seen.append({
            "master_on_host": master is not None and master.device.type == "cpu" and not master.is_pinned(),
            "master_separate": master is not None and master.untyped_storage().data_ptr() not in working,
            "masters_view_it": all(m.untyped_storage().data_ptr() == master.untyped_storage().data_ptr()
                                   for m in engine.masters),
            "grads_in_host_buffer": bool(grads) and all(
                g.untyped_storage().data_ptr() == engine.host_grads.buffer.untyped_storage().data_ptr() for g in grads),
            "grad_shard_only_on_host": engine.reducer.grad_shard is None and engine.host_grads.buffer is not None
            and engine.host_grads.buffer.device.type == "cpu" and bool(engine.host_grads.buffer.abs().sum() > 0),
            "states_separate": all(s.untyped_storage().data_ptr() not in working and s.device.type == "cpu"
                                   for s in states),
            # offload_optimizer="disk": the master and every state (after the first step) are file mappings
            "on_disk_as_configured": (sharded_optimizer.windowed is not None) == (disk.on_disk(master) and all(
                disk.on_disk(s) for s in states) and (bool(states) or trainer.global_step == 0)),
        })


class ParamShardProbe(L.Callback):
    """After every training batch (the step done) with ``offload_params``: the host parameter shard shares no storage
    with anything the device side gathers into or computes with, the non-root units hold no memory, and the gathers
    of the batch uploaded at least the whole shard (forward) from the host."""

    def __init__(self) -> None:
        self.seen: list[dict[str, bool]] = []
        self._uploaded = 0

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        engine = trainer.strategy.storages[0]
        sharded = engine.sharded
        host = sharded.working_shard
        device_side = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *sharded.buffers.values(),
                                                                   engine.reducer.grad_shard] if t is not None}
        no_device_grads = engine.host_grads is None or engine.reducer.grad_shard is None
        device_side.discard(0)  # freed storages
        # fp32 with the optimizer offloaded too: the host shard *is* the host master (no second host copy)
        aliased = engine.host_grads is not None and host.dtype == engine.master_storage.dtype
        shard_bytes = host.numel() * host.element_size()
        self.seen.append({
            "host_shard_offloaded": sharded.offloaded and host.device.type == "cpu" and not host.is_pinned(),
            "host_shard_separate": host.untyped_storage().data_ptr() not in device_side,
            "master_alias_as_expected": (host is engine.master_storage) == aliased,
            "units_freed": all(b.untyped_storage().nbytes() == 0 for u, b in sharded.buffers.items() if u != 0),
            "uploaded": sharded.uploaded_bytes - self._uploaded >= shard_bytes,
            "no_device_grad_shard_if_optimizer_offloaded": no_device_grads,
        })
        self._uploaded = sharded.uploaded_bytes


def run(name: str, model: L.LightningModule, precision: Any = "32-true", probe: bool = False,
        validate: bool = False, **trainer_kwargs: Any) -> dict[str, Any]:
    plugins = [precision] if isinstance(precision, ZeroPrecision) else []
    callbacks: list[L.Callback] = [HostBufferProbe()] if probe else []
    if probe and "+params" in name:
        callbacks.append(ParamShardProbe())
    trainer = L.Trainer(strategy=strategy(name, sum(p.numel() for p in model.parameters())), accelerator="cpu",
                        devices=2, precision=None if plugins else precision, plugins=plugins or None,
                        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **trainer_kwargs)
    trainer.fit(model)
    out = {"losses": list(model.losses),
           "params": {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}}
    if validate:  # zero3: a fresh setup that shards the trained weights again, outside fit
        out["val_loss"] = trainer.validate(model, verbose=False)[0]["val_loss"]
    if probe:
        out["probe"] = callbacks[0].seen
        out["states"] = callbacks[0].states
        out["param_probe"] = callbacks[1].seen if len(callbacks) > 1 else None
    if isinstance(precision, ZeroPrecision) and precision.scaler is not None:
        out["scaler"] = precision.scaler.state_dict()
    return out


def round_trip(out: Path) -> dict[str, Any]:
    """Offloaded (zero2) 1 epoch → save one full file → not offloaded (zero3) 1 more → save a sharded directory →
    offloaded (zero1) 1 more, against 3 uninterrupted epochs without offload; the same with stage 3's parameters
    offloaded (``offload_params``) in the first and last legs."""
    fit = dict(limit_train_batches=4, accumulate_grad_batches=2, gradient_clip_val=0.05, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    def trainer(name: str, epochs: int, state_dict_type: str = "sharded") -> L.Trainer:
        with torch.device("meta"):
            numel = sum(p.numel() for p in TinyLM().parameters())
        return L.Trainer(strategy=strategy(name, numel, state_dict_type=state_dict_type), accelerator="cpu",
                         devices=2, max_epochs=epochs, **fit)

    def resume(legs: list[tuple[str, int, str]], tag: str) -> list[float]:
        resumed: list[float] = []
        ckpt = None
        for i, (name, epochs, kind) in enumerate(legs):
            L.seed_everything(0, verbose=False)
            model = TinyLM()
            t = trainer(name, epochs, kind)
            t.fit(model, ckpt_path=ckpt)
            resumed += model.losses
            ckpt = out / f"{tag}{i}.ckpt"
            t.save_checkpoint(ckpt)
        return resumed

    resumed = resume([("zero2+offload", 1, "full"), ("zero3", 2, "sharded"), ("zero1+offload", 3, "sharded")], "leg")
    params = resume([("zero3+params", 1, "sharded"), ("zero2", 2, "full"), ("zero3+offload+params", 3, "sharded")],
                    "params")
    # disk -> host -> disk and plain -> disk -> host: every move between the three places
    to_disk = resume([("zero3+disk+pdisk", 1, "sharded"), ("zero2+offload", 2, "full"), ("zero1+disk", 3, "sharded")],
                     "disk")
    from_plain = resume([("zero3", 1, "full"), ("zero2+disk", 2, "sharded"), ("zero3+offload+params", 3, "sharded")],
                        "plain")
    L.seed_everything(0, verbose=False)
    straight = TinyLM()
    trainer("zero2", 3).fit(straight)
    return {"resumed": resumed, "resumed_params": params, "resumed_disk": to_disk, "resumed_plain_disk": from_plain,
            "straight": straight.losses}


def scenarios(out: Path) -> dict[str, dict[str, Any]]:
    """``{scenario: {run name: thunk}}``; every scenario has its reference run first."""
    fit = dict(max_steps=6, gradient_clip_val=0.05, accumulate_grad_batches=2)
    offloaded = [f"zero{s}+offload" for s in STAGES]
    params = ["zero3+params", "zero3+offload+params"]  # offload_params without and with offload_optimizer
    on_disk = [f"zero{s}+disk" for s in STAGES] + ["zero3+pdisk", "zero3+disk+pdisk"]
    fp16 = lambda: ZeroPrecision("16-mixed", loss_scaler=LossScaler(init_scale=1024.0, growth_interval=3))  # noqa: E731
    return {
        "adamw": {n: (lambda n=n: run(n, TinyLM(frozen=True), probe=n != "ddp", validate=True, limit_val_batches=2,
                                      val_check_interval=4, **fit)) for n in ["ddp", *offloaded, *params, *on_disk]},
        "gan_manual": {n: (lambda n=n: run(n, TinyGAN(), max_steps=6))
                       for n in ["ddp", *offloaded, *params, *on_disk]},
        # three optimizers sharing parameters, Adafactor (whole tensors) among them, closures, clipping
        "shared_adafactor": {n: (lambda n=n: run(n, SharedOptimizers(third="adafactor"), max_steps=8))
                             for n in ["ddp", "zero2+offload", "zero3+offload", "zero3+offload+params",
                                       "zero2+disk", "zero3+disk+pdisk"]},
        # lr 1e-2: the learning rate of test_parity.py's bf16 scenario (see tests/compare.py's bound on parameters)
        "bf16_mixed": {n: (lambda n=n: run(n, TinyLM(scheduler=False, lr=1e-2), precision="bf16-mixed",
                                            probe=n != "ddp", max_steps=4))
                       for n in ["ddp", *offloaded, *params, *on_disk]},
        "fp16_overflow": {"zero2+offload": lambda: run("zero2+offload", OverflowOnRank1(scheduler=False),
                                                       precision=fp16(), max_steps=6)},
        "round_trip": {"zero": lambda: round_trip(out)},
    }


def main() -> None:
    out = Path(sys.argv[1])
    wanted = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    results: dict[str, dict[str, Any]] = {}
    for scenario, runs in scenarios(out).items():
        if wanted is not None and scenario not in wanted:
            continue
        for name, thunk in runs.items():
            L.seed_everything(0, verbose=False)
            start = time.perf_counter()
            results.setdefault(scenario, {})[name] = thunk()
            results[scenario][name]["seconds"] = time.perf_counter() - start
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
