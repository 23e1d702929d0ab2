"""``zero_auto``'s choice: the candidate configurations in order of cost, the peak each is predicted to reach per
rank, and the first that fits the budget.

[Note: the predicted peak]
A candidate's peak per rank is what stays for the whole run plus the larger of the two moments of a step:
- what stays: the model states docs/stages.md's table gives for the stage and precision (``expected_model_state_bytes``;
  with offload ``expected_offload_bytes``: the device part where the budget is a GPU's, device and host together on
  CPU, where the device *is* the host, so that offloading there saves nothing and is never chosen for memory), with
  the gradients the engine holds between steps: the gradient shard (Ψ/N, kept from step to step), at stage 1 under
  gradient accumulation the full ``.grad`` (Ψ) instead (see [Note: stage 1 reduces in the backward the step
  follows] in ``shards/store.py``); the module's buffers, held whole by every rank; the engine's own buffers from its
  plan, kept from step to step too: ``bucket_buffers`` gradient buckets of the bucket size and, at stage 3, the pool
  of gathered units (the root unit, the largest unit and up to ``prefetch_size`` elements of the units ahead);
- the activations' moment: the peak of the activation probe, at the end of forward and the start of backward (see
  [Note: the activation probe] in ``probe.py``);
- the step's moment: the optimizer step's temporaries, one tensor the size of the rank's master shard (the foreach
  kernels of Adam make one, ``exp_avg_sq.sqrt()``) and, in the mixed precisions, the master gradient (the 16-bit
  gradient shard made fp32 for the step: one more); the activations are gone by then.
On CPU, the first run of a process adds ``FIRST_RUN_BYTES``: what its resident memory grows by once, whatever
the configuration and the model (the threads' stacks and heaps, the collectives' transport, the first use of the
kernels), measured with ``benchmarks/auto.py`` as the cold fit's peak less the same fit's peak run again in the same
process: 27 to 30 MiB per rank on the GPT at 5.3M and 18.2M parameters, fp32 and bf16-mixed (torch 2.13, gloo, two
ranks on two cores; 36 to 43 MiB before the engine gave back its setup's free heap, see ``give_back_free_heap`` in
``memory/host_memory.py``). It is a constant of the machine and the framework, not of the model: on another host it is a
guess, which the margin of the default budget covers (see [Note: the default budget] in ``budget.py``). A GPU's
``max_memory_allocated`` does not see it.

[Note: the headroom]
A candidate fits when its predicted peak plus ``HEADROOM`` of it is within the budget: the measured peak falls
within about 10% of the prediction either way (what the allocator does with the holes a step leaves, e.g. on CPU the
heap pin of stages 1 and 2 lets a later forward's activations land above it: +5 to +8% at 5.3M parameters), and a
budget is a limit the run must stay under, so the choice errs on the side of the cheaper-in-memory candidate. Every
"would need" and the smallest budget of the refusal include the headroom.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_zero.config import ZeroConfig
from lightning_zero.shards.accounting import (
    BYTES_PER_PARAM,
    MASTER_BYTES,
    expected_model_state_bytes,
    expected_offload_bytes,
    human_bytes,
)


@dataclass(frozen=True)
class Candidate:
    """One configuration ``zero_auto`` may pick."""

    stage: int
    offload_optimizer: bool = False
    offload_params: bool = False

    @property
    def name(self) -> str:
        """``"zero2"``, ``"zero3+offload_optimizer"``, ``"zero3+offload_params"``."""
        extra = "+offload_params" if self.offload_params else "+offload_optimizer" if self.offload_optimizer else ""
        return f"zero{self.stage}{extra}"

    def apply(self, config: ZeroConfig) -> ZeroConfig:
        """``config`` with this candidate's stage and offload options."""
        return replace(
            config, stage=self.stage, offload_optimizer=self.offload_optimizer, offload_params=self.offload_params
        )


#: The candidates in the order ``zero_auto`` tries them: least traffic and time first.
CANDIDATES = (
    Candidate(1),
    Candidate(2),
    Candidate(3),
    Candidate(3, offload_optimizer=True),
    Candidate(3, offload_optimizer=True, offload_params=True),
)


#: What a process's resident memory grows by once, in its first run on CPU (see [Note: the predicted peak]).
FIRST_RUN_BYTES = 28 * 2**20

#: The share of a predicted peak kept free in the budget (see [Note: the headroom]).
HEADROOM = 0.10


@dataclass(frozen=True)
class ModelFacts:
    """What the prediction needs to know of one model on one rank (see [Note: the predicted peak])."""

    num_params: int
    """Trainable parameters, Ψ."""
    buffer_bytes: int
    """The module's buffers."""
    root_elements: int
    """Stage 3: elements of the root unit (gathered for the whole step)."""
    unit_elements: tuple[int, ...]
    """Stage 3: elements of every other unit."""
    activation_bytes: int
    """The activation probe's peak."""
    accumulates: bool = False
    """Gradients are accumulated over micro-batches (``accumulate_grad_batches > 1``)."""
    first_run: bool = False
    """The first run of this process on CPU (see ``FIRST_RUN_BYTES``)."""


@dataclass(frozen=True)
class Prediction:
    """The predicted peak of one candidate, by part."""

    candidate: Candidate
    model_states: float
    """The model states, with the gradients the engine holds between steps."""
    grads: float
    """Of them, the gradients."""
    buffers: float
    """The module's buffers."""
    pool: float
    """Stage 3's gathered units."""
    buckets: float
    activations: float
    step: float
    runtime: float = 0.0
    """What the process grows by once (``FIRST_RUN_BYTES``), or 0."""

    @property
    def peak(self) -> float:
        """Bytes per rank at the peak of a step (see [Note: the predicted peak])."""
        return (
            self.model_states
            + self.buffers
            + self.pool
            + self.buckets
            + max(self.activations, self.step)
            + self.runtime
        )

    @property
    def needs(self) -> float:
        """The budget this candidate needs: its peak and the headroom (see [Note: the headroom])."""
        return self.peak * (1 + HEADROOM)


def predict(
    candidate: Candidate, facts: ModelFacts, world_size: int, precision: str, config: ZeroConfig, on_host: bool
) -> Prediction:
    """The peak ``candidate`` reaches per rank (see [Note: the predicted peak]); ``on_host``: the device is the CPU,
    so offloaded bytes stay in the budget."""
    psi, n, stage = facts.num_params, world_size, candidate.stage
    _, grad_b, _ = BYTES_PER_PARAM.get(precision, BYTES_PER_PARAM["32-true"])
    param_b = BYTES_PER_PARAM.get(precision, BYTES_PER_PARAM["32-true"])[0]
    if candidate.offload_optimizer:  # the gradient shard is the host's, with the master and the step
        device, host = expected_offload_bytes(psi, n, stage, precision, True, candidate.offload_params)
        states, grads = device + (host if on_host else 0.0), 0.0
        step = _step_bytes(psi, n, precision) if on_host else 0.0
    else:
        table_grads = grad_b * psi / (1 if stage == 1 else n)
        grads = grad_b * psi / (1 if stage == 1 and facts.accumulates else n)
        states = expected_model_state_bytes(psi, n, stage, precision) - table_grads + grads
        step = _step_bytes(psi, n, precision)
    buckets = float(config.bucket_buffers * config.bucket_elements(psi) * grad_b)
    pool = 0.0
    if stage == 3:
        units = sorted(facts.unit_elements, reverse=True)
        largest = units[0] if units else 0
        ahead = min(config.prefetch_size, sum(units[1:]))
        pool = float((facts.root_elements + largest + ahead) * param_b)
    return Prediction(
        candidate,
        states,
        grads,
        float(facts.buffer_bytes),
        pool,
        buckets,
        float(facts.activation_bytes),
        step,
        FIRST_RUN_BYTES if facts.first_run and on_host else 0.0,
    )


def _step_bytes(psi: int, world_size: int, precision: str) -> float:
    """The optimizer step's temporaries per rank (see [Note: the predicted peak])."""
    master = MASTER_BYTES.get(precision, 4) * psi / world_size
    return 2 * master if precision in ("bf16-mixed", "16-mixed") else master


@dataclass(frozen=True)
class Choice:
    """The candidate chosen, the budget, and the prediction of every candidate."""

    chosen: Prediction
    budget: float
    predictions: tuple[Prediction, ...]
    """Every candidate's, in the order of ``CANDIDATES``."""

    def by_name(self) -> dict[str, float]:
        """``{candidate name: predicted peak}`` of every candidate."""
        return {p.candidate.name: p.peak for p in self.predictions}

    def line(self, verb: str = "chose") -> str:
        """The one-line reason: ``zero2: predicted peak 11.2 GiB of 12.0 GiB; zero1 would need 14.9 GiB``."""
        text = (
            f"zero_auto {verb} {self.chosen.candidate.name}: predicted peak {human_bytes(self.chosen.peak)} of "
            f"{human_bytes(self.budget)} per rank"
        )
        cheaper = list(self.predictions[: self.predictions.index(self.chosen)])
        if cheaper:
            text += "; " + ", ".join(f"{p.candidate.name} would need {human_bytes(p.needs)}" for p in cheaper)
        c = self.chosen
        # the model states by part: the summary line's "model states" is ZeRO's table, whose gradients are those of a
        # backward in progress (stage 1: all of them); here the gradients are those the engine holds between steps
        parts = {
            "parameters and optimizer states": c.model_states - c.grads,
            "gradients held between steps": c.grads,
            "activations": c.activations,
            "gathered units": c.pool,
            "gradient buckets": c.buckets,
            "optimizer step": c.step,
            "first run of the process": c.runtime,
            "module buffers": c.buffers,
        }
        return text + " (" + ", ".join(f"{name} {human_bytes(value)}" for name, value in parts.items() if value) + ")"

    def report(self, measured: float) -> str:
        """The prediction against the ``measured`` peak: ``zero_auto zero2: predicted peak 11.2 GiB, measured
        10.9 GiB (+3%) of 12.0 GiB per rank``."""
        predicted = self.chosen.peak
        return (
            f"zero_auto {self.chosen.candidate.name}: predicted peak {human_bytes(predicted)}, measured "
            f"{human_bytes(measured)} ({(predicted - measured) / measured:+.0%}) of {human_bytes(self.budget)} "
            "per rank"
        )


class BudgetTooSmall(ValueError):
    """No candidate fits the memory budget."""


def choose(
    facts: ModelFacts, world_size: int, precision: str, config: ZeroConfig, budget: float, on_host: bool
) -> Choice:
    """The first candidate of ``CANDIDATES`` whose predicted peak fits ``budget``; raises
    ``BudgetTooSmall``, naming the smallest budget that would fit, when none does."""
    predictions = tuple(predict(candidate, facts, world_size, precision, config, on_host) for candidate in CANDIDATES)
    for prediction in predictions:
        if prediction.needs <= budget:
            return Choice(prediction, budget, predictions)
    smallest = min(predictions, key=lambda p: p.needs)
    raise BudgetTooSmall(
        f"zero_auto: no configuration fits the memory budget of {human_bytes(budget)} per rank; the smallest, "
        f"{smallest.candidate.name}, needs {human_bytes(smallest.needs)} with {HEADROOM:.0%} headroom (activations "
        f"{human_bytes(facts.activation_bytes)}"
        f" of it): set `memory_budget` to at least {human_bytes(smallest.needs)}, add ranks, or make the micro-batch "
        "smaller."
    )
