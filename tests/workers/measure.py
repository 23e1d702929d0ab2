"""One rank of the measurement run: traffic per optimizer step and model-state bytes per rank, for ddp and zero1-3.

Usage (through ``lightning_zero.testing.launch``): ``measure.py OUT WIDTH PRECISION STRATEGIES [STEPS [MODEL [DEPTH [OPTIONS]]]]``
with MODEL ``lm`` (the MLP language model, default) or ``gpt`` (TinyGPT, tied embeddings, built in
``configure_model``), and OPTIONS ``test`` (small buckets, every unit its own: the default) or ``defaults`` (ZeRO's
own defaults; ``test`` also prefetches a single width x width of stage 3's units). ``units``: stage 3's gathered
high-water mark, its block pool's bytes, each unit's elements (root first) and those of the unit a forward runs last
(``last``). ``peak_rss_growth`` (``ru_maxrss``) is only meaningful when one strategy runs per launch;
``fit_peak_growth`` is meaningful for every strategy of a launch: the resident high-water mark is reset to the
current level right before each ``fit`` (``/proc/self/clear_refs``) and read at the end of training, before
teardown, so it is the peak of that ``fit`` above the level it started from.
"""

from __future__ import annotations

import gc
import resource
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_zero import Traffic, ZeroStrategy, measure_model_states
from tests.compare import last_unit_elements
from tests.models import TinyGPT, TinyLM

warnings.filterwarnings("ignore")


class Probe(L.Callback):
    """Counts collective payload per optimizer step and measures model states after a backward."""

    def __init__(self, measure_at: int = 2) -> None:
        self.measure_at = measure_at
        self.traffic: list[dict[str, Any]] = []
        self.states: dict[str, int] = {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.counters = getattr(trainer.strategy, "traffic", Traffic())  # ddp: counts nothing
        self.counters.reset()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.traffic.append(self.counters.snapshot())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # before teardown hands weights back
        self.fit_peak = _status("VmHWM")
        runtime = getattr(trainer.strategy, "runtime", None)
        self.units: dict[str, Any] = {} if runtime is None else {
            "gathered_peak": runtime.peak_gathered_bytes,
            "pool_bytes": sum(s.sharded.pool.block_bytes for s in runtime.storages),
            "unit_numels": [sum(s.unit_numel(u) for s in runtime.storages) for u in range(len(runtime.units))],
            "last": last_unit_elements(trainer.strategy),
        }

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.measure_at and not self.states:
            self.states = measure_model_states(pl_module, trainer.optimizers).as_dict()


def _masters_in_params(model: torch.nn.Module, optimizers: list[Any]) -> bool:
    """Whether every tensor the optimizers step on lies in the memory of the module's (full) parameters."""
    spans = [(p.untyped_storage().data_ptr(), p.untyped_storage().data_ptr() + p.untyped_storage().nbytes())
             for p in model.parameters()]
    masters = [m for o in optimizers for g in o.param_groups for m in g["params"]]
    return bool(masters) and all(any(a <= m.data_ptr() < b for a, b in spans) for m in masters)


def _status(field: str) -> int:
    """``VmHWM`` or ``VmRSS`` of this process, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> int:
    """Reset the resident high-water mark to the current level (Linux >= 4.0); returns that level in bytes."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def main() -> None:
    out = Path(sys.argv[1])
    width, precision, strategies = int(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 4
    kind = sys.argv[6] if len(sys.argv) > 6 else "lm"
    depth = int(sys.argv[7]) if len(sys.argv) > 7 else 4
    defaults = len(sys.argv) > 8 and sys.argv[8] == "defaults"
    results: dict[str, Any] = {}
    for name in strategies:
        L.seed_everything(0, verbose=False)
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if kind == "gpt":
            model: L.LightningModule = TinyGPT(width=width, depth=depth, meta_init=True)
        else:
            model = TinyLM(optimizer="adam", width=width, scheduler=False)
        probe = Probe()
        options = {} if defaults else {"reduce_bucket_size": width * width, "persistence_threshold": 0,
                                       "prefetch_size": width * width}
        strategy = "ddp" if name == "ddp" else ZeroStrategy(stage=int(name[-1]), **options)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=torch.distributed.get_world_size()
                            if torch.distributed.is_initialized() else int(__import__("os").environ["WORLD_SIZE"]),
                            precision=precision, max_steps=steps, gradient_clip_val=1.0, callbacks=[probe],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        fit_start = _reset_peak()
        trainer.fit(model)
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        peak = probe.peak_rss
        engine = getattr(trainer.strategy, "engine", None)
        after_fit = {}
        if engine is not None:  # what the engine holds once teardown handed the full weights back
            parts = engine.memory_parts()
            after_fit = {**vars(parts), "optimizer_masters_in_params": _masters_in_params(model, trainer.optimizers),
                         "flat_elements": sum(s.layout.total for s in engine.store.storages)}
        results[name] = {"after_fit": after_fit, "traffic": probe.traffic, "states": probe.states, "numel": numel,
                         "bucket_elements": width * width, "peak_rss": peak * 1024,
                         "peak_rss_growth": (peak - baseline) * 1024, "fit_peak_growth": probe.fit_peak - fit_start,
                         "units": probe.units}
        del trainer, model, probe
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
