"""Which ranks talk to which, and everything they send: the only package that calls ``torch.distributed``'s
process-group API.

``collectives.py`` wraps every collective (and counts its bytes in ``traffic.py``); ``groups.py`` resolves the
shard, secondary and replica process groups once into one object handed down to the engine's components;
``quantize.py`` is ZeRO++'s quantized exchanges. Imports: ``memory/`` (cost counters) and the options.
"""
