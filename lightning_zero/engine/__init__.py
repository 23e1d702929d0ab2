"""The orchestrator: :class:`~lightning_zero.engine.engine.ZeroEngine` composes the primitives of ``core/``, stage 3
and the checkpoints into one training step; ``processes.py`` is what the Trainer's and Fabric's strategies share."""
