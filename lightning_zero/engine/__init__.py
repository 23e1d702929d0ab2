"""The orchestrator: ``ZeroEngine`` composes the shards, stage 3, ZeRO-R and the
checkpoints into one training step, without Lightning (``engine.py``: the whole engine, step and checkpoints
included; ``state.py``: the checkpoint format it writes and reads; ``module_state.py``: the set-up module's own
``state_dict``/``load_state_dict``; ``summary.py``: its one-line summary); ``amp.py`` is its numerics (precision
modes, loss scaling, clipping over shards); ``construction.py`` builds a model for stage 3 without holding it whole;
``auto/`` chooses a configuration from the memory budget. Imports: every folder below it, never ``lightning/`` and
never Lightning; nothing in it but the package's ``__init__`` and the adapters imports ``engine.py``.
"""
