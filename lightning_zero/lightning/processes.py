"""What the Trainer's and Fabric's strategies share: this process's place in the job, its launcher, the process
group and its shard groups, and the registered names.

It lives beside both adapters because Lightning's Trainer builds on Fabric the same way: ``ZeroStrategy`` and
``ZeroFabricStrategy`` both derive from ``ZeroProcesses`` and, after it, Lightning's ``ParallelStrategy`` (the
Trainer's and Fabric's are different classes with the same process API).
"""

from __future__ import annotations

import atexit
import faulthandler
import math
import sys
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed

from lightning_zero.activations.checkpointing import ActivationCheckpointing
from lightning_zero.comm import collectives
from lightning_zero.comm.groups import GroupSizes, ShardGroups
from lightning_zero.comm.traffic import Traffic
from lightning_zero.config import ZeroConfig, elements
from lightning_zero.engine.construction import InitModuleRecording
from lightning_zero.engine.engine import ZeroEngine
from lightning_zero.engine.policies import group_sizes
from lightning_zero.memory.host_memory import release_freed_memory
from lightning_zero.process.faults import fault_point
from lightning_zero.process.shutdown import GUARD
from lightning_zero.shards.store import ShardedStorage
from lightning_zero.stage3.units import UnitRuntime
from lightning_zero.stages import all_policies, policy_for

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS = ("popen", "spawn", "fork", "forkserver")


class ZeroProcesses:
    """The base both strategies list before their Lightning ``ParallelStrategy``: each calls its ``__init__`` first,
    then Lightning's ``ParallelStrategy.__init__``.

    It reads the attributes annotated below, which Lightning's ``ParallelStrategy`` (the Trainer's or Fabric's: two
    classes with the same process API) defines, and gives Lightning the properties it reads of a strategy
    (``root_device``, ``num_processes``, ``distributed_sampler_kwargs``, ``process_group_backend``).
    """

    # Lightning's ParallelStrategy's, read here
    parallel_devices: Optional[list[torch.device]]
    cluster_environment: Optional[ClusterEnvironment]
    num_nodes: int
    global_rank: int
    local_rank: int
    node_rank: int
    world_size: int

    def __init__(
        self,
        config: ZeroConfig,
        process_group_backend: Optional[str],
        timeout: Optional[Union[float, timedelta]],
        start_method: StartMethod,
    ) -> None:
        if start_method not in START_METHODS:
            raise ValueError(
                f"`start_method` must be one of {', '.join(map(repr, START_METHODS))}, got {start_method!r}."
            )
        self.config = config
        """The engine's options (see ``config.py``)."""
        self.policy = policy_for(config.stage)
        self._process_group_backend = process_group_backend
        self._timeout = process_group_timeout(timeout)
        self._start_method = start_method
        self.engine: Optional[ZeroEngine] = None
        """The engine of the last setup (see ``engine/engine.py``); it stays after teardown for saving."""
        self._init_module = InitModuleRecording()
        """Stage 3: the recording of the Trainer's ``init_module(empty_init=True)`` or Fabric's ``init_module()``, on
        until setup."""
        self.shard_groups = ShardGroups()
        """The engine's communication object: the process groups it shards over and replicates across (made with
        the process group) and the counters of what their collectives move (``traffic``)."""

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        mesh = self.shard_groups.mesh
        if mesh is not None:  # the tensor-parallel ranks of a data-parallel row see the same batches
            return {"num_replicas": mesh["data_parallel"].size(), "rank": mesh["data_parallel"].get_local_rank()}
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def group_sizes(self) -> GroupSizes:
        """The sizes of the job's groups over its nodes and devices; refuses sizes that do not divide (see [Note: the
        group sizes are resolved in one place] in ``comm/groups.py``)."""
        per_node = max(1, self.num_processes)
        return group_sizes(self.config, self.num_nodes * per_node, per_node, self.num_nodes)

    @property
    def shard_group_size(self) -> int:
        """k, the ranks each model state is sharded over (the world size unless hybrid sharding)."""
        return self.group_sizes.shard

    @property
    def secondary_shard_group_size(self) -> Optional[int]:
        """hpZ's secondary group size (``None``: off)."""
        return self.group_sizes.secondary

    def gathered_parameters(self) -> AbstractContextManager:
        """Every parameter whole inside, on every rank (a collective: every rank enters), for code that reads the
        weights between steps, e.g. ``with trainer.strategy.gathered_parameters(): ema.update(model)``; see
        ``ZeroEngine.gathered_parameters``."""
        if self.engine is None:
            raise RuntimeError(
                "`gathered_parameters()` needs the model set up: use it from `on_fit_start` on "
                "(Fabric: after `fabric.setup`)."
            )
        return self.engine.gathered_parameters()

    def grad_norms(self, norm_type: Union[float, int, str] = 2.0, optimizer: Optional[Any] = None) -> dict[str, Any]:
        """Lightning's ``grad_norm(module, norm_type)`` with ``ddp``'s values, from the gradient shards (a
        collective), e.g. ``self.log_dict(self.trainer.strategy.grad_norms(2))`` in ``on_before_optimizer_step``;
        see ``ZeroEngine.grad_norms``. Under zero2/zero3 ``param.grad`` is ``None`` there (the gradients were
        reduced into shards as they were made)."""
        if self.engine is None:
            raise RuntimeError("`grad_norms()` needs the model set up (and a backward done).")
        return self.engine.grad_norms(float(norm_type), optimizer)

    @property
    def storages(self) -> list[ShardedStorage]:
        """The storages of the engine's parameter store (those of the last setup: a checkpoint can still be saved
        after fit); see [Note: the store and the optimizers] in ``store.py``."""
        return self.engine.store.storages if self.engine is not None else []

    @property
    def runtime(self) -> Optional[UnitRuntime]:
        """Stage 3's unit runtime while set up."""
        return self.engine.runtime if self.engine is not None else None

    @property
    def activations(self) -> Optional[ActivationCheckpointing]:
        """ZeRO-R's activation checkpointing while set up (``None`` without it)."""
        return self.engine.activations if self.engine is not None else None

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's barrier (both APIs), on the process group's device."""
        collectives.barrier(self.root_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's broadcast of a picklable object (both APIs)."""
        return collectives.broadcast_object(obj, src)

    @staticmethod
    def _reduce_tensor(tensor: Any, group: Optional[Any], reduce_op: Optional[Union[Any, str]]) -> Any:
        """Lightning's ``reduce`` (the Trainer's) and ``all_reduce`` (Fabric's): a tensor reduced over the ranks (or
        ``group``), anything else as it is."""
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def _guard_signals(self) -> None:
        """From here on SIGINT/SIGTERM/SIGUSR1 act at step boundaries every rank agrees on (see [Note: signals act
        at agreed step boundaries] in ``process/shutdown.py``)."""
        GUARD.install(self.config.shutdown_timeout)

    def _step_boundary(self, point: Optional[str] = None) -> None:
        """A step boundary (a collective: every rank reaches it): act on a signal any rank received; ``point`` names
        it for fault injection (see [Note: fault points] in ``process/faults.py``)."""
        GUARD.safe_point(self.shard_groups)
        if point is not None:
            fault_point(point)

    @staticmethod
    def _release_signals(failure: Optional[BaseException] = None) -> None:
        """At teardown: the handlers go back and the deadline's thread is joined; a Ctrl-C during the last checkpoint
        write still stops the script (after a ``failure`` it is only reported: see [Note: a failed run claims no
        agreed stop] in ``process/shutdown.py``)."""
        GUARD.remove()
        GUARD.raise_pending(failure)

    @property
    def traffic(self) -> Traffic:
        """The payload of every collective of this strategy's engine, by kind and scope, since its last ``reset()``
        (see [Note: what the counters count] in ``comm/traffic.py``); made anew with the process group."""
        return self.shard_groups.traffic

    @property
    def device_mesh(self) -> Optional[Any]:
        """With ``tensor_parallel_size > 1``, the (``"data_parallel"``, ``"tensor_parallel"``) ``DeviceMesh`` (made
        with the process group), as Lightning's ``ModelParallelStrategy`` has it; ``None`` otherwise."""
        return self.shard_groups.mesh

    def _make_launcher(self, script_launcher: type, multiprocessing_launcher: type) -> Any:
        """Lightning's script launcher (``popen``) or its multiprocessing launcher; a bad ``shard_group_size``
        fails here, before any process starts."""
        assert self.cluster_environment is not None
        self.group_sizes  # noqa: B018 - validates the sizes
        if self._start_method == "popen":
            return script_launcher(self.cluster_environment, self.num_processes, self.num_nodes)
        return multiprocessing_launcher(self, start_method=self._start_method)

    def _start_distributed(self) -> None:
        """After Lightning's ``setup_environment``: the allocator setting, the seed, this process's ranks, the process
        group and the shard groups."""
        # a fatal signal in a rank (a segfault in a kernel, an abort) prints every thread's Python traceback
        # instead of ending the process silently
        try:
            faulthandler.enable(file=sys.__stderr__ or sys.stderr, all_threads=True)  # None means sys.stderr
        except (AttributeError, ValueError, OSError):  # no real stderr (a captured or closed stream): nothing to enable
            pass
        if self.root_device.type == "cpu":
            release_freed_memory(elements(self.config.host_mmap_threshold))
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        if not collectives.is_initialized():
            # [Note: nothing outlives the run]
            # Every thread the package starts ends with the run that started it (the deadline's thread is joined
            # when the guard is removed, the disk tier's reader by `concurrent.futures` at exit), and the process
            # group it made is destroyed at exit, before the interpreter's shutdown: a group left to module teardown
            # takes its communicator threads into C++'s static destructors, and a zero3 run that saved after `fit`
            # then sometimes ended with "terminate called without an active exception" (exit code 134).
            atexit.unregister(collectives.release_process_groups)
            atexit.register(collectives.release_process_groups)
        store = collectives.attempt_store(self.global_rank, self.world_size, self._timeout)
        with collectives.restart_hint("the default process group"):
            _init_dist_connection(
                self.cluster_environment, backend, timeout=self._timeout, **({} if store is None else {"store": store})
            )
        self.shard_groups = self.group_sizes.make(self.root_device.type)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment and ``rank_zero_only`` this process's ranks."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Lightning sets this attribute on its function at import and does not declare it
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """``zero1``, ``zero2``, ``zero3`` and their ``_spawn`` / ``_fork`` variants."""
        for policy in all_policies():
            for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
                strategy_registry.register(
                    f"{policy.name}{suffix}",
                    cls,
                    override=True,
                    stage=policy.stage,
                    start_method=start_method,
                    description=f"ZeRO stage {policy.stage} ({policy.partitions}), start method '{start_method}'",
                )


def process_group_timeout(value: object) -> Optional[timedelta]:
    """The ``timeout`` option as the ``timedelta`` ``torch.distributed`` wants: seconds (an int or a
    float, as a YAML file gives them) or a ``timedelta``; ``None`` keeps torch's default."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, timedelta)):
        raise TypeError(
            f"`timeout` must be a number of seconds (e.g. `timeout=600`) or a datetime.timedelta, got {value!r}."
        )
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(
            f"`timeout` must be a positive, finite time (how long a collective may wait before it fails),"
            f" got {value!r}. Leave it out for the default of 30 minutes."
        )
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)
