"""What the multi-rank tests compare: relative differences of tensors, and collective payload per optimizer step."""

from __future__ import annotations

from typing import Any, Optional

import torch


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / |expected|`` in float64 (norms over all elements)."""
    expected = torch.as_tensor(expected, dtype=torch.float64)
    return float((torch.as_tensor(actual, dtype=torch.float64) - expected).norm() / expected.norm().clamp_min(1e-12))


def assert_losses_close(actual: list[float], expected: list[float], rtol: float) -> None:
    """Fail unless both runs logged the same (non-zero) number of losses and each step's loss is within ``rtol`` of
    the reference's, relative to the reference."""
    assert len(actual) == len(expected) > 0, f"{len(actual)} losses vs {len(expected)} in the reference"
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rtol * abs(e), f"step {step}: loss {a} vs reference {e}"


def assert_params_close(actual: dict[Any, Any], expected: dict[Any, Any], rtol: float) -> None:
    """Fail unless ``actual`` has exactly the keys of ``expected`` and every tensor's :func:`relative` difference
    from the reference's is at most ``rtol`` (``0.0``: equal)."""
    assert actual.keys() == expected.keys(), f"keys differ: {sorted(map(str, actual.keys() ^ expected.keys()))}"
    for name, e in expected.items():
        err = relative(actual[name], e)
        assert err <= rtol, f"{name}: relative difference {err:.2e} > {rtol:.0e}"


BF16_ROUNDOFF = 2.0**-8
"""Unit roundoff of bfloat16 (8 significant bits): rounding moves a value by at most this much, relative."""
FP16_ROUNDOFF = 2.0**-11
"""Unit roundoff of float16 (11 significant bits)."""


def mixed_precision_rtol(steps: int, roundoff: float = BF16_ROUNDOFF) -> float:
    """The bound on the relative difference, per tensor, between the fp32 weights a mixed-precision ZeRO run ends
    with and those of DDP under autocast, after ``steps`` optimizer steps from the same weights on the same data.

    [Note: the mixed-precision bound on parameters]
    Both runs step fp32 master weights with the same optimizer; they differ only in what the forward and backward
    see. ZeRO computes from 16-bit working copies of the masters (each within ``roundoff`` of its master, relative)
    and reduces 16-bit gradients, where DDP's autocast rounds the same weights at the matmuls only and reduces in
    fp32. So each step's gradient is that of weights within one rounding of the master's, and the step moves each
    weight off DDP's trajectory by at most about one rounding of itself (``roundoff`` relative); nothing pulls the
    runs back together, so over ``steps`` steps the differences add up to at most ``steps * roundoff``. A working
    copy that misses one step's update (a copy-back bug) is off by a whole update instead, which at the tests'
    learning rate (1e-2) is several roundings: the gradients of the following steps then carry that error.
    Measured (AdamW, 6 steps, 2 and 3 ranks, ``test_parity.py``): at most 1.6e-2 per tensor against the bound's
    2.3e-2, and 6.1e-2 with the copy-back of step 3 left out. Per tensor the model is optimistic where Adam meets
    near-zero gradients in small tensors (biases, a position table) under clipping by norm or against an fp32
    reference: those exceed it up to 2.5x, so ``test_offload.py``, ``test_fabric.py`` and
    ``test_tensor_parallel.py`` hold all the weights together to it (:func:`assert_model_close`; measured 1.6e-3
    to 3.2e-3 against bounds of 1.2e-2 to 1.6e-2), which a missed copy-back of a single step does not reach.
    """
    return steps * roundoff


def assert_model_close(actual: dict[Any, Any], expected: dict[Any, Any], rtol: float) -> None:
    """Fail unless ``actual`` has exactly the keys of ``expected`` and all its tensors together (one vector) are
    within ``rtol`` of the reference's, relative (:func:`relative` of the concatenations)."""
    assert actual.keys() == expected.keys(), f"keys differ: {sorted(map(str, actual.keys() ^ expected.keys()))}"
    err = relative(torch.cat([actual[k].reshape(-1).double() for k in expected]),
                   torch.cat([expected[k].reshape(-1).double() for k in expected]))
    assert err <= rtol, f"the weights differ by {err:.2e} relative (all tensors together) > {rtol:.2e}"


def shard_of(layout: Any, flat: torch.Tensor, rank: int) -> torch.Tensor:
    """``rank``'s shard of the flat buffer ``flat`` laid out by ``layout`` (a ``FlatLayout``): its chunk of every
    bucket, at the bucket's ``shard_offset``; computed from the buckets' starts and chunk sizes alone."""
    shard = torch.empty(layout.shard_size, dtype=flat.dtype)
    for bucket in layout.buckets:
        start = bucket.start + rank * bucket.chunk_size
        shard[bucket.shard_offset : bucket.shard_offset + bucket.chunk_size] = flat[start : start + bucket.chunk_size]
    return shard


def traffic_per_step(batches: list[dict[str, Any]], micro: int) -> list[dict[str, dict[str, int]]]:
    """``strategy.traffic.snapshot()`` of every training batch summed over the ``micro`` batches of each optimizer step:
    elements per scope and collective kind."""
    steps = []
    for start in range(0, len(batches) - micro + 1, micro):
        scopes: dict[str, dict[str, int]] = {}
        for batch in batches[start : start + micro]:
            for scope, kinds in batch["scopes"].items():
                for kind, n in kinds.items():
                    scopes.setdefault(scope, {}).setdefault(kind, 0)
                    scopes[scope][kind] += n
        steps.append(scopes)
    return steps


def last_unit(strategy: Any) -> Optional[int]:
    """The stage 3 unit a training forward runs last, read from ``strategy.runtime`` while set up (``on_train_end``);
    ``None`` without stage 3. That unit stays gathered into backward, which does not gather it again (see [Note: the
    last unit stays gathered into backward] in ``stage3/units.py``)."""
    runtime = getattr(strategy, "runtime", None)
    return runtime.forward_order[-1] if runtime is not None and runtime.forward_order else None


def last_unit_elements(strategy: Any) -> int:
    """Elements (padded) of :func:`last_unit`; 0 without stage 3."""
    unit = last_unit(strategy)
    return 0 if unit is None else strategy.runtime.units[unit].numel


def backwards_keeping_the_last_unit(step: int, micro: int) -> int:
    """Backwards of optimizer step ``step`` (from 0, of ``micro`` micro-batches) that find the last unit still
    gathered: all but the run's very first, whose forward ran before the order of the units was known."""
    return micro - 1 if step == 0 else micro


def displacement_errors(actual: dict[Any, Any], expected: dict[Any, Any],
                        initial: dict[Any, Any]) -> dict[Any, float]:
    """Per tensor, ``|actual - expected| / |expected - initial|`` in float64: how far a run ends from the reference
    measured against how far the reference moved from the common starting weights ``initial``."""
    assert actual.keys() == expected.keys() == initial.keys(), "the runs and the initial weights name other tensors"
    errors = {}
    for name, e in expected.items():
        e64, w0 = torch.as_tensor(e, dtype=torch.float64), torch.as_tensor(initial[name], dtype=torch.float64)
        moved = (e64 - w0).norm().clamp_min(1e-12)
        errors[name] = float((torch.as_tensor(actual[name], dtype=torch.float64) - e64).norm() / moved)
    return errors


BF16_DISPLACEMENT_RTOL = 16 * BF16_ROUNDOFF
"""The bound of :func:`assert_displacements_close` for bf16-mixed runs of 4 AdamW steps against DDP under autocast.

[Note: the bf16 bound on displacements]
Held to the weights' norms (:func:`mixed_precision_rtol`), a tensor whose weights barely move hides a whole missed
update: at lr 1e-2 the update is about 1e-2 of the weight, inside the bound of a few steps of bf16 rounding. Held to
how far the tensor moved instead, the rounding and the missed update differ by their own sizes: each step's update
in ZeRO and in DDP comes from gradients that differ by bf16 rounding (16-bit reductions, norms and losses where
DDP's autocast keeps fp32), a few ``BF16_ROUNDOFF`` of the gradient. Adam's update divides by the gradient's running
scale, so that relative error passes to the update mostly unchanged except where a gradient element is near zero and
its sign turns, which is why the constant is an allowance of 16 roundings and not a derivation: measured on
``test_offload.py``'s bf16 scenario (4 steps, 2 ranks), 3.5e-2 at most per tensor (``head.weight``) on healthy runs
against the bound's 6.25e-2, and 9.1e-2 (``blocks.1.0.weight``) with the working copy missing the update of step 3.
"""


def assert_displacements_close(actual: dict[Any, Any], expected: dict[Any, Any], initial: dict[Any, Any],
                               rtol: float) -> None:
    """Fail unless every tensor's :func:`displacement_errors` entry is at most ``rtol``."""
    errors = displacement_errors(actual, expected, initial)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= rtol, (f"{worst}: ends {errors[worst]:.2e} of its displacement away from the reference's "
                                   f"(> {rtol:.2e}); every tensor: {errors}")
