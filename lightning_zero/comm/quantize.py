"""ZeRO++'s quantized collectives in pure torch: blockwise int8 quantization, the quantized all-gather of weights
(qwZ) and the quantized reduce-scatter of gradients by all-to-all (qgZ).

[Note: blockwise int8 quantization]
A flat tensor is cut into blocks of ``block`` elements (the last one zero-padded); each block is sent as int8 codes
``q = round(x / scale)`` in [-127, 127] and one fp32 ``scale = max|x| / 127`` (a block of zeros has scale 0 and codes
0). Dequantizing gives ``q * scale``: each element within ``scale / 2`` of its value, i.e. a relative error of at most
1/254 of its block's largest magnitude. Quantizing is deterministic, so every rank that dequantizes the same codes
gets the same values, bit for bit. Bytes per element on the wire: 1 + 4 / block (2 bytes for bf16/fp16 working
weights, 4 for fp32), the ratio the traffic tests check.

[Note: qwZ, the quantized all-gather of weights]
With ``quantized_weights=True`` stage 3's all-gathers of a unit for compute (forward, backward, a recomputation)
send each rank's chunk as codes and scales (``all_gather_quantized``); on arrival every chunk, this rank's own
included, is dequantized into the unit's buffer, so every rank computes with the same weights. Only the working
copy is approximate: the masters, the optimizer step, the gradients' reduction and checkpoints stay exact, and the
gathers outside compute (``gathered_parameters``, ``state_dict``, moving units to new optimizers) are exact. The
traffic counters count the codes and the scales under ``all_gather``: bytes per step fall from ``2T·w`` (T the
padded unit size, w the working dtype's bytes; forward and backward) to ``2(T' + 4·T'/block)``, T' the size padded
per chunk to whole blocks.

[Note: qgZ, the quantized reduce-scatter of gradients]
With ``quantized_gradients=True`` (stages 2 and 3) a bucket's reduce-scatter is replaced by the paper's all-to-all
scheme (``reduce_scatter_quantized``): each rank quantizes the N chunks of its bucket (chunk j is rank j's),
one all-to-all sends chunk j's codes and scales to rank j, and each rank dequantizes the N contributions to its chunk
and sums them in fp32. A rank sends ``T_b(1 + 4/block)`` bytes per bucket of T_b elements (T_b/N of them its own
chunk, kept, as a ring reduce-scatter keeps it) instead of a reduce-scatter's ``T_b·w``. The sum differs from the
exact one by at most the N quantization errors of the contributions (one step of ``scale/2`` per block each); the
paper's second, inter-node hop is absent (one level: the reduce is over the shard group).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zero.comm import collectives
from lightning_zero.memory import costs

QMAX = 127
"""The largest int8 code used (symmetric: -127..127)."""


def padded_blocks(numel: int, block: int) -> int:
    """How many blocks of ``block`` elements hold ``numel`` (the last one padded)."""
    return -(-numel // block)


class Scratch:
    """The quantized exchanges' working memory, lent by (dtype, elements) and given back after use, so that after
    warm-up an exchange allocates nothing large (see [Note: what a step costs] in ``costs.py``). It holds, per size,
    as many buffers as were ever in use at once: the exchanges in flight (a gather and its prefetch), not one per
    unit or bucket. One per owner (a unit store, a bucket manager); not thread-safe."""

    def __init__(self) -> None:
        self._idle: dict[tuple[torch.dtype, int, str], list[Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A buffer of ``numel`` elements (contents undefined): an idle one, or a new one (counted)."""
        idle = self._idle.get((dtype, numel, str(device)))
        return idle.pop() if idle else costs.empty(numel, dtype, device)

    def give(self, *buffers: Tensor) -> None:
        """Take ``buffers`` back for the next exchange."""
        for buffer in buffers:
            self._idle.setdefault((buffer.dtype, buffer.numel(), str(buffer.device)), []).append(buffer)

    @property
    def nbytes(self) -> int:
        """Bytes of the idle buffers held."""
        return sum(t.numel() * t.element_size() for ts in self._idle.values() for t in ts)


def quantize(
    x: Tensor,
    block: int,
    scratch: Optional[Scratch] = None,
    codes: Optional[Tensor] = None,
    scales: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Codes (int8, ``blocks * block`` elements) and scales (fp32, one per block) of the flat ``x`` (see
    [Note: blockwise int8 quantization]), written into ``codes`` and ``scales`` if given; the fp32 work buffer is
    taken from ``scratch`` and given back."""
    n = x.numel()
    blocks = padded_blocks(n, block)
    scratch = scratch if scratch is not None else Scratch()
    work = scratch.take(blocks * block, torch.float32, x.device)
    codes = codes if codes is not None else torch.empty(blocks * block, dtype=torch.int8, device=x.device)
    scales = scales if scales is not None else torch.empty(blocks, dtype=torch.float32, device=x.device)
    with torch.no_grad():
        work[:n].copy_(x.reshape(-1))
        work[n:].zero_()
        padded = work.view(blocks, block)
        torch.linalg.vector_norm(padded, float("inf"), dim=1, out=scales)  # max |x| per block
        scales.div_(QMAX)
        padded.div_(scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)).round_().clamp_(-QMAX, QMAX)
        codes.copy_(work)  # integral values: the cast is exact
    scratch.give(work)
    return codes, scales


def dequantize(
    codes: Tensor, scales: Tensor, numel: int, out: Optional[Tensor] = None, scratch: Optional[Scratch] = None
) -> Tensor:
    """The first ``numel`` values of ``codes * scales`` (blockwise), written into ``out`` if given (any dtype); with
    ``out`` and ``scratch``, the fp32 work buffer is lent by ``scratch``."""
    block = codes.numel() // scales.numel()
    if out is None:
        return (codes.view(-1, block).to(torch.float32) * scales.unsqueeze(1)).view(-1)[:numel]
    scratch = scratch if scratch is not None else Scratch()
    work = scratch.take(codes.numel(), torch.float32, codes.device)
    with torch.no_grad():
        torch.mul(codes.view(-1, block), scales.unsqueeze(1), out=work.view(-1, block))
        out.copy_(work[:numel].view(out.shape))
    scratch.give(work)
    return out


def quantized_bytes(numel: int, block: int) -> int:
    """Bytes on the wire for ``numel`` elements quantized in blocks of ``block``: codes plus fp32 scales."""
    blocks = padded_blocks(numel, block)
    return blocks * block + 4 * blocks


class _Dequantize:
    """A work handle whose ``wait`` waits for the gathers of codes and scales, then dequantizes every rank's chunk
    into ``output`` and gives the exchange's buffers back to ``scratch``."""

    def __init__(
        self,
        works: list[Any],
        output: Tensor,
        codes: Tensor,
        scales: Tensor,
        ranks: int,
        scratch: Scratch,
        lent: tuple[Tensor, ...],
    ) -> None:
        self.works, self.output, self.codes, self.scales, self.ranks = works, output, codes, scales, ranks
        self.scratch, self.lent = scratch, lent

    def wait(self) -> bool:
        if self.works:
            for work in self.works:
                work.wait()
            self.works = []
            chunk = self.output.numel() // self.ranks
            codes, scales = self.codes.view(self.ranks, -1), self.scales.view(self.ranks, -1)
            for r in range(self.ranks):
                dequantize(codes[r], scales[r], chunk, self.output[r * chunk : (r + 1) * chunk], self.scratch)
            self.scratch.give(*self.lent)
        return True


def all_gather_quantized(
    output: Tensor, input: Tensor, block: int, group: Optional[Any] = None, scratch: Optional[Scratch] = None
) -> Any:
    """qwZ: concatenate every rank's ``input`` into ``output`` as blockwise int8 (see [Note: qwZ, the quantized
    all-gather of weights]); asynchronous, the values land at ``wait``. Counted as ``all_gather`` (codes and scales).
    The codes and scales in flight are lent by ``scratch`` until ``wait``."""
    ranks = collectives.world_size(group)
    scratch = scratch if scratch is not None else Scratch()
    blocks = padded_blocks(input.numel(), block)
    all_codes = scratch.take(ranks * blocks * block, torch.int8, input.device)
    all_scales = scratch.take(ranks * blocks, torch.float32, input.device)
    codes = scratch.take(blocks * block, torch.int8, input.device)
    scales = scratch.take(blocks, torch.float32, input.device)
    quantize(input, block, scratch, codes, scales)
    works = [
        collectives.all_gather(all_codes, codes, group=group, async_op=True, verified=False),
        collectives.all_gather(all_scales, scales, group=group, async_op=True, verified=False),
    ]
    return _Dequantize(works, output, all_codes, all_scales, ranks, scratch, (all_codes, all_scales, codes, scales))


def reduce_scatter_quantized(
    output: Tensor, input: Tensor, block: int, group: Optional[Any] = None, scratch: Optional[Scratch] = None
) -> Any:
    """qgZ: sum ``input`` (``world_size`` equal chunks) over ranks into this rank's chunk ``output``, sending each
    chunk as blockwise int8 by one all-to-all and summing the dequantized contributions in fp32 (see [Note: qgZ, the
    quantized reduce-scatter of gradients]). Synchronous: returns a finished work handle. Counted as ``all_to_all``
    (codes and scales). Its buffers are lent by ``scratch``."""
    ranks = collectives.world_size(group)
    chunk = output.numel()
    if ranks == 1:
        output.copy_(input)
        return collectives.done()
    scratch = scratch if scratch is not None else Scratch()
    blocks = padded_blocks(chunk, block)
    device = input.device
    codes, got_codes = (scratch.take(ranks * blocks * block, torch.int8, device) for _ in range(2))
    scales, got_scales = (scratch.take(ranks * blocks, torch.float32, device) for _ in range(2))
    total, part = (scratch.take(chunk, torch.float32, device) for _ in range(2))
    per_codes, per_scales = codes.view(ranks, -1), scales.view(ranks, -1)
    for r in range(ranks):
        quantize(input[r * chunk : (r + 1) * chunk], block, scratch, per_codes[r], per_scales[r])
    collectives.all_to_all(got_codes, codes, group=group)
    collectives.all_to_all(got_scales, scales, group=group)
    with torch.no_grad():
        total.zero_()
        for c, s in zip(got_codes.view(ranks, -1), got_scales.view(ranks, -1)):
            total.add_(dequantize(c, s, chunk, part, scratch))
        output.copy_(total.view(output.shape))
    scratch.give(codes, got_codes, scales, got_scales, total, part)
    return collectives.done()
