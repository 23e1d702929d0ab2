"""A user's training script, stopped by a signal that a fault point delivers (see tests/test_shutdown.py).

Started like a user's ``python train.py``: Lightning's launcher starts rank 1 as a child in the same process group,
so a fault point's ``target=group`` signal reaches both ranks the way Ctrl-C does.
``argv``: output directory, stage, state_dict_type ("sharded" or "full"), max_steps, then ``slurm`` and ``disk``
(``offload_optimizer="disk"``, and at stage 3 ``offload_params="disk"``, files under ``<out>/offload``) optionally.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment

from lightning_zero import ZeroStrategy
from tests.models import TinyGPT

warnings.filterwarnings("ignore")


def main() -> None:
    out, stage, state_dict_type, max_steps = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    slurm = "slurm" in sys.argv[5:]
    disk = {"offload_optimizer": "disk", "offload_params": "disk" if stage == 3 else False,
            "offload_path": str(out / "offload")} if "disk" in sys.argv[5:] else {}
    L.seed_everything(0, verbose=False)
    plugins = [SLURMEnvironment(auto_requeue=True)] if slurm else None
    trainer = L.Trainer(
        strategy=ZeroStrategy(stage=stage, persistence_threshold=0, state_dict_type=state_dict_type, **disk),
        accelerator="cpu", devices=2, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, val_check_interval=3, limit_val_batches=2, default_root_dir=out,
        plugins=plugins,
        callbacks=[ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=2, save_top_k=-1)],
    )
    trainer.fit(TinyGPT(meta_init=stage == 3))
    print(f"finished at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
