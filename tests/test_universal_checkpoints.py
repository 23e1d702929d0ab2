"""Universal checkpoints (issue 25 part 3): a sharded checkpoint written at tensor-parallel size t resumes at t'.

In this process: the index arithmetic of the re-cut against ``tensor_parallel.cut`` (column- and row-parallel
layouts, fused blocks), and a re-cut read into ZeRO-like pieces. One 4-rank launch (tests/workers/universal.py)
runs the chain 2x2 -> 4x1 -> 1x2 -> 2x2 (data x tensor) against DDP's own resume, and the refusals.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zero.checkpoints import recut
from lightning_zero import CheckpointError
from lightning_zero.checkpoints.recut import (
    Cut,
    cannot_recut,
    finish,
    stacked_to_whole,
    to_saved_layout,
    whole_to_stacked,
)
from lightning_zero.checkpoints.shards import Shard
from lightning_zero.shards.slices import TensorParallelSlice
from lightning_zero.tensor_parallel import cut
from lightning_zero.testing.launch import launch

RTOL = 1e-5  # fp32 against DDP: only the order of the sums differs (see tests/test_parity.py)
LAYOUTS = [((12, 8), 0, 1), ((12, 8), 1, 1), ((24, 4), 0, 3), ((2, 12, 3), 1, 2), ((12,), 0, 1), ((12,), 0, 3)]


@pytest.mark.parametrize("shape, dim, parts", LAYOUTS)
def test_the_index_arithmetic_is_the_stacked_cut(shape, dim, parts):
    """Element i of the flattened stacked slices (``torch.stack(cut(...))``) is element ``stacked_to_whole(i)`` of
    the whole tensor, and ``whole_to_stacked`` inverts it, at every size the tensor splits into."""
    whole = torch.randn(shape)
    index = torch.arange(whole.numel())
    for size in (1, 2, 4):
        if shape[dim] % (parts * size):
            continue
        layout = Cut(shape, dim, parts, size)
        stacked = torch.stack(cut(whole, size, dim, parts)).reshape(-1)
        assert stacked.numel() == whole.numel() and layout.stacked[0] == size or size == 1
        assert torch.equal(stacked, whole.reshape(-1)[stacked_to_whole(index, layout)])
        assert torch.equal(whole_to_stacked(stacked_to_whole(index, layout), layout), index)


@pytest.mark.parametrize("window", [1, 7, recut.WINDOW])
@pytest.mark.parametrize("shape, dim, parts", [*LAYOUTS, ((36, 5), 0, 3), ((5, 36), 1, 1)])
def test_a_recut_read_fills_the_pieces_of_another_size(shape, dim, parts, window, monkeypatch):
    """A destination at size t' with ZeRO-like pieces (odd ranges of this rank's stacked slice), rewritten into the
    saved layout of size t, then filled the way DCP reads (each saved range copied into its piece), then the staging
    windows copied into place: every piece holds its part of this rank's slice at t'. With windows of one run (read
    straight into the destination), of a few elements, and of the default span; sizes that do not divide each other
    (2 and 3) too."""
    monkeypatch.setattr(recut, "WINDOW", window)
    whole = torch.randn(shape)
    sizes = [s for s in (1, 2, 3, 4) if shape[dim] % (parts * s) == 0]
    for saved in sizes:
        stored = torch.stack(cut(whole, saved, dim, parts)).reshape(-1) if saved > 1 else whole.reshape(-1)
        marks = {"tensor_parallel": {"w": (dim, parts)} if saved > 1 else {},
                 "tensors": {"w": (Cut(shape, dim, parts, saved).stacked, "float32")}}
        for here in sizes:
            for rank in range(here):
                local = cut(whole, here, dim, parts)[rank] if here > 1 else whole
                n = local.numel()
                bounds = sorted({0, n, n // 3, n // 3 + 1, (2 * n) // 3})
                pieces = [(rank * n * (here > 1) + a, torch.zeros(b - a)) for a, b in zip(bounds, bounds[1:]) if b > a]
                dest = Shard((here, *local.shape) if here > 1 else tuple(shape), torch.float32, pieces,
                             local_shape=tuple(local.shape) if here > 1 else None,
                             joins_along=dim if here > 1 else None, parts=parts)
                read, copies = to_saved_layout("w", dest, marks)
                for start, view in read.pieces:
                    view.copy_(stored[start : start + view.numel()])
                finish(copies)
                assert torch.equal(torch.cat([p for _, p in pieces]), local.reshape(-1)), (saved, here, rank)


# ---------------------------------------------------------------------- the 4-rank chain
@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return launch("universal.py", 4, tmp_path_factory.mktemp("universal"), timeout=300)


@pytest.mark.parametrize("run, shape", [("A", (2, 2)), ("B", (4, 1)), ("C", (1, 2)), ("D", (2, 2))])
def test_the_chain_follows_ddp_resuming_its_own_checkpoints(ranks, run, shape):
    """2x2 (zero2) -> 4x1 (zero3) -> 1x2 (zero1) -> 2x2 (zero3), each run resuming the sharded checkpoint of the one
    before: right after the load every master piece and every piece of Adam's moments equals, bit for bit, the
    consolidated checkpoint cut for this run; then losses step for step and the final weights follow DDP's resume of
    its own run (the model without tensor parallelism over the same data-parallel ranks and batches) in fp32."""
    here = ranks[:2] if run == "C" else ranks
    for rank in here:
        result = rank[run]
        assert result["shape"] == shape
        assert result["not_exact"] == []
        assert result["steps"][0] == result["steps"][1] > 0
        assert max(result["loss"]) <= RTOL, result["loss"]
        assert max(result["params"].values()) <= RTOL, result["params"]
        assert bool(result["sliced"]) == (shape[1] > 1)  # at t = 2 the blocks' weights are slices
    assert all(rank["C"] is None for rank in ranks[2:])  # ranks 2-3 sat out the 2-rank run


def test_factored_states_are_refused_before_anything_is_loaded(ranks):
    """Adafactor's factored statistics of sliced weights (2x2) at t = 1: resuming the model or the optimizer is
    refused with the reason and what to do, nothing changed; the model alone (without the optimizer's state) loads,
    the whole tensors of the slices."""
    for rank in ranks:
        found = rank["adafactor"]
        for message in found["refusals"].values():
            assert "`tensor_parallel_size=2` and this run has `tensor_parallel_size=1`" in message
            assert "not per element" in message and "cannot be re-cut" in message and "--weights-only" in message
        assert found["unchanged"] and found["weights_loaded"]


def test_what_cannot_be_recut_is_named_before_reading():
    """A layer cut along another dimension than the checkpoint's (column- against row-parallel) is refused with the
    key; a whole (t = 1) factored statistic of a parameter that is a slice here is named by ``cannot_recut``, a
    per-element state of it and the statistics of a replicated parameter are not."""
    saved = {"tensor_parallel": {"w": (0, 1)}, "tensors": {"w": ((2, 4, 8), "float32")}}
    row = Shard((4, 8, 2), torch.float32, [(0, torch.zeros(16))], local_shape=(8, 2), joins_along=1)
    with pytest.raises(CheckpointError, match="w was saved cut along dimension 0 .* along dimension 1"):
        to_saved_layout("w", row, saved)
    sliced, replicated = torch.nn.Parameter(torch.zeros(4, 8)), torch.nn.Parameter(torch.zeros(8, 8))
    setattr(sliced, "_lightning_zero_tensor_parallel", TensorParallelSlice(0, 0, 2))  # slice 0 of (8, 8) along 0
    whole = {"tensors": {"optimizer/0/0/row_var": ((8, 1), "float32"), "optimizer/0/0/exp_avg": ((8, 8), "float32"),
                         "optimizer/0/1/col_var": ((1, 8), "float32"), "optimizer/0/0/step": ((), "float32")}}
    assert cannot_recut(whole, [[sliced, replicated]]) == ["optimizer/0/0/row_var"]
    assert cannot_recut(whole, []) == []  # the model alone: its weights always re-cut
