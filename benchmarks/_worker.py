"""One rank of one GPT benchmark launch (``benchmarks.compare.run_config``): train
:class:`benchmarks._model.BenchGPT` under one strategy and write what was measured to ``OUT/rank{r}.json``.

    python -m benchmarks._worker OUT '{"strategy": "zero2", "size": {...}, "steps": 8, "warmup": 3}'

Started by ``benchmarks.compare.run_config`` with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set (one process per rank,
as torchrun would), so Lightning sees an externally launched job. Strategies: ``ddp``, ``zero1``, ``zero2``,
``zero3``, ``fsdp2``, ``deepspeed1``, ``deepspeed2``, ``deepspeed3``. ``"profile": true`` also writes rank 0's
``torch.profiler`` table.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional

from benchmarks import _probes as probes

probes.count_collectives()  # before lightning_zero, Lightning or DeepSpeed bind the collectives (see probes.py)

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import _peers as peers  # noqa: E402
from benchmarks._model import BenchGPT, FSDP2GPT, GPTSize  # noqa: E402
from lightning_zero.shards import disk  # noqa: E402

warnings.filterwarnings("ignore")


def _counting_engine(trainer: L.Trainer) -> Any:
    """The strategy's ``ZeroEngine`` where it counts its costs (not DDP or FSDP2, nor a package from before
    ``step_costs``, run through ``+BENCH_ROOT`` for a before/after table)."""
    engine = getattr(trainer.strategy, "engine", None)
    return engine if hasattr(engine, "step_costs") else None


class Probe(L.Callback):
    """Times every step, counts its collectives, measures model states after the third backward."""

    def __init__(self, timer: probes.StepTimer, measure_at: int, profiler: Any = None) -> None:
        self.timer = timer
        self.measure_at = measure_at
        self.profiler = profiler
        self.states: dict[str, int] = {}
        self.peak = 0
        self.costs: list[dict[str, int]] = []
        """ZeRO only: each measured step's ``ZeroEngine.step_costs()``."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        engine = _counting_engine(trainer)
        if engine is not None:
            engine.step_costs()  # counts from here
        self.timer.start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.timer.stop()
        engine = _counting_engine(trainer)
        if engine is not None and self.timer.measured_last:  # the engine's own counts (see lightning_zero/memory/costs.py)
            self.costs.append(engine.step_costs())
        if self.profiler is not None:
            self.profiler.step()
        # in the rank's log as it goes, so a launch that dies in teardown still shows its steps (the launcher prints
        # the log's tail then)
        print(f"[probe] step {trainer.global_step}: {self.timer.last * 1e3:.0f} ms, device peak "
              f"{probes.peak_memory(pl_module.device) / 2**30:.1f} GiB, host peak "
              f"{probes.peak_memory(torch.device('cpu')) / 2**30:.1f} GiB", flush=True)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.measure_at and not self.states:
            self.states = _model_states(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peak = probes.peak_memory(pl_module.device)  # before teardown hands the full weights back


def _faults() -> float:
    """Minor page faults of this process so far."""
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


class PhaseProbe(L.Callback):
    """The resident high-water mark of each phase of ``fit`` (CPU only; see [Note: phases] in ``_probes.py``)."""

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline
        self.phases: dict[str, int] = {}
        self.levels: dict[str, int] = {}
        self.seconds: dict[str, list[tuple[float, float, float]]] = {}
        """(wall seconds, process-CPU seconds, minor page faults) of each phase, one entry per step; the first step's
        are warm-up."""
        self._clock: Optional[tuple[float, float, float]] = None

    def _mark(self, ended: str, starts: str) -> None:
        now = (time.perf_counter(), time.process_time(), _faults())
        if self._clock is not None:
            self.seconds.setdefault(ended, []).append((now[0] - self._clock[0], now[1] - self._clock[1],
                                                       now[2] - self._clock[2]))
        peak = probes.peak_memory(torch.device("cpu")) - self.baseline
        self.phases[ended] = max(self.phases.get(ended, 0), peak)
        level = probes.resident_memory() - self.baseline
        self.levels[starts] = max(self.levels.get(starts, 0), level)
        probes.reset_peak_memory()
        # the probe's own reading is not a phase's time
        self._clock = (time.perf_counter(), time.process_time(), _faults())

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._mark("setup", "idle")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._mark("idle", "forward")

    def on_before_backward(self, trainer: L.Trainer, *args: Any) -> None:
        self._mark("forward", "backward")

    def on_after_backward(self, trainer: L.Trainer, *args: Any) -> None:
        self._mark("backward", "reduce")

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        self._mark("reduce", "step")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._mark("step", "idle")

    @property
    def peak(self) -> int:
        """The peak of ``fit`` (the high-water mark is reset at each phase, so the process's own is not)."""
        return self.baseline + max(self.phases.values(), default=0)


class AccountProbe(L.Callback):
    """The account of this rank's memory (see [Note: the account of a rank's memory] in
    ``lightning_zero/memory/account.py``) read at the same points of every strategy's steps, DDP's and FSDP2's too:
    the end of setup, of each forward, backward and step. ZeRO's engine also reads it inside its backward and at its
    teardown; :meth:`result` keeps the highest of both.

    An optimizer step's temporaries (``foreach`` AdamW's, a whole shard's or DDP's whole model's at once) are gone by
    its end, so no reading sees them: the resident high-water mark is reset when each step starts and read when it
    ends, and the step whose peak is the run's highest is accounted as its end's reading plus "the optimizer step's
    temporaries" (its peak above its end). The run's peak is the highest mark over those resets."""

    def __init__(self) -> None:
        from lightning_zero.memory.account import MemoryLedger

        self.module: Optional[L.LightningModule] = None
        self.trainer: Optional[L.Trainer] = None
        self.ledger = MemoryLedger(self._parts)
        self.mark = 0
        """The highest ``VmHWM`` read before a reset."""
        self.step: Optional[tuple[int, Any]] = None
        """The highest step peak (``VmHWM`` at a step's end since its start) and the reading at that step's end."""

    def _parts(self) -> Any:
        from lightning_zero.memory.account import EngineMemory

        assert self.trainer is not None and self.module is not None
        engine = _counting_engine(self.trainer)
        if engine is not None:
            return engine.memory_parts()
        states = _model_states(self.trainer, self.module)  # DDP's buckets are C++'s: among "other live heap"
        return EngineMemory(params=states["params"], grads=states["grads"], master=states.get("master", 0),
                            optimizer_states=states["optimizer_states"])

    def _note(self, trainer: L.Trainer, pl_module: L.LightningModule, at: str) -> None:
        self.trainer, self.module = trainer, pl_module
        self.ledger.note(at)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._note(trainer, pl_module, "the end of setup")

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._note(trainer, pl_module, "the end of a forward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._note(trainer, pl_module, "the end of a backward")

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        from lightning_zero.memory.account import status_bytes

        self.mark = max(self.mark, status_bytes("VmHWM"))
        probes.reset_peak_memory()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        from lightning_zero.memory.account import MemoryAccount, ProcessMemory

        self._note(trainer, pl_module, "the end of an optimizer step")
        now = ProcessMemory.read()
        if self.step is None or now.peak > self.step[0]:
            self.step = (now.peak, MemoryAccount("the end of an optimizer step", now, self._parts()))

    def result(self, trainer: L.Trainer) -> dict[str, Any]:
        """The reading that explains the highest peak (the probe's, the engine's, or a step's end with the step's
        temporaries), its parts, and the whole run's high-water mark (the teardown included) above the level after
        imports, in bytes."""
        from lightning_zero.memory.account import IMPORTED, status_bytes

        engine = getattr(trainer.strategy, "engine", None)
        readings = [self.ledger.account()] + ([engine.memory.account()] if hasattr(engine, "memory") else [])
        candidates = [(r.resident, r, 0) for r in readings if r is not None]
        if self.step is not None:
            peak, reading = self.step
            temporaries = max(0, peak - reading.now.resident)
            candidates.append((reading.resident + temporaries, reading, temporaries))
        whole = max(self.mark, status_bytes("VmHWM")) - IMPORTED.resident
        if not candidates:
            return {"whole_peak": whole}
        _, best, temporaries = max(candidates, key=lambda c: c[0])
        parts = {**best.parts(), "the optimizer step's temporaries": temporaries}
        return {"whole_peak": whole, "at": best.at, "resident": best.resident, "parts": parts}


def _model_states(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int]:
    if isinstance(pl_module, FSDP2GPT):
        return peers.fsdp2_model_states(pl_module, trainer.optimizers)
    from lightning_zero import measure_model_states

    return measure_model_states(pl_module, trainer.optimizers).as_dict()


def _strategy(name: str, world_size: int, bucket: Optional[int], options: Optional[dict[str, Any]] = None) -> Any:
    """The strategy object; ``bucket`` (elements) overrides ddp's and ZeRO's bucket size, else their defaults;
    ``options`` are extra ``ZeroStrategy`` arguments (a variant of ``benchmarks.compare``)."""
    if name == "ddp":
        extra = {} if bucket is None else {"bucket_cap_mb": bucket * 4 / 2**20}
        return probes.counted_ddp_strategy(**extra)
    if name == "fsdp2":
        return peers.fsdp2_strategy(world_size)
    from lightning_zero import ZeroStrategy

    extra = {} if bucket is None else {"reduce_bucket_size": bucket}
    return ZeroStrategy(stage=int(name[-1]), **extra, **(options or {}))


def run_lightning(cfg: dict[str, Any], size: GPTSize, world_size: int, out: Path, baseline: int = 0) -> dict[str, Any]:
    """``ddp``, ``zero1``-``zero3`` or ``fsdp2`` through a Lightning ``Trainer``."""
    name = cfg["strategy"]
    accelerator = "gpu" if cfg.get("gpu") else "cpu"
    device = torch.device("cuda", 0) if cfg.get("gpu") else torch.device("cpu")
    samples = size.batch * world_size * cfg["steps"]
    model = (FSDP2GPT if name == "fsdp2" else BenchGPT)(size, samples, fused=cfg.get("fused", False),
                                                         compile_blocks=cfg.get("compile", False))
    profiler = _profiler(cfg, out)
    probe = Probe(probes.StepTimer(cfg["warmup"], device), measure_at=min(2, cfg["steps"] - 1), profiler=profiler)
    phases = PhaseProbe(baseline) if cfg.get("phases") and not cfg.get("gpu") else None
    account = AccountProbe() if cfg.get("account") and not cfg.get("gpu") else None
    trainer = L.Trainer(strategy=_strategy(name, world_size, cfg.get("bucket"), cfg.get("options")),
                        accelerator=accelerator, devices=world_size, precision=cfg.get("precision", "32-true"),
                        max_steps=cfg["steps"], gradient_clip_val=cfg.get("clip"), callbacks=[probe] + [c for c in (phases, account) if c is not None], logger=False,
                        enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    if profiler is not None:
        profiler.__enter__()
    cpu0 = time.process_time()
    trainer.fit(model)
    cpu_seconds = time.process_time() - cpu0
    if profiler is not None:
        profiler.__exit__(None, None, None)
        _write_profile(profiler, cfg, out)
    extra = {} if phases is None else {"phases": phases.phases, "levels": phases.levels, "peak_memory": phases.peak,
                                       "phase_seconds": phases.seconds}
    if account is not None:  # after fit returned: the teardown (stage 3's hand-back) is part of the run's peak
        extra["account"] = account.result(trainer)
    return {**probe.timer.summary(), "step_costs": probe.costs, "states": probe.states, "peak_memory": probe.peak, "loss": model.last_loss,
            "cpu_seconds": cpu_seconds, "host_peak": probes.peak_memory(torch.device("cpu")),
            "disk_io": {"read": disk.COUNTERS.read, "written": disk.COUNTERS.written}, **extra}


def _profiler(cfg: dict[str, Any], out: Path) -> Any:
    if not cfg.get("profile"):
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    wait = cfg["warmup"]
    return profile(activities=[ProfilerActivity.CPU], with_stack=False, record_shapes=False,
                   schedule=schedule(wait=wait, warmup=1, active=max(1, cfg["steps"] - wait - 1), repeat=1))


def _write_profile(profiler: Any, cfg: dict[str, Any], out: Path) -> None:
    if dist.get_rank() != 0:
        return
    averages = profiler.key_averages()
    text = [f"# {cfg['strategy']}, size {cfg['size']}, world size {dist.get_world_size()}",
            averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60),
            averages.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60)]
    (out / "profile.txt").write_text("\n\n".join(text))


def main() -> None:
    out = Path(sys.argv[1])
    cfg = json.loads(sys.argv[2])
    size = GPTSize(**cfg["size"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if os.environ.get("BENCH_FLUSH_DENORMAL") == "1":  # diagnosis: are slow matmuls computing on subnormal floats?
        torch.set_flush_denormal(True)
    L.seed_everything(0, verbose=False)
    rank = int(os.environ["RANK"])
    baseline = 0 if cfg.get("gpu") else probes.peak_memory(torch.device("cpu"))  # imports, interpreter
    try:
        if cfg["strategy"].startswith("deepspeed"):
            dist.init_process_group("gloo")
            samples = size.batch * world_size * cfg["steps"]
            result = peers.run_deepspeed(int(cfg["strategy"][-1]), size, cfg["steps"], cfg["warmup"], samples,
                                         cfg.get("bucket"), offload=cfg.get("options", {}).get("offload_optimizer", False))
        else:
            result = run_lightning(cfg, size, world_size, out, baseline)
    except Exception as error:  # the launcher reports the reason; the other configurations still run
        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {error}"[:2000]}
    result.update(strategy=cfg["strategy"], rank=rank, baseline_memory=baseline, world_size=world_size, size=size.as_dict(),
                  threads=torch.get_num_threads(), torch=torch.__version__)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
