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


def test_ranks_running_different_units_fail_with_the_unit_named(tmp_path):
    # rank 1 skips a block at step 2; with a 20 s process-group timeout the job must end, not hang
    ranks = launch("diverge.py", 2, tmp_path, timeout=150)
    errors = [rank["error"] for rank in ranks]
    assert all(errors), errors  # every rank stopped with an error
    assert any("stage 3 unit 'blocks." in e and "different collectives" in e for e in errors), errors
