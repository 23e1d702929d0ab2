"""What the multi-rank tests compare: relative differences of tensors, and collective payload per optimizer step."""

from __future__ import annotations

from typing import Any

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
