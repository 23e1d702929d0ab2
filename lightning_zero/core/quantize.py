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
send each rank's chunk as codes and scales (:func:`all_gather_quantized`); on arrival every chunk, this rank's own
included, is dequantized into the unit's buffer, so every rank computes with the same weights. Only the working
copy is approximate: the masters, the optimizer step, the gradients' reduction and checkpoints stay exact, and the
gathers outside compute (``gathered_parameters``, ``state_dict``, moving units to new optimizers) are exact. The
traffic counters count the codes and the scales under ``all_gather``: bytes per step fall from ``2T·w`` (T the
padded unit size, w the working dtype's bytes; forward and backward) to ``2(T' + 4·T'/block)``, T' the size padded
per chunk to whole blocks.

[Note: qgZ, the quantized reduce-scatter of gradients]
With ``quantized_gradients=True`` (stages 2 and 3) a bucket's reduce-scatter is replaced by the paper's all-to-all
scheme (:func:`reduce_scatter_quantized`): each rank quantizes the N chunks of its bucket (chunk j is rank j's),
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

from lightning_zero.core import collectives

QMAX = 127
"""The largest int8 code used (symmetric: -127..127)."""


def padded_blocks(numel: int, block: int) -> int:
    """How many blocks of ``block`` elements hold ``numel`` (the last one padded)."""
    return -(-numel // block)


def quantize(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Codes (int8, ``blocks * block`` elements) and scales (fp32, one per block) of the flat ``x`` (see
    [Note: blockwise int8 quantization])."""
    n = x.numel()
    blocks = padded_blocks(n, block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n].copy_(x.reshape(-1))
    padded = padded.view(blocks, block)
    scales = padded.abs().amax(dim=1) / QMAX
    codes = torch.round(padded / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1))
    return codes.clamp_(-QMAX, QMAX).to(torch.int8).view(-1), scales


def dequantize(codes: Tensor, scales: Tensor, numel: int, out: Optional[Tensor] = None) -> Tensor:
    """The first ``numel`` values of ``codes * scales`` (blockwise), written into ``out`` if given (any dtype)."""
    block = codes.numel() // scales.numel()
    values = (codes.view(-1, block).to(torch.float32) * scales.unsqueeze(1)).view(-1)[:numel]
    if out is None:
        return values
    out.copy_(values.view(out.shape))
    return out


def quantized_bytes(numel: int, block: int) -> int:
    """Bytes on the wire for ``numel`` elements quantized in blocks of ``block``: codes plus fp32 scales."""
    blocks = padded_blocks(numel, block)
    return blocks * block + 4 * blocks


class _Dequantize:
    """A work handle whose ``wait`` waits for the gathers of codes and scales, then dequantizes every rank's chunk
    into ``output``."""

    def __init__(self, works: list[Any], output: Tensor, codes: Tensor, scales: Tensor, ranks: int) -> None:
        self.works, self.output, self.codes, self.scales, self.ranks = works, output, codes, scales, ranks

    def wait(self) -> bool:
        if self.works:
            for work in self.works:
                work.wait()
            self.works = []
            chunk = self.output.numel() // self.ranks
            codes, scales = self.codes.view(self.ranks, -1), self.scales.view(self.ranks, -1)
            with torch.no_grad():
                for r in range(self.ranks):
                    dequantize(codes[r], scales[r], chunk, self.output[r * chunk : (r + 1) * chunk])
        return True


def all_gather_quantized(output: Tensor, input: Tensor, block: int, group: Optional[Any] = None) -> Any:
    """qwZ: concatenate every rank's ``input`` into ``output`` as blockwise int8 (see [Note: qwZ, the quantized
    all-gather of weights]); asynchronous, the values land at ``wait``. Counted as ``all_gather`` (codes and scales)."""
    ranks = collectives.world_size(group)
    codes, scales = quantize(input, block)
    all_codes = torch.empty(ranks * codes.numel(), dtype=torch.int8, device=input.device)
    all_scales = torch.empty(ranks * scales.numel(), dtype=torch.float32, device=input.device)
    works = [collectives.all_gather(all_codes, codes, group=group, async_op=True, verified=False),
             collectives.all_gather(all_scales, scales, group=group, async_op=True, verified=False)]
    return _Dequantize(works, output, all_codes, all_scales, ranks)


def reduce_scatter_quantized(output: Tensor, input: Tensor, block: int, group: Optional[Any] = None) -> Any:
    """qgZ: sum ``input`` (``world_size`` equal chunks) over ranks into this rank's chunk ``output``, sending each
    chunk as blockwise int8 by one all-to-all and summing the dequantized contributions in fp32 (see [Note: qgZ, the
    quantized reduce-scatter of gradients]). Synchronous: returns a finished work handle. Counted as ``all_to_all``
    (codes and scales)."""
    ranks = collectives.world_size(group)
    chunk = output.numel()
    if ranks == 1:
        output.copy_(input)
        return collectives.done()
    pieces = [quantize(input[r * chunk : (r + 1) * chunk], block) for r in range(ranks)]
    codes = torch.cat([c for c, _ in pieces])
    scales = torch.cat([s for _, s in pieces])
    got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
    collectives.all_to_all(got_codes, codes, group=group)
    collectives.all_to_all(got_scales, scales, group=group)
    total = torch.zeros(chunk, dtype=torch.float32, device=input.device)
    for c, s in zip(got_codes.view(ranks, -1), got_scales.view(ranks, -1)):
        total += dequantize(c, s, chunk)
    output.copy_(total)
    return collectives.done()

