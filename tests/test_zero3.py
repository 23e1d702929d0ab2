"""Stage 3 specifics: a model built in ``configure_model`` is never materialized in full on any rank."""

from __future__ import annotations

import math

from tests.launch import launch


def test_configure_model_never_materializes_the_full_model(tmp_path):
    # 16 blocks at world size 4: a rank holds a quarter of the weights plus one block while setting up. Built in
    # full, every rank would have grown by at least the whole model.
    ranks = launch("meta_init.py", 4, tmp_path, ("384", "16"), timeout=300)
    for rank in ranks:
        assert rank["units"] >= 17  # the blocks, the final norm, and the root
        assert rank["gathered"] == 0  # nothing left gathered after setup
        assert rank["growth"] < 0.7 * rank["full_bytes"], (rank["growth"], rank["full_bytes"])
        assert math.isfinite(rank["loss"])
