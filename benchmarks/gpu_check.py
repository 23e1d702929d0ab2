"""The GPU paths on one CUDA device: NCCL at world size 1, every precision, ddp and zero1-3 side by side.

    python -m benchmarks.gpu_check --width 1024 --depth 8 --steps 30
    python -m benchmarks.gpu_check --strategies ddp zero2 zero2+offload zero3 zero3+offload   # ZeRO-Offload too

For each (precision, strategy): loss after the last step, median step time, peak ``torch.cuda.max_memory_allocated``
and the model-state bytes measured after a backward (on the device, and in host memory with ``+offload``, i.e.
``offload_optimizer=True``). In fp32 the ZeRO losses must equal DDP's.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader


from lightning_zero import ZeroStrategy, measure_model_states
from examples.train_tiny import CharLM, char_dataset

warnings.filterwarnings("ignore")


class Probe(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.states: dict[str, int] = {}
        self.loss = float("nan")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t0)
        self.loss = float(outputs["loss"])

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == 2 and not self.states:
            self.states = measure_model_states(pl_module, trainer.optimizers).as_dict()


def run(strategy: str, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    data, vocab = char_dataset(context=32)
    model = CharLM(vocab, width=args.width, depth=args.depth, lr=args.lr)
    probe = Probe()
    strat: Any = "ddp" if strategy == "ddp" else ZeroStrategy(stage=int(strategy[4]),
                                                              offload_optimizer=strategy.endswith("+offload"))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer = L.Trainer(strategy=strat, accelerator="gpu", devices=1, precision=precision, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[probe], gradient_clip_val=1.0)
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size, shuffle=False))
    return {"loss": probe.loss, "step_ms": 1000 * statistics.median(probe.times[5:]),
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
            "states_mib": probe.states["device_model_states"] / 2**20, "host_mib": probe.states["host"] / 2**20,
            "psi": sum(p.numel() for p in model.parameters()), "backend": torch.distributed.get_backend()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "zero1", "zero2", "zero3"],
                        help="ddp, zero1-zero3, and zero1+offload-zero3+offload (offload_optimizer=True)")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, lightning {L.__version__}")
    print("| precision | strategy | Ψ | loss | median step (ms) | vs first | peak allocated (MiB) | device model states "
          "(MiB) | host model states (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for precision in args.precisions:
        base = None
        for strategy in args.strategies:
            if strategy == "ddp" and precision == "bf16-true":
                continue
            r = run(strategy, precision, args)
            base = base or r
            print(f"| {precision} | {strategy} ({r['backend']}) | {r['psi']:,} | {r['loss']:.6f} | {r['step_ms']:.2f} | "
                  f"{r['step_ms'] / base['step_ms']:.2f} | {r['peak_mib']:.0f} | {r['states_mib']:.0f} | {r['host_mib']:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
