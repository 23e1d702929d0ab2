"""Stage 3 specifics: a model built in ``configure_model`` is never materialized in full on any rank."""

from __future__ import annotations

import math

import pytest

from lightning_zero.testing.launch import launch


def test_configure_model_never_materializes_the_full_model_and_validation_stays_sharded(tmp_path):
    # 16 blocks at world size 4: a rank holds a quarter of the weights plus one block while setting up. Built in
    # full, every rank would have grown by at least the whole model.
    ranks = launch("meta_init.py", 4, tmp_path, ("384", "16"), timeout=300)
    for rank in ranks:
        assert rank["units"] >= 17  # the blocks, the final norm, and the root
        assert rank["gathered"] == 0  # nothing left gathered after setup
        assert rank["growth"] < 0.7 * rank["full_bytes"], (rank["growth"], rank["full_bytes"])
        assert math.isfinite(rank["loss"])
        # a standalone `validate` under zero3 gathers blocks around their forward too: never all 16 at once
        assert 0 < rank["val_gathered"] < 0.25 * rank["blocks_bytes"], (rank["val_gathered"], rank["blocks_bytes"])
        assert math.isfinite(rank["val_loss"]) and rank["val_loss"] == ranks[0]["val_loss"]


DIVERGENCES = {  # mode of tests/workers/diverge.py: what each rank was about to run, what rank 1 skipped
    "forward": ("rank 0: the forward of stage 3 unit 'blocks.1'; rank 1: the forward of stage 3 unit 'blocks.2'",
                "Rank 1 skipped 'blocks.1' (in the order of the first step's forward)"),
    "unprefetched": ("rank 0: the forward of stage 3 unit 'blocks.1'; rank 1: the forward of stage 3 unit 'blocks.3'",
                     "Rank 1 skipped 'blocks.1', 'blocks.2' (in the order of the first step's forward)"),
    "backward": ("rank 0: the backward of stage 3 unit 'blocks.3'; rank 1: the backward of stage 3 unit 'blocks.2'",
                 None),
    "recompute": ("rank 0: the forward of stage 3 unit 'blocks.1'; rank 1: the forward of stage 3 unit 'blocks.2'",
                  "Rank 1 skipped 'blocks.1' (in the order of the first step's forward)"),
    "strict": ("rank 0: the forward of stage 3 unit 'blocks.1'; rank 1: the forward of stage 3 unit 'blocks.2'",
               "Rank 1 skipped 'blocks.1' (in the order of the first step's forward)"),
}


@pytest.mark.parametrize("mode", list(DIVERGENCES))
def test_ranks_running_different_units_fail_at_once_with_the_skipped_unit_named(tmp_path, mode):
    # rank 1's control flow differs at step 2 under the default 30-minute process-group timeout: the lockstep check
    # ends the job within one unit of where the ranks differ, on every rank, well within this test's bound. In
    # "unprefetched" rank 1 waits for its check at once and rank 0 one unit later; in "backward" the forwards agree
    # and rank 1's backward skips a unit, which rank 0 finds before its reduce-scatter
    ranks = launch("diverge.py", 2, tmp_path, (mode,), timeout=120)
    errors = [rank["error"] for rank in ranks]
    doing, skipped = DIVERGENCES[mode]
    for error in errors:  # every rank stopped with the same error, none by a broken connection
        assert error and error.startswith("RanksOutOfStepError: ZeRO stage 3: the ranks ran different units"), errors
        assert doing in error, error
        assert skipped is None or skipped in error, error
        assert "different collectives" in error  # the hint: what to change
    assert errors[0] == errors[1]
    # teardown after the error: no collective, and stage 3's parameters are empty tensors, not views of freed memory
    assert all(rank["elements_left"] == 0 and math.isfinite(rank["state_sum"]) for rank in ranks), ranks
    # once the forward order is known (step 1), only the checks of units that start a pass are waited for where they
    # are sent: two per step (the forward's first unit, the backward's). Under "recompute" backward switches between
    # backward and recomputed forward at every block: ln_f's backward, block 3's backward (gathered ahead within that
    # pass: one unit late) then its recomputation, then each of blocks 2, 1, 0 backward and recomputed, each a new
    # pass: 1 + 1 + 1 + 2 * 3 = 9. Under "strict" every unit's is (five units with hooks, two passes)
    expected = {"strict": 10, "recompute": 9}.get(mode, 2)
    assert all(rank["checks_at_once"][1] == expected for rank in ranks), ranks


def test_ranks_given_different_numbers_of_batches_fail_with_the_likely_cause_and_nothing_after(tmp_path):
    # rank 1 runs out of data and gathers the weights back at teardown while rank 0 waits at its next step: both fail
    # at the process group's timeout (5 s), naming uneven data, and Lightning's teardown after it raises nothing more
    ranks = launch("uneven.py", 2, tmp_path, timeout=120)
    for rank in ranks:
        kind, message, _ = rank["error"]
        assert kind == "RuntimeError" and "ran out of data" in message, rank["error"]
        assert math.isfinite(rank["state_sum"])
    assert "gather the full weights back" in ranks[1]["error"][1], ranks[1]["error"]


def test_lockstep_check_names_each_ranks_unit_and_what_was_skipped():
    from lightning_zero.stage3.lockstep import LockstepCheck
    from lightning_zero.stage3.unit import BACKWARD, FORWARD

    check = LockstepCheck(["<root>", "blocks.0", "blocks.1", "blocks.2", "ln_f"])  # no process group: no check
    order = [0, 1, 2, 3, 4]
    text = check.describe([[FORWARD, 2, 2], [FORWARD, 4, 4]], order)
    assert "rank 0: the forward of stage 3 unit 'blocks.1'; rank 1: the forward of stage 3 unit 'ln_f'" in text
    assert "Rank 1 skipped 'blocks.1', 'blocks.2'" in text
    # in backward, or before the forward order is known, nothing is said about skipping
    assert "Rank 1 skipped" not in check.describe([[FORWARD, 2, 2], [BACKWARD, 3, 3]], order)
    assert "Rank 1 skipped" not in check.describe([[FORWARD, 2, -1], [FORWARD, 3, -1]], [])
    check.start(1, FORWARD, order)  # one process: nothing to compare with, nothing sent
    assert not check.active and not check.in_flight
    check.finish(order)


def test_units_blocks_leftovers_and_a_root_for_tied_and_owned_parameters():
    from lightning_zero.stage3.plan import ROOT, plan_units
    from tests.models import Block, TinyGPT

    model = TinyGPT(width=16, depth=3)
    plan = plan_units(model, persistence_threshold=0)
    assert plan.names[1:] == ["blocks.0", "blocks.1", "blocks.2", "ln_f"]
    assert plan.unit(model.wte.weight) == ROOT  # tied with the head
    assert plan.unit(model.pos) == ROOT  # owned by the LightningModule itself
    assert plan.unit(model.blocks[1].mlp[0].weight) == 2

    by_name = plan_units(model, unit_classes=["Block"], persistence_threshold=0)
    assert by_name.names == plan.names and plan_units(model, unit_classes=[Block]).names[1:4] == plan.names[1:4]
    everything_small = plan_units(model, persistence_threshold=10**9)
    assert everything_small.names == ["<root>"]
    assert all(everything_small.unit(p) == ROOT for p in model.parameters())


def test_persistence_threshold_none_is_the_same_number_at_every_size():
    # one algorithm at every size (see [Note: one algorithm at every size] in stage3/plan.py): a small model, a large
    # one and every option get the same element threshold; a number chooses for any model
    from torch import nn

    from lightning_zero.config import ZeroConfig
    from lightning_zero.engine.policies import unit_policy
    from lightning_zero.stage3.plan import DEFAULT_PERSISTENCE_THRESHOLD, plan_units
    from tests.models import TinyGPT

    small = TinyGPT(width=128, depth=3)  # blocks of about 200k elements, 0.6M parameters in all
    large = nn.Sequential(*(nn.Linear(4096, 4096, bias=False, device="meta") for _ in range(2)))  # 33.6M
    for option in ({}, {"offload_params": True}, {"quantized_weights": True}, {"secondary_shard_group_size": 1}):
        assert unit_policy(ZeroConfig(stage=3, **option)).persistence_threshold == DEFAULT_PERSISTENCE_THRESHOLD
    assert unit_policy(ZeroConfig(stage=3, persistence_threshold=0)).persistence_threshold == 0
    assert len(plan_units(small, persistence_threshold=DEFAULT_PERSISTENCE_THRESHOLD).names) > 1
    assert plan_units(large, persistence_threshold=DEFAULT_PERSISTENCE_THRESHOLD).names == ["<root>", "0", "1"]
    numel = sum(p.numel() for p in small.parameters())
    assert plan_units(small, persistence_threshold=numel).names == ["<root>"]  # a number above the size: whole


def test_the_blocks_named_in_unit_classes_are_units_whatever_their_size():
    from lightning_zero.config import ZeroConfig
    from lightning_zero.engine.policies import unit_policy
    from tests.models import Block, TinyGPT

    model = TinyGPT(width=16, depth=3)  # blocks of about 3K elements, far below the default threshold
    assert unit_policy(ZeroConfig(stage=3)).plan(model).names == ["<root>"]
    named = unit_policy(ZeroConfig(stage=3, unit_classes=[Block])).plan(model)
    assert named.names == ["<root>", "blocks.0", "blocks.1", "blocks.2"]  # ln_f, not named, still joins the root
    chosen = unit_policy(ZeroConfig(stage=3, unit_classes=[Block], persistence_threshold=10**6)).plan(model)
    assert chosen.names == ["<root>"]  # a threshold the user sets decides for the named blocks too


def test_a_model_gathered_whole_trains_as_unit_by_unit():
    # blocks of 263k elements: units under the default (100,000), one root under a threshold above the model's size;
    # a step of each plan gives the same weights, bit for bit
    import torch
    from torch import nn

    from lightning_zero import ZeroEngine

    def train(**options: object) -> tuple[list[str], list[torch.Tensor], str]:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256)) for _ in range(3)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = ZeroEngine(model, [optimizer], stage=3, **options)
        names, summary = list(engine.unit_plan.names), engine.summary()
        model(torch.ones(4, 256)).sum().backward()
        engine.step()
        with engine.gathered_parameters():
            weights = [p.detach().clone() for p in model.parameters()]
        engine.teardown()
        return names, weights, summary

    whole, whole_weights, whole_summary = train(persistence_threshold=10**7)
    units, unit_weights, unit_summary = train()
    assert whole == ["<root>"] and units == ["<root>", "0", "1", "2"]
    assert "gathered as one unit, once per step" in whole_summary and "one unit" not in unit_summary
    for a, b in zip(whole_weights, unit_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_large_model_built_in_init_gets_a_warning(monkeypatch):
    import warnings

    import pytest
    import torch

    from lightning_zero.stage3 import materialize

    monkeypatch.setattr(materialize, "LARGE_MODEL_PARAMS", 1000)
    with pytest.warns(UserWarning, match="configure_model"):
        materialize.warn_if_built_in_full(torch.nn.Linear(100, 100))
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("error")
        materialize.warn_if_built_in_full(torch.nn.Linear(100, 100))  # on meta: nothing was materialized


def test_materialization_runs_children_before_parents_as_eager_construction_does():
    # A parent whose reset_parameters initializes a child's (tied) weight, as GPT-2 does with its token embedding: the
    # parent's initialization must win, as it does when the module is built eagerly. One process, no collective.
    import torch
    from torch import nn

    from lightning_zero.stage3.materialize import materialize

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(4096, 64)
            self.pos = nn.Parameter(torch.empty(8, 64))
            self.head = nn.Linear(64, 4096, bias=False)
            self.head.weight = self.wte.weight
            self.reset_parameters()

        def reset_parameters(self) -> None:
            if not self.pos.is_meta:
                nn.init.normal_(self.pos, std=0.02)
                nn.init.normal_(self.wte.weight, std=0.02)

    eager = Net()
    with torch.device("meta"):
        net = Net()
    materialize(net, torch.device("cpu"))
    assert not any(t.is_meta for t in net.parameters())
    assert net.head.weight is net.wte.weight
    for model in (eager, net):
        assert 0.015 < model.wte.weight.std().item() < 0.025  # not nn.Embedding's N(0, 1)
        assert 0.015 < model.pos.std().item() < 0.025
