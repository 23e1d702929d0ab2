"""The only module that calls ``torch.distributed``; every collective counts what it moves (``traffic.py``).

[Note: reduce-scatter and all-gather on gloo]
gloo's ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` are much slower than its all-reduce of the same
buffer, and its all-reduce moves twice the bytes a reduce-scatter or an all-gather needs (timings:
benchmarks/RESULTS.md, "Profile and fixes (part 5)" and "Pairwise exchanges on gloo", from
``benchmarks/gloo_collectives.py``). So on gloo the two run as pairwise exchanges (``_exchange_gather``,
``_exchange_reduce``): every rank sends each peer that peer's chunk and receives its own from each peer, point
to point, straight into the output; a reduce-scatter then adds its own chunk to what it received. That is the least
any algorithm moves, half of the all-reduce's, with no temporary: an all-gather receives into the output's chunks,
and a reduce-scatter in a group of two receives into the output. A larger group's reduce-scatter would need a
receive buffer per peer, so it stays one in-place all-reduce of its (scratch) input and a copy of this rank's chunk.
The sum of two chunks is the same whichever rank adds it (``a + b == b + a`` exactly), so at N = 2 the reduced
values are bit-identical to DDP's all-reduce. Each exchange has a tag of its own, counted per process group in the
order every rank issues them (see [Note: lockstep] in ``buckets.py``).

A point-to-point message whose size differs from the receive (two ranks out of step) aborts the process inside gloo,
as an all-reduce of two sizes does. So a gather whose order follows the model's control flow (stage 3's units) takes
the exchange only where stage 3's lockstep check has verified the unit on every rank before the gather is issued
(``verified=True``; see [Note: a check is waited for one unit late] in ``stage3/lockstep.py``); otherwise it keeps
gloo's own all-gather, which fails with an error. gloo's own all-gather allocates a second, full-size output inside
gloo and copies it out (benchmarks/RESULTS.md, "Where the overhead went"), so stage 3 gathers a unit bucket by
bucket: the temporary is bounded by the bucket size (see [Note: the default bucket size] in ``shards/policy.py``),
not the unit's. NCCL keeps its native collectives, and ``LIGHTNING_ZERO_GLOO_NATIVE=1`` keeps gloo's (for comparisons).

Counting lives in ``traffic.py`` ([Note: what the counters count], [Note: counted groups]).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch.autograd import profiler as autograd_profiler
from torch.distributed.constants import default_pg_timeout

from lightning_zero.comm.traffic import Group

# torch >= 2.12 renames the tensor collectives; older releases (the GPU machines run 2.11) only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


#: torch's process group that communicates nothing (``torch.distributed.Backend.FAKE``).
SIMULATED_BACKEND = "fake"


def _pg(group: Optional[Any]) -> Optional[Any]:
    """The ``torch.distributed`` process group behind ``group`` (a ``Group``, a process group or ``None``)."""
    return group.process_group if isinstance(group, Group) else group


def _count(kind: str, tensor: torch.Tensor, group: Optional[Any]) -> None:
    """Count one ``kind`` collective of ``tensor`` if ``group`` is a ``Group`` (see [Note: counted groups] in
    ``traffic.py``)."""
    if isinstance(group, Group):
        group.traffic.add(kind, tensor, group.scope)


class _DoneWork:
    """Stands in for a ``dist.Work`` handle when nothing had to be communicated."""

    def wait(self) -> bool:
        return True


def done() -> Any:
    """A work handle for something already finished (a synchronous collective behind an asynchronous interface)."""
    return _DoneWork()


DIVERGENCE_HINT = (
    "The ranks probably issued different collectives (a rank that ran out of data before the others, data-dependent "
    "control flow, or a rank that skipped a step). Every rank must run the same number of batches (an "
    "IterableDataset must give each rank as many) and the same modules in the same order; under zero3 prefer zero2 "
    "for models whose ranks take different branches."
)


def wait(work: Any, what: str) -> None:
    """Wait for ``work``; a failure (a peer that never joined, the process group timeout) says what was waited for."""
    try:
        work.wait()
    except RuntimeError as error:
        raise RuntimeError(f"ZeRO could not {what}: {error}. {DIVERGENCE_HINT}") from error


def is_initialized() -> bool:
    """Whether this process has joined a process group (of any size)."""
    return dist.is_available() and dist.is_initialized()


def is_distributed(group: Optional[Any] = None) -> bool:
    """Whether a process group of more than one rank is there to talk to."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(_pg(group)) > 1


def simulated() -> bool:
    """Whether this process is one rank of a simulated world: torch's fake process group, whose collectives move
    nothing and write no output (see [Note: one rank of a simulated world] in ``engine/simulated.py``)."""
    return is_initialized() and dist.get_backend() == SIMULATED_BACKEND


def register_simulated_backend() -> None:
    """Make ``init_process_group("fake", ...)`` available (torch registers the backend when its module is imported)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


def world_size(group: Optional[Any] = None) -> int:
    """Ranks in ``group``; 1 without a process group."""
    return dist.get_world_size(_pg(group)) if dist.is_available() and dist.is_initialized() else 1


def rank(group: Optional[Any] = None) -> int:
    """This process's rank in ``group``; 0 without a process group."""
    return dist.get_rank(_pg(group)) if dist.is_available() and dist.is_initialized() else 0


def job_store() -> Optional[Any]:
    """The key-value store of the default process group (rendezvous's ``TCPStore``); ``None`` without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


class _CopyAfter:
    """A work handle whose ``wait`` also copies ``source`` into ``target`` (the chunk of a reduce-scatter on gloo)."""

    def __init__(self, work: Any, target: torch.Tensor, source: torch.Tensor) -> None:
        self.work, self.target, self.source = work, target, source

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.target.copy_(self.source)
            self.work = None
        return True


def _on_gloo(group: Optional[Any]) -> bool:
    """Whether reduce-scatter and all-gather avoid gloo's own (see [Note: reduce-scatter and all-gather on gloo])."""
    return dist.get_backend(_pg(group)) == "gloo" and os.environ.get("LIGHTNING_ZERO_GLOO_NATIVE", "0") != "1"


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None, async_op: bool = False
) -> Any:
    """Sum ``input`` (``world_size`` equal chunks) over ranks; this rank's chunk of the sum lands in ``output``.

    ``input`` is scratch: on gloo its contents are undefined afterwards.
    """
    if not is_distributed(group):
        output.copy_(input)
        return _DoneWork()
    _count("reduce_scatter", input, group)
    if not _on_gloo(group):
        work = _reduce_scatter_single(output, input, group=_pg(group), async_op=async_op)
    elif world_size(group) == 2:
        work = _exchange_reduce(output, input, group)
    else:
        n, r = output.numel(), rank(group)
        work = _CopyAfter(dist.all_reduce(input, group=_pg(group), async_op=True), output, input[r * n : (r + 1) * n])
    if not async_op:
        work.wait()
    return work


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[Any] = None,
    async_op: bool = False,
    verified: bool = True,
) -> Any:
    """Concatenate every rank's ``input`` into ``output``; ``input`` may be this rank's slice of ``output``.

    ``verified=False`` keeps gloo's own all-gather: for gathers whose order follows the model's control flow and that
    no check has matched across ranks, where two ranks out of step must fail with an error (see [Note: reduce-scatter
    and all-gather on gloo]).
    """
    if not is_distributed(group):
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _DoneWork()
    _count("all_gather", output, group)
    if verified and _on_gloo(group):
        work = _exchange_gather(output, input, group)
        if not async_op:
            work.wait()
        return work
    work = _all_gather_single(output, input, group=_pg(group), async_op=async_op)
    return work if async_op else _DoneWork()


class _Exchange:
    """The sends and receives of one pairwise exchange; ``wait`` waits for all of them, then runs ``then``."""

    def __init__(self, works: list[Any], then: Optional[Callable[[], object]] = None) -> None:
        self.works: Optional[list[Any]] = works
        self.then = then

    def wait(self) -> bool:
        if self.works is not None:
            works, self.works = self.works, None
            for work in works:
                work.wait()
            if self.then is not None:
                self.then()
        return True


# [Note: exchange tags are counted per process group]
# The point-to-point exchanges of one process group must carry the same tag on every rank, so every rank counts its
# exchanges per process group; the process groups are the job's (see [Note: process groups are made once per job]),
# shared by every engine of the process, so their counts are too. Keyed by the group's id, never reset: a tag
# only has to differ from the tags still in flight.
_TAGS: dict[int, int] = {}


def _next_tag(group: Optional[Any]) -> int:
    """The tag of the next exchange over ``group``: every rank counts its exchanges over each process group in the
    same order, so the tags match (see [Note: reduce-scatter and all-gather on gloo])."""
    pg = _pg(group)
    key = id(pg if pg is not None else dist.group.WORLD)
    _TAGS[key] = tag = (_TAGS.get(key, 0) + 1) % (1 << 30)
    return tag


def _exchange_gather(output: torch.Tensor, input: torch.Tensor, group: Optional[Any]) -> _Exchange:
    """All-gather point to point: send ``input`` to every peer, receive each peer's chunk into its place in
    ``output``; this rank's chunk is copied in if ``input`` is not already there."""
    pg, n, r, size = _pg(group), input.numel(), rank(group), world_size(group)
    tag, works = _next_tag(group), []
    for step in range(1, size):
        to, source = (r + step) % size, (r - step) % size
        works.append(dist.isend(input, group=pg, group_dst=to, tag=tag))
        works.append(dist.irecv(output[source * n : (source + 1) * n], group=pg, group_src=source, tag=tag))
    mine = output[r * n : (r + 1) * n]
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input)
    return _Exchange(works)


def _exchange_reduce(output: torch.Tensor, input: torch.Tensor, group: Optional[Any]) -> _Exchange:
    """Reduce-scatter in a group of two, point to point: send the peer its chunk of ``input``, receive the peer's
    part of this rank's chunk into ``output``, and add this rank's own part when waited for."""
    pg, n, r = _pg(group), output.numel(), rank(group)
    tag, peer = _next_tag(group), 1 - r
    works = [
        dist.isend(input[peer * n : (peer + 1) * n], group=pg, group_dst=peer, tag=tag),
        dist.irecv(output, group=pg, group_src=peer, tag=tag),
    ]
    return _Exchange(works, lambda: output.add_(input[r * n : (r + 1) * n]))


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None) -> None:
    """Send chunk j of ``input`` (``world_size`` equal chunks) to rank j; chunk i of ``output`` is rank i's chunk for
    this rank. Synchronous; counted as ``all_to_all`` (the payload sent)."""
    if not is_distributed(group):
        output.copy_(input)
        return
    _count("all_to_all", input, group)
    dist.all_to_all_single(output, input, group=_pg(group))


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Optional[Any] = None) -> torch.Tensor:
    """In-place all-reduce (sum unless ``op`` says otherwise); returns ``tensor``."""
    if is_distributed(group):
        _count("all_reduce", tensor, group)
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=_pg(group))
    return tensor


def all_reduce_async(tensor: torch.Tensor, group: Optional[Any] = None) -> Any:
    """In-place sum over ``group``, started now; returns the work to ``wait`` on (done at once without peers)."""
    if not is_distributed(group):
        return _DoneWork()
    _count("all_reduce", tensor, group)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=_pg(group), async_op=True)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Optional[Any] = None) -> torch.Tensor:
    """In-place broadcast from global rank ``src``; returns ``tensor``."""
    if is_distributed(group):
        _count("broadcast", tensor, group)
        dist.broadcast(tensor, src=src, group=_pg(group))
    return tensor


def barrier(device: Optional[torch.device] = None) -> None:
    """Wait for every rank (NCCL needs to know this rank's device)."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl" and device is not None and device.index is not None:
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s (picklable) ``obj`` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src)
    return holder[0]


MAX = dist.ReduceOp.MAX


def gather_objects(obj: Any, dst: int = 0, group: Optional[Any] = None) -> Optional[list[Any]]:
    """Pickle ``obj`` from every rank to ``dst``: the list on ``dst``, ``None`` elsewhere."""
    if not is_distributed(group):
        return [obj]
    out: Optional[list[Any]] = [None] * world_size(group) if rank(group) == dst else None
    dist.gather_object(obj, out, dst=dst, group=_pg(group))
    return out


def all_gather_objects(obj: Any, group: Optional[Any] = None) -> list[Any]:
    """Pickle ``obj`` from every rank to every rank."""
    if not is_distributed(group):
        return [obj]
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=_pg(group))
    return out


def new_group(rank_lists: list[list[int]]) -> Optional[Any]:
    """Make one process group per list of global ranks (every rank must call this with the same lists) and return
    the one this rank belongs to, ``None`` if none."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    me, mine = dist.get_rank(), None
    for ranks in rank_lists:
        group = make_group(sorted(ranks))
        if me in ranks:
            mine = group
    return mine


# [Note: a restarted torchrun attempt]
# By default torchrun shares its rendezvous store with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``), and that
# store outlives a restart (``--max-restarts``): the keys of the previous attempt's process groups are still in it, so
# the restarted workers read the old attempt's addresses and fail to connect ("Connection refused"), or wait in a
# group's creation. So the default group of a strategy of ours is made on the same store with the keys of each attempt
# under a prefix of their own (``attempt_store``, torch's own ``env://`` rendezvous, nothing else), and every
# group it makes after that has the default group's timeout (``make_group``; ``dist.new_group`` would give it
# torch's 30 minutes, whatever the user's ``timeout``). A failure while groups are made in a restarted attempt says
# what the likely cause is and how to opt out of the sharing (``restart_hint``): a default group made by the user
# (a plain loop under torchrun) reads the shared store as it is.

#: torchrun's opt-out of the shared rendezvous store: each attempt then gets a store of its own.
FRESH_STORE_VARIABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def restart_attempt() -> int:
    """Which attempt of a torchrun job this is (0 for the first, and outside torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def attempt_store(rank: int, world_size: int, timeout: Optional[timedelta]) -> Optional[Any]:
    """The store to make the default process group on under torchrun's shared store: torch's ``env://`` rendezvous
    with this attempt's keys under a prefix of their own (see [Note: a restarted torchrun attempt]); ``None`` (torch
    makes its own) elsewhere."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or dist.is_initialized():
        return None
    timeout = timeout or default_pg_timeout
    with restart_hint("the rendezvous store"):
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"default_pg/attempt{restart_attempt()}", store)


def _default_options() -> Optional[Any]:
    """The backend options of the default process group (its timeout among them), ``None`` if torch does not say."""
    default = dist.group.WORLD
    if default is None:
        return None
    for device in getattr(default, "_device_types", None) or [torch.device("cpu")]:
        try:
            options = default._get_backend(torch.device(device)).options
        except Exception:  # a backend without options (the fake one), or none for this device
            continue
        if isinstance(getattr(options, "_timeout", None), timedelta):
            return options
    return None


def group_timeout() -> Optional[timedelta]:
    """The timeout of the default process group, which every group of ours takes; ``None`` if torch does not say."""
    options = _default_options()
    return None if options is None else options._timeout


def make_group(ranks: Optional[list[int]] = None, backend: Optional[str] = None) -> Any:
    """``dist.new_group`` with the default group's timeout (see [Note: a restarted torchrun attempt])."""
    if simulated():  # a simulated world's groups are all fake, the CPU's control groups too
        backend = None
    with restart_hint("a process group"):
        return dist.new_group(ranks, backend=backend, timeout=group_timeout())


@contextmanager
def restart_hint(what: str) -> Iterator[None]:
    """Inside a restarted torchrun attempt, a failure to make ``what`` is raised again with the likely cause and the
    remedy (see [Note: a restarted torchrun attempt]); elsewhere it is raised as it is."""
    try:
        yield
    except Exception as error:
        attempt = restart_attempt()
        if attempt == 0:
            raise
        cause = " ".join(str(error).split())
        raise RuntimeError(
            f"lightning-zero: making {what} failed in torchrun's restarted attempt {attempt} ({type(error).__name__}:"
            f" {cause}). The rendezvous store torchrun shares with its workers may hold the previous attempt's "
            f"addresses: run torchrun with `{FRESH_STORE_VARIABLE}` in its environment, so that each attempt gets "
            "a store of its own."
        ) from error


def global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (itself in the default group)."""
    pg = _pg(group)
    return group_rank if pg is None else dist.get_global_rank(pg, group_rank)


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """Collective: ``torch.distributed``'s ``DeviceMesh`` of ``shape`` over every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    options = _default_options()  # its timeout: see [Note: a restarted torchrun attempt]
    override: Optional[dict[Union[int, str], Any]] = None if options is None else dict.fromkeys(names, options)
    with restart_hint("a device mesh"):
        return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)


def agree_max(values: list[int], group: Optional[Group] = None) -> list[int]:
    """The element-wise maximum of small integer flags over all ranks (collective), on the CPU; counted as
    ``control`` under ``group``'s scope (the world group of a ``ShardGroups``).

    Under NCCL a gloo group made for this once per job keeps the device stream out of it (no device
    synchronization per step).
    """
    if not is_distributed():
        return list(values)
    control = (
        None
        if dist.get_backend() in ("gloo", SIMULATED_BACKEND)
        else job_group(("control",), lambda: make_group(backend="gloo"))
    )
    tensor = torch.tensor(values, dtype=torch.int32)
    _count("control", tensor, group)
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=control)
    except RuntimeError as error:
        raise RuntimeError(
            f"ZeRO could not agree with the other ranks at a step's boundary: {error}. {DIVERGENCE_HINT}"
        ) from error
    return tensor.tolist()


def make_lockstep_group() -> Optional[Any]:
    """Collective (every rank calls it at setup): the gloo group stage 3's lockstep check talks over, made once per
    job; ``None`` without a process group of more than one rank. A group of its own, so that a check never waits
    behind the data collectives in flight (gloo runs one group's collectives one after the other)."""
    if not is_distributed():
        return None
    return job_group(("lockstep",), lambda: make_group(backend="gloo"))


_JOB_GROUPS: dict[tuple[Any, ...], Any] = {}


def job_group(key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """The process groups (or mesh) ``make`` makes, made once per default process group and ``key``.

    [Note: process groups are made once per job]
    ``dist.new_group`` is a collective that every rank must call in the same order, and each group holds
    communicators (NCCL's, gloo's sockets and threads) for as long as the job runs: making them again for every
    ``fit``, engine or test in one process would leak them and ask every rank to agree on when. So this registry,
    keyed by the default group and what the groups are for, is process state by design; it holds process groups
    only. What is counted over them belongs to each ``ShardGroups`` (see
    [Note: counted groups] in ``traffic.py``).
    """
    full = (id(dist.group.WORLD), *key)
    if full not in _JOB_GROUPS:
        _JOB_GROUPS[full] = make()
    return _JOB_GROUPS[full]


def release_process_groups() -> None:
    """Destroy every process group of this process (the job groups above first), so that no communicator thread
    (gloo's loops, the store's server) is left to C++'s static destructors at interpreter shutdown, where a joinable
    thread aborts the process ("terminate called without an active exception"). Run at exit (see [Note: nothing
    outlives the run] in ``lightning/processes.py``); a no-op without a process group."""
    _JOB_GROUPS.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class PendingPositions:
    """Every rank's few integers (the same count on each) on their way to every rank, over ``group`` (from
    ``make_lockstep_group``), on the CPU: made when sent, ``result`` waits. Control messages, not payload:
    not counted."""

    def __init__(self, values: list[int], group: Any) -> None:
        self._width = len(values)
        self._out = torch.empty(world_size(group) * len(values), dtype=torch.int64)
        self._work = _all_gather_single(
            self._out, torch.tensor(values, dtype=torch.int64), group=_pg(group), async_op=True
        )

    def result(self) -> list[list[int]]:
        """Wait for the exchange; one row per rank."""
        wait(self._work, "exchange stage 3's lockstep check")
        return self._out.view(-1, self._width).tolist()


def profiler_label(what: str, subject: str) -> AbstractContextManager[Any]:
    """A ``torch.profiler`` range ``lightning_zero::<what> <subject>`` (a stage 3 unit's verb or hook, a gradient
    bucket's reduce-scatter), so that a trace reads as the data path (see [Note: one vocabulary for stage 3] in
    ``stage3/unit.py``); nothing at all while no profiler runs."""
    if not autograd_profiler._is_profiler_enabled:
        return nullcontext()
    return torch.profiler.record_function(f"lightning_zero::{what} {subject}")
