"""Universal checkpoints: a sharded checkpoint written at tensor-parallel size t, read at another size t'.

[Note: re-cutting tensor-parallel slices on load]
A tensor-parallel slice is stored as its slice of a stacked tensor ``(t, *local shape)``, flattened (see
[Note: tensor-parallel slices in a checkpoint] in ``shards.py``), and the metadata names the dimension the slices
join along and the blocks (``parts``) of the whole tensor. The stacked layout at t and the one at t' are two
orderings of the same elements of the whole tensor, so an element's place in the saved flat tensor follows from its
place here by arithmetic alone (``stacked_to_whole``, ``whole_to_stacked``): whole index ``(a, f, b)``
around the cut dimension, f in block ``q`` at offset ``w``, is on tensor rank ``w // (F / (parts t))``. A destination
piece (this rank's range ``[start, start + n)`` of the stacked tensor at t') is therefore a sequence of runs that are
contiguous in both layouts, each a whole number of granules (``_granule``; for a cut along the first dimension
without blocks, one run: the layouts agree), and the runs are read by DCP (``to_saved_layout``). DCP's file reader
loads a whole saved chunk for every item it reads, so a row-parallel weight's thousands of short runs are not read one
by one: consecutive runs are read as one window of the saved tensor (the runs in saved order, at most ``WINDOW``
elements from the first run's start to the last one's end) into a staging buffer, then copied into place
(``finish``); a window of a single run is read straight into the destination. The staging a rank holds during a load
spans the saved ranges over what it owns: about its own share where the new cut is coarser, at most the saved slices it
draws from where it is finer (twice its share from t to 2t); no rank holds a whole tensor unless it owns it, and the
data-parallel resharding works as before. A tensor written at t = 1 (no slice marker in the checkpoint) is the whole
tensor, a cut with one slice; a run at t' = 1 reads the whole tensor the same way, with the dimension and blocks taken
from the checkpoint's metadata. Column- and row-parallel
layouts differ only in that dimension (0 for the column-parallel weight and bias, 1 for the row-parallel weight),
which comes from the slice marker (``shards/slices.py``) here and from the metadata of the checkpoint.

What cannot be re-cut is refused before anything is read (``cannot_recut``): a state of a sliced parameter that
is not per element. Adafactor keeps, for a weight of shape (O, I), the running means of its squared gradient over
each row (a factor of O entries) and over each column (I entries); a slice keeps them over its own rows and columns.
For a column-parallel slice (rows cut) the row factor is per row and would join; the column factor is a mean over
this slice's rows only (row-parallel: the same with rows and columns swapped). Cutting finer (t' > t, or sizes that
do not divide each other) needs means over rows the checkpoint never averaged separately: not derivable, refused.
Merging slices (t' dividing t) would be the average of the merged slices' means, exact in real arithmetic (equal row
counts, a linear running mean) but not bitwise in fp32, and specific to each optimizer's meaning of its states: not
done either, so every such state is refused at another t, with what to do (resume at the same t, or load the weights
alone and start the optimizer afresh).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.checkpoints.errors import CheckpointError
from lightning_zero.checkpoints.shards import Shard

#: Granules mapped at a time (the index arithmetic holds a few int64 tensors of this length).
CHUNK = 1 << 16


@dataclass(frozen=True)
class Cut:
    """How a whole tensor of ``whole`` shape is laid out when cut into ``size`` slices along ``dim`` (of ``parts``
    blocks each cut, see ``TensorParallelSlice``) and stacked: ``size = 1`` is the whole tensor itself."""

    whole: tuple[int, ...]
    dim: int
    parts: int
    size: int

    def __post_init__(self) -> None:
        if self.whole[self.dim] % (self.parts * self.size):
            raise CheckpointError(
                f"A tensor of shape {self.whole} cannot be cut into {self.size} slices of "
                f"{self.parts} blocks along dimension {self.dim}."
            )

    @property
    def stacked(self) -> tuple[int, ...]:
        """The stacked shape ``(size, *slice shape)`` (for ``size = 1``: the whole shape, as stored at t = 1)."""
        if self.size == 1:
            return self.whole
        local = list(self.whole)
        local[self.dim] //= self.size
        return (self.size, *local)

    def _sizes(self) -> tuple[int, int, int, int]:
        """(elements before the cut dimension, its whole length, elements after it, one slice's share of a block)."""
        a = math.prod(self.whole[: self.dim])
        f = self.whole[self.dim]
        b = math.prod(self.whole[self.dim + 1 :])
        return a, f, b, f // (self.parts * self.size)


def stacked_to_whole(index: Tensor, cut: Cut) -> Tensor:
    """The flat indices in the whole tensor of the flat indices ``index`` of the stacked tensor of ``cut``."""
    a_n, f_n, b_n, share = cut._sizes()
    local = f_n // cut.size
    per_slice = a_n * local * b_n
    j, rest = index // per_slice, index % per_slice
    a, i, b = rest // (local * b_n), (rest // b_n) % local, rest % b_n
    f = (i // share) * (f_n // cut.parts) + j * share + i % share
    return (a * f_n + f) * b_n + b


def whole_to_stacked(index: Tensor, cut: Cut) -> Tensor:
    """The flat indices in the stacked tensor of ``cut`` of the flat indices ``index`` of the whole tensor."""
    a_n, f_n, b_n, share = cut._sizes()
    local = f_n // cut.size
    block = f_n // cut.parts
    a, f, b = index // (f_n * b_n), (index // b_n) % f_n, index % b_n
    q, w = f // block, f % block
    j, i = w // share, q * share + w % share
    return j * (a_n * local * b_n) + (a * local + i) * b_n + b


def saved_cut(info: dict[str, Any], key: str) -> Optional[Cut]:
    """The cut a checkpoint stored ``key`` with, ``None`` for a tensor stored as it is (replicated, or t = 1) or a
    state that does not join (see [Note: re-cutting tensor-parallel slices on load])."""
    joins = info.get("tensor_parallel", {}).get(key)
    if joins is None:
        return None
    dim, parts = joins
    shape = tuple(info["tensors"][key][0])
    whole = list(shape[1:])
    whole[dim] *= shape[0]
    return Cut(tuple(whole), dim, parts, shape[0])


def shard_cut(shard: Shard) -> Optional[Cut]:
    """The cut of a destination ``Shard`` (a slice's per-element tensor), ``None`` for any other."""
    if shard.local_shape is None or shard.joins_along is None:
        return None
    return Cut(shard.full_shape, shard.joins_along, shard.parts, shard.shape[0])


def whole_shape(info: dict[str, Any], key: str) -> tuple[int, ...]:
    """The shape of the whole tensor ``key`` of a checkpoint (its stored shape unless it is stacked slices)."""
    cut = saved_cut(info, key)
    return cut.whole if cut is not None else tuple(info["tensors"][key][0])


def _cuts(info: dict[str, Any], key: str, shard: Shard) -> Optional[tuple[Cut, Cut]]:
    """(the saved cut, the cut here) of ``key`` when they differ, ``None`` when the saved pieces fit as they are."""
    src, dst = saved_cut(info, key), shard_cut(shard)
    if src is None and dst is None:
        return None
    if src is None:
        assert dst is not None
        if tuple(info["tensors"][key][0]) != dst.whole:
            return None  # a shape mismatch, refused by the callers' checks
        src = Cut(dst.whole, dst.dim, dst.parts, 1)
    if dst is None:
        if shard.shape != src.whole:
            return None
        dst = Cut(src.whole, src.dim, src.parts, 1)
    if (src.whole, src.dim, src.parts) != (dst.whole, dst.dim, dst.parts):
        raise CheckpointError(
            f"{key} was saved cut along dimension {src.dim} in {src.parts} block(s), and this model cuts it along "
            f"dimension {dst.dim} in {dst.parts} block(s): the layer is column-parallel on one side and "
            "row-parallel on the other (or fuses other blocks). Resume with the model the checkpoint was trained with."
        )
    return (src, dst) if src.size != dst.size else None


#: The most elements a staging window spans (see [Note: re-cutting tensor-parallel slices on load]).
WINDOW = 1 << 24

#: (a view of a staging window, the destination view it is copied into once read)
Copy = tuple[Tensor, Tensor]


def to_saved_layout(key: str, shard: Shard, info: dict[str, Any]) -> tuple[Shard, list[Copy]]:
    """``shard`` (this rank's destination pieces of ``key``) as pieces of the tensor the checkpoint stored, and the
    copies to make once they are read: ``shard`` itself where the cuts agree; else windows of the saved stacked
    tensor over this rank's runs (see [Note: re-cutting tensor-parallel slices on load]), read into staging buffers
    and copied into the destination pieces by ``finish`` (a window of one run is the destination view itself)."""
    cuts = _cuts(info, key, shard)
    if cuts is None:
        return shard, []
    src, dst = cuts
    granule = _granule(src, dst)
    pieces: list[tuple[int, Tensor]] = []
    copies: list[Copy] = []
    for start, piece in shard.pieces:
        for window in _windows(_runs(start, piece.numel(), granule, src, dst)):
            if len(window) == 1:
                offset, there, length = window[0]
                pieces.append((there, piece[offset : offset + length]))
                continue
            low = window[0][1]
            staging = torch.empty(window[-1][1] + window[-1][2] - low, dtype=shard.dtype)
            pieces.append((low, staging))
            copies += [
                (staging[there - low : there - low + length], piece[offset : offset + length])
                for offset, there, length in window
            ]
    return Shard(src.stacked, shard.dtype, pieces), copies


def finish(copies: list[Copy]) -> None:
    """Copy the read staging windows into the destination pieces (``to_saved_layout``)."""
    with torch.no_grad():
        for staged, dest in copies:
            dest.copy_(staged)


def _windows(runs: list[list[int]]) -> list[list[list[int]]]:
    """The runs grouped into windows of the saved tensor: in saved order, neighbours whose span stays within
    ``WINDOW`` elements. [Note: re-cutting tensor-parallel slices on load]: DCP loads a whole saved chunk for each
    item it reads, so many small reads of one chunk would load it many times; one read per window loads it once."""
    windows: list[list[list[int]]] = []
    for run in sorted(runs, key=lambda r: r[1]):
        last = windows[-1] if windows else None
        if last is not None and run[1] + run[2] - last[0][1] <= WINDOW:
            last.append(run)
        else:
            windows.append([run])
    return windows


def _granule(src: Cut, dst: Cut) -> int:
    """Elements that are contiguous in both stacked layouts, aligned in both: a slice's share of a block along the
    cut dimension times the elements after it is contiguous in the whole tensor and in the stacked one, at offsets
    that are multiples of it; the largest length dividing both cuts' is a unit of both."""
    _, _, after, share_src = src._sizes()
    share_dst = dst._sizes()[3]
    return after * math.gcd(share_src, share_dst)


def _runs(start: int, n: int, granule: int, src: Cut, dst: Cut) -> list[list[int]]:
    """``[offset in the piece, start in the saved stacked tensor, length]`` of the runs of the stacked range
    ``[start, start + n)`` at ``dst`` that are contiguous at ``src``: the range cut at every multiple of ``granule``
    (``_granule``), each part mapped by its first element, neighbours that stay contiguous merged (``CHUNK``
    parts at a time, so the index arithmetic holds a bounded number of indices)."""
    end = start + n
    first = (start // granule + 1) * granule
    total = 1 + max(0, -(-(end - first) // granule))  # the part from start, then one per multiple of granule
    runs: list[list[int]] = []
    for low in range(0, total, CHUNK):
        j = torch.arange(low, min(low + CHUNK, total), dtype=torch.int64)
        here = torch.where(j == 0, start, first + (j - 1) * granule)
        ends = torch.where(j + 1 < total, first + j * granule, end)
        there = whole_to_stacked(stacked_to_whole(here, dst), src)
        lengths = ends - here
        breaks = (torch.nonzero(there[1:] != there[:-1] + lengths[:-1]).flatten() + 1).tolist()
        for begin, stop in zip([0, *breaks], [*breaks, j.numel()]):
            run = [int(here[begin]) - start, int(there[begin]), int(ends[stop - 1] - here[begin])]
            if runs and runs[-1][1] + runs[-1][2] == run[1]:
                runs[-1][2] += run[2]  # contiguous across two chunks
            else:
                runs.append(run)
    return runs


def cannot_recut(info: dict[str, Any], canonical: Sequence[Sequence[Tensor]]) -> list[str]:
    """The checkpoint's tensors that do not re-cut to this run's slices: states of sliced parameters that are not
    per element, stacked at t > 1 (the metadata marks them) or whole at t = 1 where the parameter is a slice here
    (``canonical``: each optimizer's parameters by canonical index; the optimizers' states are checked only when
    they are given, so that the model alone loads from any checkpoint)."""
    marked = info.get("tensor_parallel", {})
    stuck = []
    for k, params in enumerate(canonical):
        prefix = f"optimizer/{k}/"
        stuck += [key for key, joins in marked.items() if joins is None and key.startswith(prefix)]
        for key, tensor in info["tensors"].items():
            if not key.startswith(prefix) or key in marked or tensor is None or len(tensor[0]) == 0:
                continue
            index = int(key[len(prefix) :].split("/", 1)[0])
            if index >= len(params):
                continue  # another model: refused by the optimizer's own checks
            here = Shard.placed(params[index], params[index].dtype)[0]
            if here.local_shape is not None and tuple(tensor[0]) != here.full_shape:
                stuck.append(key)
    return stuck
