"""The gradient reducer in one process: constant buffer memory whatever the number of buckets, exact shards."""

import random

import pytest

import torch

from lightning_zero.shards.buckets import GradientReducer
from lightning_zero.shards.layout import plan_layout


def _reducer(numels, bucket_size, max_buffers=2):
    layout = plan_layout(numels, [0] * len(numels), world_size=1, bucket_size=bucket_size)
    return layout, GradientReducer(layout, 0, torch.float32, torch.device("cpu"), max_buffers, overlap=True)


def _expected_shard(layout, grads):
    flat = torch.zeros(layout.total)
    for g, offset in zip(grads, layout.offsets):
        flat[offset : offset + g.numel()] = g.reshape(-1)
    return flat


def test_buffers_do_not_grow_with_the_number_of_buckets():
    for num_params in (10, 100):
        numels = [37] * num_params
        layout, reducer = _reducer(numels, bucket_size=50)
        assert len(layout.buckets) >= num_params * 37 // 50
        grads = [torch.randn(n) for n in numels]
        for j in reversed(range(num_params)):  # backward order
            reducer.add_grad(j, grads[j])
        torch.testing.assert_close(reducer.finalize(force=True), _expected_shard(layout, grads))
        assert reducer.buffers_allocated <= 2, (num_params, reducer.buffers_allocated)


def test_out_of_order_gradients_and_accumulation():
    numels = [5, 40, 3, 64, 1, 17]
    layout, reducer = _reducer(numels, bucket_size=16)
    grads = [torch.randn(n) for n in numels]
    order = list(range(len(numels)))
    random.Random(0).shuffle(order)
    for _ in range(2):  # two micro-batches accumulate
        for j in order:
            reducer.add_grad(j, grads[j])
        reducer.flush()
        reducer.wait()
    torch.testing.assert_close(reducer.finalize(force=False), 2 * _expected_shard(layout, grads))
    kept = reducer.grad_shard
    reducer.clear()
    assert reducer.grad_shard is kept  # kept from step to step (see [Note: the gradient shard is kept] in store.py)
    kept.fill_(float("nan"))  # what it holds is stale: stand for it with NaNs
    reducer.add_grad(1, grads[1])  # one parameter only: the rest of the shard must read as zero, not stale
    shard = reducer.finalize(force=True)
    expected = _expected_shard(layout, [g if j == 1 else torch.zeros_like(g) for j, g in enumerate(grads)])
    torch.testing.assert_close(shard, expected)


def test_a_parameter_spanning_many_buckets_needs_no_more_buffers():
    layout, reducer = _reducer([1000, 3], bucket_size=64)
    grads = [torch.randn(1000), torch.randn(3)]
    reducer.add_grad(1, grads[1])
    reducer.add_grad(0, grads[0])
    torch.testing.assert_close(reducer.finalize(force=True), _expected_shard(layout, grads))
    assert len(layout.buckets) == 16 and reducer.buffers_allocated <= 2


def test_two_interleaved_param_groups_keep_the_buffers_constant():
    # A transformer's decay (matrices) and no-decay (norms, biases) groups: each group's buckets are one run in the
    # buffer, but they are reduced in the order they complete in backward, so neither group waits for the other.
    for blocks in (4, 16):
        numels = [n for _ in range(blocks) for n in (8, 8, 96, 12, 96, 8)]
        groups = [0 if n > 8 else 1 for n in numels]
        layout = plan_layout(numels, groups, world_size=1, bucket_size=24)
        reducer = GradientReducer(layout, 0, torch.float32, torch.device("cpu"), 2, overlap=True)
        grads = [torch.randn(n) for n in numels]
        for j in reversed(range(len(numels))):  # backward order
            reducer.add_grad(j, grads[j])
        reducer.finalize(force=True)
        assert sorted(layout.reduce_order) == list(range(len(layout.buckets)))
        assert reducer.buffers_allocated <= 3, (blocks, reducer.buffers_allocated)


class _ReplicaSum:
    """Stands in for an asynchronous all-reduce over two identical replicas: the chunk doubles when waited for."""

    def __init__(self, tensor, log):
        self.tensor, self.log, self.done = tensor, log, False
        log.append(self)

    def wait(self):
        if not self.done:
            self.tensor.mul_(2)
            self.done = True
        return True


@pytest.mark.parametrize("overlap", [True, False])
def test_the_replica_all_reduce_overlaps_and_lands_before_delivery(monkeypatch, overlap):
    """The replica all-reduce (see [Note: the replica all-reduce overlaps] in ``buckets.py``) is started when its
    reduce-scatter is waited for, waited for only when its buffer is needed or the round ends (with
    ``overlap_comm``), and always before the chunk is read or accumulated."""
    from lightning_zero.comm import collectives
    from lightning_zero.comm.groups import ShardGroups

    started = []
    monkeypatch.setattr(collectives, "all_reduce_async", lambda tensor, group=None: _ReplicaSum(tensor, started))
    numels = [37] * 12
    layout = plan_layout(numels, [0] * len(numels), world_size=1, bucket_size=50)
    groups = ShardGroups(replicate=object(), replicas=2)  # the divisor is 2: each replica sends half the sum
    reducer = GradientReducer(layout, 0, torch.float32, torch.device("cpu"), 2, overlap=overlap, groups=groups)
    grads = [torch.randn(n) for n in numels]
    for round_ in range(2):  # the second round accumulates through the side outputs
        for j in reversed(range(len(numels))):
            reducer.add_grad(j, grads[j])
        if round_ == 0:  # chunks reduced into the shard hold no buffer: their all-reduces run on through backward
            assert sum(not w.done for w in started) >= (len(layout.buckets) - 2 if overlap else 0)
            assert overlap or all(w.done for w in started)
        reducer.flush()
        reducer.wait()
        assert all(w.done for w in started)
        assert reducer.buffers_allocated <= 2
    assert len(started) == 2 * len(layout.buckets)
    torch.testing.assert_close(reducer.finalize(force=False), 2 * _expected_shard(layout, grads))
