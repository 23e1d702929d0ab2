"""ZeRO-R for activations: which blocks recompute in backward (``blocks.py`` finds them, stage 3 groups its
units by the same rule) and where their checkpoints live: partitioned across ranks, offloaded to the host
(``checkpointing.py``). Imports: ``shards/`` and below.
"""
