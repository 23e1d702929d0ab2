"""One rank of a simulated world: what the engine changes when its process group is torch's fake one.

[Note: one rank of a simulated world]
torch's fake process group (``init_process_group("fake", rank=0, world_size=N)``) lets one process be rank 0 of a
world of any size: every collective is issued with its real sizes (so the counters of ``comm/traffic.py`` count what
rank 0 would send) and every buffer is allocated as on a real rank (so the memory is rank 0's), but nothing moves and
no output is written: what a rank *receives* is whatever its buffers held. Control flow that depends on received
values therefore stands aside, and says so once:

- stage 3's lockstep check compares the units every rank says it runs: the others' answers are not real;
- the non-finite guard (``nonfinite``) and ``16-mixed``'s overflow check read the gradients' global norm, summed from
  values that were never reduced;
- checkpoints agree on success across ranks and write files: a simulated rank writes nothing and refuses to save.

Options that need the disk (``offload_optimizer="disk"``, ``offload_params="disk"``) cannot be simulated: their
files would be written for real. The simulated rank's model states, buffers, gathered units and activations are
real allocations of the real sizes, which is what it is for (``lightning_zero.lightning.simulated`` measures them).
At teardown the full weights are not handed back: that would build the whole model in one process.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from lightning_zero.comm import collectives
from lightning_zero.config import ZeroConfig

#: The checks that compare values across ranks, which a simulated rank leaves out (see the Note above).
STANDING_ASIDE = (
    "stage 3's lockstep check",
    "the non-finite guard",
    "16-mixed's overflow check",
    "checkpoint agreement (nothing is saved)",
)


def simulated() -> bool:
    """Whether this process is one rank of a simulated world (torch's fake process group)."""
    return collectives.simulated()


def check_simulable(config: ZeroConfig) -> None:
    """Refuse options a simulated rank cannot run without writing files for real."""
    for name in ("offload_optimizer", "offload_params"):
        if getattr(config, name) == "disk":
            raise ValueError(
                f"`{name}='disk'` cannot be simulated (its files would be written for real): measure with "
                f"`{name}=True` (host memory) and add the disk tier's bytes from `lightning-zero estimate`."
            )


def stand_aside(config: ZeroConfig) -> ZeroConfig:
    """``config`` for a simulated rank: the checks across ranks off, once said on stderr (see [Note: one rank of a
    simulated world])."""
    check_simulable(config)
    warnings.warn(
        f"lightning-zero: rank 0 of a simulated world of {collectives.world_size()} ranks (torch's fake process "
        f"group): values received are not real, so {', '.join(STANDING_ASIDE)} stand aside.",
        UserWarning,
        stacklevel=3,
    )
    return replace(config, lockstep_check=False, nonfinite=None)


def refuse_to_save() -> None:
    """A simulated rank writes no checkpoint."""
    if simulated():
        raise RuntimeError(
            "A simulated rank (torch's fake process group) cannot save a checkpoint: the other ranks' shards do not "
            "exist. Measure without checkpointing (`enable_checkpointing=False`)."
        )
