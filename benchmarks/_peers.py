"""The peers ``compare.py`` measures ZeRO against, besides Lightning's ``ddp``: FSDP2 and DeepSpeed.

Both are optional: :func:`missing` says why a peer cannot run here (the run is then skipped with that reason),
and nothing in ``lightning_zero`` imports them.

- FSDP2: Lightning's ``ModelParallelStrategy`` (``data_parallel_size=N``, ``tensor_parallel_size=1``) with
  ``fully_shard`` per block and at the root in ``configure_model`` (:class:`benchmarks._model.FSDP2GPT`); it runs on
  CPU with gloo.
- DeepSpeed: its engine directly (Lightning's ``deepspeed`` strategy requires CUDA), ZeRO stage 1/2/3, fp32, the
  user's ``torch.optim.AdamW`` as the client optimizer (no compiled ops), ``DS_ACCELERATOR=cpu`` on CPU. The loop
  is the plain ``engine(batch)`` / ``engine.backward`` / ``engine.step`` with the same data, seed and sampler.
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import nullcontext
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks._model import BenchGPT, GPTSize, make_optimizer, token_data
from benchmarks._probes import StepTimer, peak_memory, reachable_tensors, tensor_bytes


def missing(strategy: str) -> Optional[str]:
    """Why ``strategy`` cannot run on this machine, or ``None``."""
    if strategy == "fsdp2":
        try:
            from lightning.pytorch.strategies import ModelParallelStrategy
            from torch.distributed.fsdp import fully_shard
        except ImportError as error:
            return f"FSDP2 needs torch >= 2.4 and lightning >= 2.4 ({error})"
        return None if fully_shard and ModelParallelStrategy else "FSDP2 is not available"
    if strategy.startswith("deepspeed"):
        if importlib.util.find_spec("deepspeed") is None:
            return "DeepSpeed is not installed (pip install -c <(echo torch==$TORCH) deepspeed)"
        return None
    return None


def fsdp2_strategy(world_size: int) -> Any:
    """Lightning's FSDP2 strategy: pure data parallelism over ``world_size`` ranks."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)


def fsdp2_model_states(module: torch.nn.Module, optimizers: list[Any]) -> dict[str, int]:
    """This rank's parameters, gradients and AdamW states (the local shards of FSDP2's DTensors)."""
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
    params = tensor_bytes(module.parameters())
    grads = tensor_bytes(p.grad for p in module.parameters())
    states = tensor_bytes(v for o in optimizers for st in o.state.values() for v in st.values())
    return {"params": params, "grads": grads, "optimizer_states": states, "model_states": params + grads + states}


def deepspeed_config(stage: int, size: GPTSize, world_size: int, bucket: Optional[int] = None,
                     offload: bool = False) -> dict[str, Any]:
    """fp32, ZeRO ``stage``, overlap on; DeepSpeed's own bucket sizes unless ``bucket`` (elements) is given;
    ``offload``: ZeRO-Offload of the optimizer (``offload_optimizer`` to the CPU)."""
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if bucket is not None:
        zero.update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=5_000_000, stage3_param_persistence_threshold=100_000)
    return {"train_micro_batch_size_per_gpu": size.batch, "gradient_accumulation_steps": 1,
            "train_batch_size": size.batch * world_size, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def run_deepspeed(stage: int, size: GPTSize, steps: int, warmup: int, samples: int,
                  bucket: Optional[int] = None, offload: bool = False) -> dict[str, Any]:
    """Train :class:`BenchGPT` (as a plain module) with DeepSpeed's engine for ``steps`` steps; the same figures as the Lightning runs.
    With ``offload`` the optimizer is DeepSpeed's own ``DeepSpeedCPUAdam`` (AdamW mode), as its ZeRO-Offload wants."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    config = deepspeed_config(stage, size, world_size, bucket, offload)
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)  # DeepSpeed's view of the group
    torch.manual_seed(0)
    init = deepspeed.zero.Init(config_dict_or_path=config) if stage == 3 else nullcontext()
    with init:
        net = BenchGPT(size, samples, meta_init=False)  # built in __init__, where zero.Init partitions it
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(net.parameters(), lr=3e-4, weight_decay=0.1, adamw_mode=True)
    else:
        optimizer = make_optimizer(net.parameters())
    engine, optimizer, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=config,
                                                   dist_init_required=False)
    data = token_data(size, samples)
    loader = DataLoader(data, batch_size=size.batch, shuffle=False,
                        sampler=DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False))
    timer = StepTimer(warmup, device)
    states: dict[str, int] = {}
    loss = float("nan")
    for step, (tokens, targets) in enumerate(loader):
        if step >= steps:
            break
        timer.start()
        out = _ds_loss(engine, tokens, targets)
        engine.backward(out)
        if step == min(2, steps - 1):
            states = deepspeed_model_states(engine)
        engine.step()
        timer.stop()
        loss = float(out.detach())
    return {**timer.summary(), "states": states, "peak_memory": peak_memory(device), "loss": loss}


def _ds_loss(engine: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    logits = engine(tokens)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def deepspeed_model_states(engine: Any) -> dict[str, int]:
    """Bytes of the tensors reachable from DeepSpeed's engine and ZeRO optimizer, and the module's parameters and
    gradients (stage 3: their ``ds_tensor`` partitions), counted once per storage."""
    module_params = list(engine.module.parameters())
    partitions = [getattr(p, "ds_tensor", None) for p in module_params]
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    states = [v for st in inner.state.values() for v in st.values()]
    others = reachable_tensors(engine.optimizer, depth=3)
    total = tensor_bytes(module_params + partitions + [p.grad for p in module_params] + states + others)
    return {"optimizer_states": tensor_bytes(states), "model_states": total}
