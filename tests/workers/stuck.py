"""A user's training script in which rank 1 stalls at its third step, away from any step boundary, and sends SIGTERM
to the job (its process group: both ranks, as a scheduler does). ``shutdown_timeout=2`` must end both ranks.

Started like a user's ``python train.py`` (Lightning's launcher starts rank 1 in the same process group).
``argv``: output directory, then the stall: ``python`` (a loop in ``training_step``, as in a hung data loader) or
``native`` (a ``recv`` on a group of its own that rank 0 never sends to, as a dead peer leaves a rank: the main
thread blocked in gloo's C++, where no Python signal handler runs). In ``native`` a thread sends the signal once the
main thread is inside ``recv``, so the signal lands while both main threads are in native code (rank 0 waits in the
gradient exchange of the same step).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_zero import ZeroStrategy
from tests.models import TinyGPT

warnings.filterwarnings("ignore")


def send_sigterm_to_the_job() -> None:
    print(f"SIGTERM sent at {time.time()}", flush=True)
    os.killpg(os.getpgrp(), signal.SIGTERM)


def send_once_in_recv(main: threading.Thread) -> None:
    """Send SIGTERM once the main thread's stack is inside ``torch.distributed``'s ``recv`` (polling its frames)."""
    while True:
        frame = sys._current_frames().get(main.ident or -1)
        while frame is not None and frame.f_code.co_name != "recv":
            frame = frame.f_back
        if frame is not None and "distributed" in frame.f_code.co_filename:
            send_sigterm_to_the_job()
            return
        time.sleep(0.01)


class StuckGPT(TinyGPT):
    def __init__(self, stall: str) -> None:
        super().__init__()
        self.stall = stall
        self.side: Any = None

    def on_fit_start(self) -> None:
        self.side = dist.new_group(backend="gloo")  # every rank makes it; nothing is ever sent on it

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and self.global_step == 2:
            if self.stall == "python":
                send_sigterm_to_the_job()
                while True:  # stuck here: the handler only records the signal
                    time.sleep(0.1)
            threading.Thread(target=send_once_in_recv, args=(threading.main_thread(),), daemon=True).start()
            dist.recv(torch.zeros(1), src=0, group=self.side)  # never completes
        return super().training_step(batch, batch_idx)


def main() -> None:
    out, stall = Path(sys.argv[1]), sys.argv[2]
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=2, shutdown_timeout=2), accelerator="cpu", devices=2,
                        max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out)
    trainer.fit(StuckGPT(stall))
    print("finished", flush=True)


if __name__ == "__main__":
    main()
