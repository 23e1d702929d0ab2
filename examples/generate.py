"""Generate text from a checkpoint of ``examples/gpt.py``, in one plain process (no launcher, no process group).

    python examples/generate.py checkpoints/gpt-zero3/last.ckpt --prompt "ROMEO:" --tokens 300

The checkpoint may be the sharded directory the ``zero*`` strategies write (whatever the number of processes and the
stage it was trained with) or a single ``.ckpt`` file from ``lightning-zero consolidate`` or from ``ddp``.
``lightning_zero.load_from_checkpoint`` rebuilds the model from its saved hyperparameters and reads each rank's
shard straight into the parameters.

One thread by default on a CPU: a token is one forward of a small model over at most 64 positions, too little work to
share, and more threads only wait for each other (on 2 busy cores, 300 tokens took 46 s with PyTorch's default
threads and 9 s with one). ``--threads`` (or ``OMP_NUM_THREADS``) sets another count for a larger model.
"""

from __future__ import annotations

import argparse
import os

import torch

import lightning_zero
from gpt import GPT  # examples/gpt.py, next to this file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory (sharded) or .ckpt file")
    parser.add_argument("--prompt", default="ROMEO:", help="text to continue")
    parser.add_argument("--tokens", type=int, default=300, help="how many bytes to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)),
                        help="CPU threads (default: OMP_NUM_THREADS, else 1: the model is too small to share)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = lightning_zero.load_from_checkpoint(GPT, args.checkpoint, map_location=args.device)
    model.eval()
    generator = torch.Generator().manual_seed(args.seed)
    print(model.generate(args.prompt, args.tokens, temperature=args.temperature, top_k=args.top_k,
                         generator=generator))


if __name__ == "__main__":
    main()
