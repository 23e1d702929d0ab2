"""The GPT of ``examples/gpt.py`` trained with Lightning Fabric and ZeRO, in your own loop.

    python examples/fabric_gpt.py                                   # zero3 on 2 CPU processes, 60 steps
    python examples/fabric_gpt.py --stage 2 --devices 3 --max-steps 200
    python examples/generate.py checkpoints/gpt-fabric/last.ckpt --prompt "ROMEO:"   # sample from it

``Fabric(strategy="zero3")`` launches the processes (Fabric's own launcher), ``fabric.init_module()`` builds the
model sharded, ``fabric.backward`` / ``optimizer.step()`` run ZeRO's step, and ``fabric.save`` writes the same
sharded checkpoint the Trainer writes: ``examples/generate.py`` reads it, and ``python examples/gpt.py fit
--config examples/configs/zero3.yaml --ckpt_path checkpoints/gpt-fabric/last.ckpt`` resumes it under the Trainer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from gpt import GPT, ShakespeareData

import lightning_zero  # noqa: F401  (registers zero1/zero2/zero3 with Fabric)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--out", default="checkpoints/gpt-fabric/last.ckpt")
    args = parser.parse_args()

    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=f"zero{args.stage}", precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module():  # zero3: recorded on the meta device, built one unit at a time by setup
        model = GPT(n_layer=2, dropout=0.0)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)

    data = ShakespeareData()
    data.setup("fit")
    loader = fabric.setup_dataloaders(data.train_dataloader())
    batches = iter(loader)
    for step in range(args.max_steps):
        for micro in range(args.accumulate):
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = model.training_step(next(batches), step)
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0 or step == args.max_steps - 1:
            fabric.print(f"step {step}: loss {loss.item():.3f}")
    # hyper_parameters: what `GPT.load_from_checkpoint` / examples/generate.py rebuild the model from
    fabric.save(Path(args.out), {"model": model, "optimizer": optimizer, "step": args.max_steps,
                                 "hyper_parameters": dict(model.hparams)})
    fabric.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
