"""Stage 3: parameters partitioned too, and gathered around their use.

``plan.py`` cuts the model into units; ``unit.py`` (``UnitGroup``) owns one unit's shards, its gather buffer from
``buffer.py``/``pool.py``, hooks, prefetch and state; ``units.py`` runs them through forward and backward;
``construction.py``/``materialize.py`` build a model without holding it whole; ``guard.py`` names a parameter read
while it is not gathered. Imports: ``activations/``, ``shards/`` and below.
"""
