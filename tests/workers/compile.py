"""One rank of the torch.compile suite: TinyGPT with compiled blocks (or a compiled ``forward``) under ddp and each
ZeRO stage, one after the other in the same processes. Saves per run the losses, the step times and what dynamo
counted (graphs compiled, graph breaks, recompilations).

Arguments: ``out_dir cases backend steps``; ``cases`` is a comma-separated list of ``strategy:mode[:options]`` with
mode ``eager``, ``block`` (``self.blocks[i] = torch.compile(block)`` in ``configure_model``) or ``whole``
(``self.forward = torch.compile(self.forward)``) or ``inplace`` (``block.compile()``), and options ``ac``
(``activation_checkpointing=True``), ``units`` (``unit_classes=[Block]``: stage 3 finds the original block inside
the compiled wrapper), ``meta`` (built in ``configure_model``), ``ca`` (backward under compiled autograd).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch._dynamo

import lightning_zero
from lightning_zero import ZeroStrategy
from tests.models import Block, TinyGPT

warnings.filterwarnings("ignore")


class CompiledGPT(TinyGPT):
    """TinyGPT whose user compiles it in ``configure_model``, as the Lightning docs suggest."""

    def __init__(self, mode: str, backend: str, meta_init: bool = False) -> None:
        super().__init__(meta_init=meta_init)
        self.mode, self.backend = mode, backend
        self.step_times: list[float] = []
        self._t0 = 0.0
        self.compiled_autograd = False

    def configure_model(self) -> None:
        super().configure_model()
        if self.mode == "block":
            for i, block in enumerate(self.blocks):
                self.blocks[i] = torch.compile(block, backend=self.backend)
        elif self.mode == "whole":
            self.forward = torch.compile(self.forward, backend=self.backend)
        elif self.mode == "inplace":
            for block in self.blocks:
                block.compile(backend=self.backend)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if not self.compiled_autograd:
            return super().backward(loss, *args, **kwargs)
        from torch._dynamo import compiled_autograd
        with compiled_autograd._enable(torch.compile(backend=self.backend)):
            super().backward(loss, *args, **kwargs)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step_times.append(time.perf_counter() - self._t0)


def strategy(name: str, options: set[str]) -> Any:
    if name == "ddp":
        return "ddp_find_unused_parameters_true"
    kwargs: dict[str, Any] = dict(reduce_bucket_size=1500)
    if name == "zero3":
        kwargs["persistence_threshold"] = 0  # tiny test blocks must still be real units
    if "ac" in options:
        kwargs["activation_checkpointing"] = True
    if "units" in options:
        kwargs["unit_classes"] = [Block]
    return ZeroStrategy(stage=int(name[-1]), **kwargs)


def dynamo_counts() -> dict[str, int]:
    counters = torch._dynamo.utils.counters
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "frames": int(counters["frames"]["ok"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0,
    }


def run(case: str, backend: str, steps: int) -> dict[str, Any]:
    name, mode, *opts = case.split(":")
    options = set(opts)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    L.seed_everything(0, verbose=False)
    model = CompiledGPT(mode, backend, meta_init="meta" in options)
    model.compiled_autograd = "ca" in options
    if "ac" in options and name == "ddp":
        model.hparams.checkpointing = True  # ddp's equivalent: the module checkpoints its blocks itself
    trainer = L.Trainer(strategy=strategy(name, options), accelerator="cpu", devices=2, max_steps=steps,
                        gradient_clip_val=0.05, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    breaks = {reason[:200]: n for reason, n in torch._dynamo.utils.counters["graph_break"].items()}
    return {"losses": list(model.losses), "step_times": model.step_times, "counts": dynamo_counts(),
            "break_reasons": breaks, "warnings": [str(w.message) for w in caught if "torch.compile" in str(w.message)]}


def main() -> None:
    out = Path(sys.argv[1])
    cases, backend, steps = sys.argv[2].split(","), sys.argv[3], int(sys.argv[4])
    results: dict[str, Any] = {}
    for case in cases:
        try:
            results[case] = run(case, backend, steps)
        except Exception as error:  # noqa: BLE001 - the investigation records what fails and why
            results[case] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    results["cpu_seconds"] = time.process_time()  # this rank's CPU time: its wall time on an idle core
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    assert lightning_zero.__file__
    main()
