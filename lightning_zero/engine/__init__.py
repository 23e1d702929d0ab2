"""The orchestrator: :class:`~lightning_zero.engine.engine.ZeroEngine` composes the shards, stage 3, ZeRO-R and the
checkpoints into one training step, without Lightning (``engine.py``, ``stepping.py``, ``state.py``); ``amp.py`` is
its numerics (precision modes, loss scaling, clipping over shards); ``construction.py`` builds a model for stage 3
without holding it whole; ``auto/`` chooses a configuration from the memory budget. Imports: every folder below it,
never ``lightning/`` and never Lightning.
"""
