"""``strategy="zero_auto"`` on the Trainer: ``ZeroAutoStrategy``, whose configuration is chosen at setup from the first
micro-batch of the training data, and whose predicted peak is set against the measured one after the first steps
(see ``engine/auto/``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_zero.config import ZeroConfig
from lightning_zero.engine.auto.budget import PeakMeter, default_budget, resolve_budget
from lightning_zero.engine.auto.choice import Choice, choose
from lightning_zero.engine.auto.facts import build_whole, held_bytes, model_facts
from lightning_zero.lightning.trainer.precision import ZeroPrecision
from lightning_zero.lightning.trainer.strategy import ZeroStrategy
from lightning_zero.stages import policy_for

#: The stage ``zero_auto`` runs as until the choice: see [Note: zero_auto records as zero3].
AUTO_UNTIL_SETUP: Literal[3] = 3
#: Options ``zero_auto`` sets itself.
CHOSEN_OPTIONS = ("offload_optimizer", "offload_params")

# [Note: the first zero_auto run is the process's]
# What grows once is the process (its imports, the allocator's arenas), whichever strategy object runs first, so the
# count of zero_auto setups is per process, not per strategy.

#: One entry per ``zero_auto`` setup this process made (the first grows the process once: see ``FIRST_RUN_BYTES``).
_RUNS: list[bool] = []
#: The measured peak is compared with the prediction once this many training steps have run.
STEPS_MEASURED = 3


@dataclass
class AutoRun:
    """One ``zero_auto`` setup: its choice, the meter of the measured peak, and that peak once read."""

    choice: Choice
    meter: PeakMeter
    measured: Optional[int] = None
    """The highest measured peak over the ranks, after ``STEPS_MEASURED`` steps (or at the end of a shorter fit)."""

    def report(self) -> str:
        """``zero_auto zero2: predicted peak 11.2 GiB, measured 10.9 GiB (+3%) ...``."""
        assert self.measured is not None
        return self.choice.report(self.measured)


def check_auto(memory_budget: Optional[Union[str, float]], options: dict[str, Any]) -> Optional[float]:
    """``memory_budget`` in bytes, checked with the options it goes with (none that ``zero_auto`` chooses)."""
    chosen = [name for name in CHOSEN_OPTIONS if options.get(name)]
    if chosen:
        raise ValueError(
            f"`{chosen[0]}` is chosen by `zero_auto` itself (zero3 with offload comes last, where "
            "nothing else fits); to set it, pick the stage too (`strategy='zero3'`)."
        )
    return resolve_budget(memory_budget)


def choose_at_setup(
    trainer: "pl.Trainer",
    module: torch.nn.Module,
    precision: ZeroPrecision,
    config: ZeroConfig,
    budget: Optional[float],
    agree: Callable[[float, str], float],
    ranks: tuple[int, int],
) -> AutoRun:
    """Start the peak meter, probe the first micro-batch and choose (see [Note: the predicted peak]).

    ``ranks``: the world size and the ranks of this node. ``agree(x, op)``: the ``"min"`` or ``"max"`` of a number
    over the ranks. Every rank must choose the same configuration, from the same facts: the default budget is read on
    each rank at its own moment, so the ranks choose from the smallest of them, and each rank probes its own first
    micro-batch, so they take the largest activation peak (a rank without a batch measures nothing).
    """
    device = trainer.strategy.root_device
    meter = PeakMeter(device, held_bytes(module))
    facts = model_facts(
        module, first_batch(trainer), precision.mode, config, device, accumulates=trainer.accumulate_grad_batches > 1
    )
    facts = replace(facts, activation_bytes=int(agree(facts.activation_bytes, "max")), first_run=not _RUNS)
    _RUNS.append(True)
    world_size, local_ranks = ranks
    limit = agree(budget if budget is not None else default_budget(device, local_ranks), "min")
    choice = choose(facts, world_size, precision.mode.precision, config, limit, on_host=device.type == "cpu")
    return AutoRun(choice, meter)


def first_batch(trainer: "pl.Trainer") -> Optional[Any]:
    """The first micro-batch of this rank's training data, as the fit loop will see it before the transfer to the
    device; ``None`` when this rank has none."""
    loader = _request_dataloader(trainer.fit_loop._data_source)
    batch, _, _ = next(iter(CombinedLoader(loader, "max_size_cycle")), (None, 0, 0))
    return batch


class ZeroAutoStrategy(ZeroStrategy):
    """``strategy="zero_auto"``: ZeRO whose stage and offload are chosen at the setup of each ``fit`` from the memory
    budget, the least costly of zero1, zero2, zero3, zero3 with ``offload_optimizer``, zero3 with ``offload_params``
    whose predicted peak fits (see ``docs/zero_auto.md``); outside ``fit``, zero3.

    [Note: zero_auto records as zero3]
    The configuration is chosen at setup, from the model ``configure_model`` built and the first micro-batch, but
    ``configure_model`` runs before setup. So until the choice the strategy is zero3: a model built there (or under
    ``trainer.init_module(empty_init=True)``) is recorded on the meta device and costs nothing, whatever its size;
    a choice of stage 1 or 2 then builds it whole, with the values eager construction gives, a choice of stage 3
    replays it unit by unit. Outside ``fit`` (no optimizer, nothing to choose for) it stays zero3.

    Args:
        memory_budget: bytes per rank, a size such as ``"20GiB"`` or a number; ``None``: the device's free memory
            (CPU: the host's available memory shared among this node's ranks) less 10%.
        **kwargs: ``ZeroStrategy``'s other arguments and ``ZeroConfig``'s fields, less ``stage`` and the
            ``CHOSEN_OPTIONS``.
    """

    def __init__(self, memory_budget: Optional[Union[str, float]] = None, **kwargs: Any) -> None:
        if "stage" in kwargs:
            raise ValueError(
                f"`ZeroAutoStrategy` chooses the stage itself: leave `stage` out, got {kwargs['stage']!r}."
            )
        self._auto_budget = check_auto(memory_budget, kwargs)
        """The budget in bytes per rank; ``None``: from the device's free memory at each setup."""
        self._auto: Optional[AutoRun] = None
        """The choice of the last setup of ``fit``, and the peak measured after it."""
        super().__init__(AUTO_UNTIL_SETUP, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``zero_auto`` and its ``_spawn`` / ``_fork`` variants (``ZeroStrategy`` registers the fixed stages)."""
        for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
            strategy_registry.register(
                f"zero_auto{suffix}",
                cls,
                override=True,
                start_method=start_method,
                description="ZeRO, the stage and offload chosen at setup from the memory budget, start "
                f"method '{start_method}'",
            )

    @property
    def auto_run(self) -> Optional[AutoRun]:
        """The last choice (``.choice``, with every prediction) and the measured peak (``.measured``); ``None``
        before the first ``fit``."""
        return self._auto

    @override
    def _configure_fit(self, trainer: "pl.Trainer") -> None:
        """Pick the configuration for this fit (see ``docs/zero_auto.md``); a model recorded on the meta device is
        built whole for stages 1 and 2."""
        assert self.lightning_module is not None
        self._auto = choose_at_setup(
            trainer,
            self.lightning_module,
            self.precision_plugin,
            self.config,
            self._auto_budget,
            lambda x, op: float(self.reduce(torch.tensor(x, dtype=torch.float64), reduce_op=op)),
            (self.world_size, self.num_processes),
        )
        self.config = self._auto.choice.chosen.candidate.apply(self.config)
        self.policy = policy_for(self.config.stage)
        if not self.policy.shards_params:
            build_whole(self.lightning_module, self.root_device, self._take_recording())
        rank_zero_info(self._auto.choice.line())

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """After the first steps, the measured peak next to the predicted one."""
        super().on_train_batch_start(batch, batch_idx)
        if (
            self._auto is not None
            and self._auto.measured is None
            and self.lightning_module is not None
            and (self.lightning_module.trainer.global_step >= STEPS_MEASURED)
        ):
            self._measure_peak()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._auto is not None and self._auto.measured is None:
            self._measure_peak()

    def _measure_peak(self) -> None:
        assert self._auto is not None
        peak = torch.tensor(float(self._auto.meter.peak()))
        self._auto.measured = int(self.reduce(peak, reduce_op="max"))
        rank_zero_info(self._auto.report())

    @override
    def teardown(self) -> None:
        """As ``ZeroStrategy``'s; the next fit chooses again, recording ``configure_model`` as zero3 until then."""
        try:
            super().teardown()
        finally:
            self.config = replace(self.config, stage=AUTO_UNTIL_SETUP, offload_optimizer=False, offload_params=False)
            self.policy = policy_for(AUTO_UNTIL_SETUP)
