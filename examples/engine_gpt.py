"""The GPT of ``examples/gpt.py`` trained by a plain PyTorch loop with ``ZeroEngine``: no Trainer, no Fabric.

    torchrun --nproc_per_node 2 examples/engine_gpt.py                  # zero3 on 2 CPU processes, 60 steps
    torchrun --nproc_per_node 2 examples/engine_gpt.py --stage 2 --max-steps 200
    python examples/generate.py checkpoints/gpt-engine/last.ckpt --prompt "ROMEO:"   # sample from it

``torchrun`` starts the processes and sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``; this script initializes
``torch.distributed`` itself (gloo on CPUs, NCCL on GPUs), builds the model under ``sharded_construction`` (zero3: no
rank ever holds it whole), gives each rank its part of the data with a ``DistributedSampler``, and writes the same
sharded checkpoint the Trainer and Fabric write (``examples/generate.py`` reads it; ``python examples/gpt.py fit
--config examples/configs/zero3.yaml --model.n_layer 2 --model.dropout 0 --ckpt_path checkpoints/gpt-engine/last.ckpt``
resumes it under the Trainer: weights, optimizer states and the step counter, with the same model and param groups).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from gpt import GPT, ShakespeareData  # examples/gpt.py, next to this file
from torch.utils.data import DataLoader, DistributedSampler

from lightning_zero import ZeroEngine, sharded_construction


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--precision", default="32-true", help='"32-true", "bf16-mixed", "16-mixed" or "bf16-true"')
    parser.add_argument("--out", default="checkpoints/gpt-engine/last.ckpt")
    return parser.parse_args()


def setup_distributed() -> torch.device:
    """Join the job ``torchrun`` started; this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def main() -> None:
    args = parse_args()
    device = setup_distributed()
    torch.manual_seed(0)  # the same initial weights on every rank (zero3 builds each rank's shard of them)
    with sharded_construction(device) as recording:  # zero3 only: recorded on the meta device, built unit by unit
        model = GPT(n_layer=2, dropout=0.0)
    optimizer = torch.optim.AdamW(model.param_groups(), lr=3e-3)  # the Trainer's groups: it resumes the checkpoint
    engine = ZeroEngine(model, [optimizer], stage=args.stage, precision=args.precision, device=device,
                        recording=recording if args.stage == 3 else None)

    data = ShakespeareData()
    data.setup("fit")
    sampler = DistributedSampler(data.train_set, shuffle=True, seed=0)  # each rank its part of every epoch
    loader = DataLoader(data.train_set, batch_size=data.hparams.batch_size, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while step < args.max_steps:
        sampler.set_epoch(epoch)  # another shuffle each epoch, the same on every rank
        for inputs, targets in loader:
            with engine.forward_context():  # autocast in the mixed precisions
                loss = model.loss((inputs.to(device), targets.to(device)))
            engine.backward(loss)
            engine.step(clip_grad_norm=1.0)  # reduce, unscale, clip, step, gather, zero_grad
            if dist.get_rank() == 0 and (step % 20 == 0 or step == args.max_steps - 1):
                print(f"step {step}: loss {loss.item():.3f}", flush=True)
            step += 1
            if step == args.max_steps:
                break
        epoch += 1

    checkpoint = engine.checkpoint_entries()  # the model's and every optimizer's states
    checkpoint.update(global_step=step, hyper_parameters=dict(model.hparams))  # what generate.py rebuilds from
    engine.save_checkpoint(checkpoint, Path(args.out))
    engine.teardown()  # full fp32 weights back in the module (a collective)
    if dist.get_rank() == 0:
        print(f"saved {args.out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
