"""The state of all of it on disk: sharded directories written by every rank through
``torch.distributed.checkpoint`` (``storage.py``, ``sharded.py``), whole files (``full.py``), consolidation and
resharding (``consolidate.py``, ``recut.py``), the Hugging Face export (``export.py``), and the checks that a
checkpoint is complete and holds only data (``trust.py``, ``errors.py``). Imports: ``stage3/``, ``shards/`` and
below.
"""
