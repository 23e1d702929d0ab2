"""The pairwise exchanges that carry reduce-scatter and all-gather on gloo (see [Note: reduce-scatter and all-gather
on gloo] in ``lightning_zero/comm/collectives.py``), on 2 and 3 gloo ranks (one launch of
``tests/workers/exchange.py`` each): the values against sums computed here, several exchanges in flight over two
groups and waited for out of order, and at N = 2 the reduced chunk bit-identical to gloo's all-reduce (DDP's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_zero.testing.launch import launch
from tests.workers.exchange import CHUNK, ROUNDS, values


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory) -> list[dict[str, Any]]:
    return launch("exchange.py", request.param, tmp_path_factory.mktemp(f"exchange{request.param}"), timeout=120)


def _mine(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[rank * CHUNK : (rank + 1) * CHUNK]


def test_reduce_scatter_sums_each_rank_its_chunk(ranks):
    size = len(ranks)
    for result in ranks:
        for round_ in range(ROUNDS):
            expected = sum(_mine(values(r, round_, size), result["rank"]).double() for r in range(size))
            torch.testing.assert_close(result["chunks"][round_].double(), expected, rtol=1e-6, atol=1e-6)


def test_reduce_scatter_of_two_is_bitwise_gloos_all_reduce(ranks):
    if len(ranks) != 2:
        pytest.skip("the exchange reduces only in groups of two; larger groups all-reduce")
    for result in ranks:
        assert torch.equal(result["chunks"][0], result["all_reduce"])


def test_all_gather_concatenates_every_rank(ranks):
    size = len(ranks)
    for result in ranks:
        for round_ in range(ROUNDS):
            expected = torch.cat([values(r, round_, size)[:CHUNK] for r in range(size)])
            assert torch.equal(result["gathers"][round_], expected)
            in_place = torch.cat([values(r, round_, size)[CHUNK : 2 * CHUNK] for r in range(size)])
            assert torch.equal(result["in_place"][round_], in_place)
        assert torch.equal(result["native"], torch.cat([values(r, 0, size)[:CHUNK] for r in range(size)]))
