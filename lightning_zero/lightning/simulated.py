"""Rank 0 of a large world, measured in this process: ``measure_rank`` (``lightning-zero estimate --measure``).

[Note: measuring rank 0 of a world that is not there]
The Trainer runs as a real job's rank 0 runs: ``ZeroStrategy`` with Lightning's own loops, precision plugin and
``DistributedSampler``, under a cluster environment that says "rank 0 of N, processes started by someone else" (so
no launcher starts any) and a process group of torch's fake backend (see [Note: one rank of a simulated world] in
``engine/simulated.py``). Under zero3 the model is built on the meta device in ``configure_model`` and materialized
one unit at a time, as in a real run, so a model larger than this machine's memory can be measured at a world
where its shards fit. A callback reads, at the end of each training step, the model states by kind (live tensors),
the engine's highest memory reading (``memory/account.py``) and the traffic of the step (reset at its start). The
process's high-water mark is reset before the run where Linux allows it, and every figure is counted above the
resident level when ``measure_rank`` started (for the command: the level after its imports). Nothing is written:
no logger, no checkpoint, and the Trainer's root directory is a temporary one, removed after.
"""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import LightningEnvironment
from typing_extensions import override

from lightning_zero.comm import collectives
from lightning_zero.config import ZeroConfig
from lightning_zero.engine.simulated import STANDING_ASIDE, check_simulable
from lightning_zero.lightning.trainer.strategy import ZeroStrategy
from lightning_zero.memory.account import EngineMemory, MemoryAccount, ProcessMemory, reset_peak
from lightning_zero.shards.accounting import expected_model_state_bytes, expected_offload_bytes
from lightning_zero.shards.slices import tensor_parallel_slice

#: The kinds whose elements count twice in the paper's traffic column (an all-reduce moves its payload twice).
DOUBLED = ("all_reduce", "control")


class SimulatedEnvironment(LightningEnvironment):
    """Rank 0 of ``world_size`` ranks whose processes are someone else's business (none is started)."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self._simulated_world = world_size

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @override
    def world_size(self) -> int:
        return self._simulated_world

    @override
    def set_world_size(self, size: int) -> None:
        pass  # the strategy tells its own view; the world is the one simulated

    @override
    def global_rank(self) -> int:
        return 0

    @override
    def set_global_rank(self, rank: int) -> None:
        pass

    @override
    def local_rank(self) -> int:
        return 0

    @override
    def node_rank(self) -> int:
        return 0


@dataclass(frozen=True)
class MeasuredRank:
    """What rank 0 of a simulated world held and sent (bytes, elements), next to the formula."""

    params: int
    """Ψ of the formulas: this rank's trainable parameters before sharding (under tensor parallelism its slices and
    the replicated tensors; otherwise the whole model's)."""
    model_params: int
    """Trainable parameters of the whole model (tensor-parallel slices counted whole)."""
    world_size: int
    shard_size: int
    """k: the ranks each model state is sharded over (N, or the data-parallel or shard group's size)."""
    stage: int
    precision: str
    steps: int
    model_states: dict[str, int]
    """Bytes by kind after the last step: ``parameters``, ``gradients``, ``fp32 masters``, ``optimizer states``."""
    expected_model_states_bytes: float
    """The table in docs/stages.md (16Ψ/N under zero3 mixed precision; with offload: the device's part)."""
    peak_rss_bytes: int
    """The process's resident high-water mark above the level when the measurement started."""
    peak_parts: dict[str, int]
    """The engine's highest memory reading, part by part (``MemoryAccount.parts``)."""
    peak_at: str
    """Where in the step the highest reading was."""
    traffic_elements: dict[str, int]
    """Elements of the last step by collective kind (logical payload: all-gather outputs, reduce-scatter inputs)."""
    traffic_calls: dict[str, int]
    standing_aside: tuple[str, ...] = field(default=STANDING_ASIDE)

    @property
    def model_states_bytes(self) -> int:
        """Model-state bytes after the last step, every kind."""
        return sum(self.model_states.values())

    @property
    def traffic_elements_per_step(self) -> int:
        """The paper's count: all-gather outputs, reduce-scatter inputs, all-reduces twice."""
        return sum(n * (2 if kind in DOUBLED else 1) for kind, n in self.traffic_elements.items())

    @property
    def expected_traffic_elements(self) -> int:
        """3Ψ under stage 3, 2Ψ under stages 1 and 2."""
        return (3 if self.stage == 3 else 2) * self.params

    def as_dict(self) -> dict[str, Any]:
        """Every field, with the totals (``--json``)."""
        return {
            **asdict(self),
            "standing_aside": list(self.standing_aside),
            "model_states_bytes": self.model_states_bytes,
            "traffic_elements_per_step": self.traffic_elements_per_step,
            "expected_traffic_elements": self.expected_traffic_elements,
        }


class _StepReadings(pl.Callback):
    """Resets the traffic at each training step's start; reads the model states and the traffic at its end."""

    def __init__(self, strategy: ZeroStrategy) -> None:
        self.strategy = strategy
        self.states: Optional[EngineMemory] = None
        self.traffic: dict[str, Any] = {}
        self.account: Optional[MemoryAccount] = None
        self.params = 0
        self.model_params = 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.strategy.traffic.reset()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        engine = self.strategy.engine
        assert engine is not None
        self.traffic = self.strategy.traffic.snapshot()
        self.states = engine.memory_parts()
        self.account = engine.memory.account()
        params = engine.store.params  # the store is emptied at teardown
        self.params = sum(p.numel() for p in params)
        self.model_params = sum(p.numel() * (s.size if (s := tensor_parallel_slice(p)) else 1) for p in params)


def measure_rank(
    module: Union[pl.LightningModule, Callable[[], pl.LightningModule]],
    world_size: int,
    *,
    stage: int = 3,
    precision: str = "bf16-mixed",
    steps: int = 1,
    devices_per_node: Optional[int] = None,
    accelerator: str = "cpu",
    **options: Any,
) -> MeasuredRank:
    """Run rank 0 of ``world_size`` ranks for ``steps`` optimizer steps in this process, on torch's fake process
    group, through the Trainer, and measure it (see [Note: measuring rank 0 of a world that is not there]).

    Args:
        module: a LightningModule with its own ``train_dataloader`` (and ``configure_optimizers``), or a function
            that makes one: it is then called under ``trainer.init_module(empty_init=True)``, which under zero3
            builds it sharded. Under zero3 a model built whole outside either (in ``__init__``, not in
            ``configure_model``) is whole in this process before it is sharded.
        world_size: all ranks of the job (data-parallel times ``tensor_parallel_size``).
        stage: 1, 2 or 3.
        precision: the Trainer's precision.
        steps: optimizer steps; the figures are those of the last.
        devices_per_node: devices of one node (for ``shard_group_size="node"`` and hpZ); default 8 where it
            divides ``world_size``, else the whole world on one node.
        accelerator: the Trainer's; measured on ``"cpu"`` (the peak read is the host's resident memory).
        **options: ``ZeroConfig``'s options (``offload_optimizer=True``, ...).
    """
    config = ZeroConfig(stage=stage, **options)
    _check_measurable(world_size, steps, config)
    per_node = devices_per_node or (8 if world_size % 8 == 0 else world_size)
    if world_size % per_node:
        raise ValueError(f"`devices_per_node={per_node}` does not divide the world of {world_size} ranks.")
    collectives.register_simulated_backend()

    strategy = ZeroStrategy(
        stage=stage,  # type: ignore[arg-type]
        cluster_environment=SimulatedEnvironment(world_size),
        process_group_backend=collectives.SIMULATED_BACKEND,
        **options,
    )
    readings = _StepReadings(strategy)
    reset_peak()
    start = ProcessMemory.read()
    try:
        with tempfile.TemporaryDirectory(prefix="lightning-zero-measure-") as root, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*simulated world.*")  # said in the result instead
            trainer = pl.Trainer(
                accelerator=accelerator,
                devices=per_node,
                num_nodes=world_size // per_node,
                strategy=strategy,
                precision=precision,  # type: ignore[arg-type]
                max_steps=steps,
                limit_val_batches=0,
                num_sanity_val_steps=0,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[readings],
                default_root_dir=root,
            )
            if not isinstance(module, pl.LightningModule):
                with trainer.init_module(empty_init=True):
                    module = module()
            trainer.fit(module)
        peak = ProcessMemory.read().peak
    finally:
        collectives.release_process_groups()
    return _result(strategy, readings, config, precision, world_size, steps, start, peak)


def check_lightning_module_class(cls: Any, name: str) -> None:
    """Refuse a class that is not a LightningModule: the measurement runs the Trainer."""
    if not (isinstance(cls, type) and issubclass(cls, pl.LightningModule)):
        raise ValueError(
            f"{name} is not a LightningModule: `--measure` runs the Trainer, so give a LightningModule with its own "
            "`train_dataloader` (wrap a plain nn.Module in one)."
        )


def _check_measurable(world_size: int, steps: int, config: ZeroConfig) -> None:
    """One-line errors for what ``measure_rank`` cannot do."""
    if world_size < 2:
        raise ValueError(f"A simulated world needs at least 2 ranks, got {world_size}: measure one rank by running it.")
    if steps < 1:
        raise ValueError(f"`steps` must be at least 1, got {steps}.")
    if collectives.is_initialized():
        raise RuntimeError(
            "This process already has a process group: measure a simulated world in a process of its own "
            "(`lightning-zero estimate --measure`), before any `init_process_group`."
        )
    check_simulable(config)


def _result(
    strategy: ZeroStrategy,
    readings: _StepReadings,
    config: ZeroConfig,
    precision: str,
    world_size: int,
    steps: int,
    start: ProcessMemory,
    peak: int,
) -> MeasuredRank:
    """The readings of the last step, with the formula beside them."""
    engine = strategy.engine
    if engine is None or readings.states is None or readings.account is None:
        raise RuntimeError("The simulated run stopped before its first optimizer step: see the messages above.")
    data_parallel = world_size // max(1, config.tensor_parallel_size)
    shard = data_parallel // max(1, engine.shard_groups.replicas)
    psi = readings.params
    mode = engine.precision.precision
    expected: float = expected_model_state_bytes(psi, shard, config.stage, mode)
    if config.offload_optimizer or config.offload_params:  # on a CPU the host is the device: both are counted
        expected = sum(
            expected_offload_bytes(psi, shard, config.stage, mode, config.offload_optimizer, config.offload_params)
        )
    s = readings.states
    account = replace(readings.account, reference=start)
    return MeasuredRank(
        params=psi,
        model_params=readings.model_params,
        world_size=world_size,
        shard_size=shard,
        stage=config.stage,
        precision=precision,
        steps=steps,
        model_states={
            "parameters": s.params,
            "gradients": s.grads,
            "fp32 masters": s.master,
            "optimizer states": s.optimizer_states,
        },
        expected_model_states_bytes=expected,
        peak_rss_bytes=max(peak, account.now.resident) - start.resident,
        peak_parts=account.parts(),
        peak_at=account.at,
        traffic_elements=dict(readings.traffic.get("elements", {})),
        traffic_calls=dict(readings.traffic.get("calls", {})),
    )
