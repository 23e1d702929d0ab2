import sys
from pathlib import Path
import torch, torch.distributed as dist
import lightning as L
import tests.workers.tensor_parallel as w
from tests.models import TinyTPGPT
out = Path(sys.argv[1])
class B(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        print("batch", batch_idx, trainer.global_step, trainer.current_epoch, flush=True)
L.seed_everything(0, verbose=False)
ck = torch.load("/tmp/tp1/zero3_full.ckpt", weights_only=False)
print({k: v for k, v in ck["loops"]["fit_loop"].items() if k != "epoch_loop.state_dict"}, ck["loops"]["fit_loop"]["epoch_loop.batch_progress"], flush=True)
model = TinyTPGPT()
trainer = L.Trainer(strategy=w.ZeroStrategy(stage=1, tensor_parallel_size=2), accelerator="cpu", devices=4, max_steps=4,
                    callbacks=[B()], logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **w.FIT)
trainer.fit(model, ckpt_path="/tmp/tp1/zero3.ckpt")
print("end", trainer.global_step, model.losses, flush=True)
torch.save({}, out / f"rank{dist.get_rank()}.pt")
