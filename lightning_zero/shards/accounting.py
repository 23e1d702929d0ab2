"""Per-rank model-state accounting, measured from live tensors, and the paper's expected figures.

[Note: what is counted]
Every tensor is counted once per storage, so views of one flat buffer (the working parameters) or a master shard
that aliases the working buffer are not counted twice. ``grads`` covers full ``.grad`` tensors, the gradient shard
and any master gradients alive at the moment of measurement; ``comm_buffers`` (the constant-size buckets, their
high-water mark) are kept apart from the model states, as in docs/stages.md's table.
With ``offload_optimizer``, ``host`` says how many of the model-state bytes are in host memory (the master shard,
the gradient shard, which then exists only there, and the optimizer states), with ``offload_params`` also stage 3's
working shard; the rest are on the device. The scratch chunks the reduced gradients pass through on their way to
the host are bucket buffers (``comm_buffers``), not model states.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.shards.optimizer import ShardedOptimizer
from lightning_zero.shards.policy import Tier
from lightning_zero.stages import STAGES

#: (working parameter, gradient, master + Adam states) bytes per parameter, by precision.
BYTES_PER_PARAM = {"32-true": (4, 4, 8), "bf16-mixed": (2, 2, 12), "16-mixed": (2, 2, 12), "bf16-true": (2, 2, 4)}
#: Bytes of one master weight, and the precisions whose masters are the working parameters (without offload).
MASTER_BYTES = {"32-true": 4, "bf16-mixed": 4, "16-mixed": 4, "bf16-true": 2}
ALIASED_MASTERS = ("32-true", "bf16-true")


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes this rank holds, by kind."""

    params: int
    """Working parameters (flat buffers and parameters no optimizer manages)."""
    grads: int
    master: int
    """Master weights that do not alias the working parameters."""
    optimizer_states: int
    buffers: int
    """The module's buffers (running statistics ...)."""
    comm_buffers: int
    """Gradient bucket buffers: constant, independent of the model size."""
    host: int = 0
    """Of the model states, the bytes in host memory (``offload_optimizer``); the others are on the device."""

    @property
    def model_states(self) -> int:
        """Parameters + gradients + master weights + optimizer states: the paper's "model states"."""
        return self.params + self.grads + self.master + self.optimizer_states

    @property
    def device_model_states(self) -> int:
        """The model states held on the device (all of them unless the optimizer is offloaded)."""
        return self.model_states - self.host

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "model_states": self.model_states, "device_model_states": self.device_model_states}


class _Counter:
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def bytes(self, tensors: Iterable[Optional[Tensor]]) -> int:
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, Tensor) or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in self.seen:
                continue
            self.seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total


def measure_model_states(module: torch.nn.Module, optimizers: Sequence[Optimizer]) -> ModelStateBytes:
    """Measure what this rank holds right now (see [Note: what is counted]).

    Works for any strategy: pass ``trainer.optimizers``; optimizers set up by ZeRO also report their shards.
    """
    optimizers = [getattr(opt, "_optimizer", opt) for opt in optimizers]  # unwrap LightningOptimizer
    sharded: list[ShardedOptimizer] = [s for s in (getattr(o, "_zero_sharded", None) for o in optimizers) if s]
    storages = [s.storage for s in sharded]
    counter = _Counter()
    master = counter.bytes(e.master_storage for e in storages)
    params = counter.bytes([p for p in module.parameters()] + [e.working_shard for e in storages])
    host_grads = [e.host_grads.buffer for e in storages if e.host_grads is not None]
    grads = counter.bytes(
        [p.grad for p in module.parameters()]
        + [e.reducer.grad_shard for e in storages]
        + [m.grad for s in sharded for m in s.masters]
        + host_grads
    )
    states = counter.bytes(
        v for o in optimizers for st in o.state.values() for v in st.values() if isinstance(v, Tensor)
    )
    buffers = counter.bytes(module.buffers())
    comm = sum(max(e.reducer.buffer_bytes, e.reducer.peak_buffer_bytes) for e in storages)  # freed before a step
    offloaded = [s for s in sharded if s.storage.host_grads is not None]
    host_shards = [e.working_shard for e in storages if e.params_offloaded]
    host = _Counter().bytes(
        [s.storage.master_storage for s in offloaded]
        + host_grads
        + host_shards
        + [v for s in offloaded for st in s.optimizer.state.values() for v in st.values() if isinstance(v, Tensor)]
    )
    return ModelStateBytes(params, grads, master, states, buffers, comm, host)


def expected_model_state_bytes(num_params: int, world_size: int, stage: int, precision: str) -> float:
    """The table in docs/stages.md for Adam: bytes of model states per rank (``stage=0`` is DDP).

    Mixed precision: 2Ψ params + 2Ψ grads + 12Ψ fp32 master/momentum/variance. ``32-true``: 4Ψ + 4Ψ + 8Ψ, the fp32
    parameters doubling as the master weights. ``bf16-true``: 2Ψ + 2Ψ + 4Ψ (bf16 momentum and variance).
    """
    psi, n = float(num_params), float(world_size)
    param_b, grad_b, opt_b = BYTES_PER_PARAM.get(precision, BYTES_PER_PARAM["32-true"])
    if stage == 0:
        return (param_b + grad_b + opt_b) * psi
    if stage == 1:
        return (param_b + grad_b) * psi + opt_b * psi / n
    if stage == 2:
        return param_b * psi + (grad_b + opt_b) * psi / n
    if stage == 3:
        return (param_b + grad_b + opt_b) * psi / n
    raise ValueError(f"No ZeRO stage {stage}; use 0 (DDP), 1, 2 or 3.")


def expected_offload_bytes(
    num_params: int,
    world_size: int,
    stage: int,
    precision: str,
    offload_optimizer: Tier = True,
    offload_params: Tier = False,
) -> tuple[float, float]:
    """``(device, host)`` bytes of model states per rank with ``offload_optimizer`` and/or ``offload_params`` (Adam).

    ``offload_optimizer`` (stages 1 to 3) moves to the host, all ``/N``: the master shard (a copy of its own even
    where it could alias the working parameters), Adam's two states and the host gradient buffer in the master
    dtype; mixed precision and ``32-true``: ``16Ψ/N``. The device keeps the working parameters (``/N`` at stage 3)
    and, at stage 1 only, the full ``.grad`` autograd leaves until the step: the reduced gradient shard exists only
    on the host (see [Note: the gradient shard goes to the host bucket by bucket] in ``offload.py``). ``offload_params``
    (stage 3) moves the working shard (``2Ψ/N`` mixed, ``4Ψ/N`` fp32) too, which leaves no model state on the device
    with both options (only the units in flight and the bucket buffers, constant in the model size); where it has the
    master's dtype and both are on the host it *is* the host master (no extra host bytes), and without
    ``offload_optimizer`` such a master stays on the device for the device's step.
    """
    if stage not in STAGES:
        raise ValueError(f"Offload needs a ZeRO stage {STAGES}, got {stage}.")
    if offload_params and stage != 3:
        raise ValueError(f"`offload_params` needs stage 3, got stage {stage}.")
    psi, n = float(num_params), float(world_size)
    param_b, grad_b, opt_b = BYTES_PER_PARAM.get(precision, BYTES_PER_PARAM["32-true"])
    if offload_optimizer:
        master_b = MASTER_BYTES.get(precision, 4)
        states_b = opt_b if precision in ALIASED_MASTERS else opt_b - master_b
        device = param_b * psi / (n if stage == 3 else 1) + (grad_b * psi if stage == 1 else 0.0)
        host = (states_b + 2 * master_b) * psi / n
    else:
        device, host = expected_model_state_bytes(num_params, world_size, stage, precision), 0.0
    if offload_params:
        aliased = precision in ALIASED_MASTERS  # the working shard is the master unless one side moved alone
        if offload_optimizer or not aliased:
            device -= param_b * psi / n
        if not (offload_optimizer and aliased):
            host += param_b * psi / n
    return device, host


def expected_disk_bytes(
    num_params: int, world_size: int, stage: int, precision: str, offload_params: bool = False
) -> tuple[float, float, float]:
    """``(device, host, disk)`` bytes of model states per rank with ``offload_optimizer="disk"`` and, with
    ``offload_params``, ``offload_params="disk"`` (Adam; see [Note: what lives on disk] in ``disk.py``).

    The master shard and Adam's states (``/N``) move from the host of ``expected_offload_bytes`` to the files;
    the gradient shard stays on the host; ``offload_params`` puts the working shard in a file too, where it is the
    master file itself when it has the master's dtype (no extra bytes). Files hold what a rank's memory does not:
    only the windows in flight are resident (constant in the model size).
    """
    device, host = expected_offload_bytes(num_params, world_size, stage, precision, True, offload_params)
    psi, n = float(num_params), float(world_size)
    param_b, _, opt_b = BYTES_PER_PARAM.get(precision, BYTES_PER_PARAM["32-true"])
    master_b = MASTER_BYTES.get(precision, 4)
    states_b = opt_b if precision in ALIASED_MASTERS else opt_b - master_b
    disk = (states_b + master_b) * psi / n
    host -= disk
    if offload_params and precision not in ALIASED_MASTERS:  # a working shard of its own: moved from the host
        host -= param_b * psi / n
        disk += param_b * psi / n
    return device, host, disk


def human_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def parse_bytes(text: str) -> float:
    """``"80GiB"``, ``"16GB"``, ``"512MiB"``, ``"4096B"``: a positive size with its unit.

    [Note: no bare numbers] ``--memory 32`` meant 32 GiB to the user who typed it and 32 bytes to the parser, which
    then printed a table of zeros. A unit is required (``B`` for bytes), so the two can never be confused.
    """
    units = {
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
        "b": 1,
    }
    lowered = text.strip().lower().replace("_", "")
    unit = next((u for u in sorted(units, key=len, reverse=True) if lowered.endswith(u)), None)
    value = number(lowered[: -len(unit)] if unit else lowered)
    if unit is None:
        hint = f" ({text.strip()}GiB or {text.strip()}GB?)" if value is not None else ""
        raise ValueError(
            f"{text!r} is not a size with a unit{hint}: write e.g. 80GiB, 16GB, 512MiB, or 4096B for bytes."
        )
    if value is None or not value > 0 or math.isinf(value):
        raise ValueError(f"{text!r} is not a positive size: write e.g. 80GiB, 16GB, 512MiB or 4096B.")
    return value * units[unit]


def number(text: str) -> Optional[float]:
    """``float(text)``, or ``None`` where it is not a number (NaN included)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isnan(value) else value
