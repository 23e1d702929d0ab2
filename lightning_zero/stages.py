"""One policy object per ZeRO stage, and the one list of stages.

The rest of the package asks a policy questions (``reduces_in_backward``, ``shards_params``, ``grad_hooks_at_setup``)
instead of comparing stage numbers or combining flags, so adding a stage means adding a policy here. Every list of
stages (the options' check, the registered strategy names, the memory table, the estimate) comes from
``STAGES``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    """What one ZeRO stage partitions across the data-parallel ranks, and what follows from it."""

    stage: int
    """The stage number, for messages and checkpoints."""
    partitions: str
    """What it partitions, in words (help texts)."""
    reduces_in_backward: bool
    """Gradients are reduce-scattered into per-rank shards as backward produces them and the full ``.grad`` is
    released (every stage, in the backward an optimizer step follows)."""
    holds_grads_when_accumulating: bool
    """Inside ``no_backward_sync`` (gradient accumulation) the full gradients stay in ``.grad`` and are reduced in the
    backward the step follows (stage 1: one reduce-scatter per step); stages 2 and 3 reduce every backward into the
    gradient shard, which is what keeps their gradients at 1/N."""
    shards_params: bool
    """Parameters are kept as shards and gathered around their use (stage 3)."""

    @property
    def name(self) -> str:
        """The registered strategy name, e.g. ``"zero2"``."""
        return f"zero{self.stage}"

    @property
    def grad_hooks_at_setup(self) -> bool:
        """Whether the gradient hooks go on when the optimizer is set up: stages 1 and 2. Stage 3 installs them once
        its parameters are materialized (materialization swaps tensors, hooks and all)."""
        return self.reduces_in_backward and not self.shards_params


_POLICIES = {
    1: StagePolicy(
        stage=1,
        partitions="optimizer states",
        reduces_in_backward=True,
        holds_grads_when_accumulating=True,
        shards_params=False,
    ),
    2: StagePolicy(
        stage=2,
        partitions="optimizer states and gradients",
        reduces_in_backward=True,
        holds_grads_when_accumulating=False,
        shards_params=False,
    ),
    3: StagePolicy(
        stage=3,
        partitions="optimizer states, gradients and parameters",
        reduces_in_backward=True,
        holds_grads_when_accumulating=False,
        shards_params=True,
    ),
}

#: The stages this version implements.
STAGES: tuple[int, ...] = tuple(_POLICIES)


def policy_for(stage: int) -> StagePolicy:
    """Return the policy of ``stage``; the stage number must already be validated by ``ZeroConfig``."""
    return _POLICIES[stage]


def all_policies() -> tuple[StagePolicy, ...]:
    """Every stage's policy, in stage order."""
    return tuple(_POLICIES.values())
