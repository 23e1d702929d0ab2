"""The flat buffers and what each rank keeps of them (stages 1 and 2, and the storage stage 3 builds on).

``layout.py`` places every parameter in a flat buffer and cuts it into rank slices; ``store.py`` is the parameter
store; ``flat.py`` the working copy of stages 1-2; ``buckets.py``/``bucket_slots.py`` the constant-size gradient
buckets; ``optimizer.py``/``optimizer_support.py``/``sharing.py`` the user's optimizer on a shard of the master
weights; ``offload.py``/``disk.py`` the host and disk tiers; ``accounting.py`` the model-state bytes per rank.
Imports: ``process/``, ``comm/``, ``memory/`` and the options.
"""
