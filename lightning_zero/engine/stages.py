"""One small policy object per ZeRO stage.

The rest of the package asks a policy questions (``shards_grads``, ``shards_params``) instead of comparing stage
numbers, so adding a stage means adding a policy, not editing ``if stage == ...`` branches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    """What one ZeRO stage partitions across the data-parallel ranks."""

    stage: int
    """The stage number, for messages and checkpoints."""
    shards_optimizer_states: bool
    """Each rank keeps the fp32 master weights and optimizer states of its shard only."""
    shards_grads: bool
    """Gradients are reduce-scattered into per-rank shards during backward and the full ``.grad`` is released."""
    shards_params: bool
    """Parameters are kept as shards and gathered around their use (stage 3)."""

    @property
    def name(self) -> str:
        """The registered strategy name, e.g. ``"zero2"``."""
        return f"zero{self.stage}"


_POLICIES = {
    1: StagePolicy(stage=1, shards_optimizer_states=True, shards_grads=False, shards_params=False),
    2: StagePolicy(stage=2, shards_optimizer_states=True, shards_grads=True, shards_params=False),
    3: StagePolicy(stage=3, shards_optimizer_states=True, shards_grads=True, shards_params=True),
}


def policy_for(stage: int) -> StagePolicy:
    """Return the policy of ``stage``; the stage number must already be validated by :class:`ZeroConfig`."""
    return _POLICIES[stage]
