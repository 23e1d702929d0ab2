"""One rank of the export round trip (tests/test_export.py): a tiny Hugging Face GPT-2 (tied embeddings) and a tiny
Llama (untied), configs built from code, each held by a LightningModule as ``self.lm`` and fitted 3 steps under
``ddp`` and under ``zero3`` on the same seed and data.

Usage: ``export.py OUT``. Writes ``OUT/<name>-zero3.ckpt`` (zero3's sharded checkpoint directory) and, on rank 0,
records in ``rank<r>.pt`` the logits on ``FIXED_INPUT`` of the ``ddp``-trained model and of the untrained one. The LightningModule is defined in
this script (``__main__`` of the ranks), so nothing that reads the checkpoint elsewhere can import it.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401  (registers the strategies)

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()

VOCAB = 256
MODELS: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)),
}
FIXED_INPUT = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


class CausalLM(L.LightningModule):
    """A pretrained model as ``self.lm``, fine-tuned on random tokens."""

    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lm = MODELS[name]()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.lm(batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        ids = torch.randint(0, VOCAB, (12, 16), generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(ids), batch_size=2)


def fit(name: str, strategy: str) -> tuple[CausalLM, L.Trainer]:
    module = CausalLM(name)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return module, trainer


def main() -> None:
    out = Path(sys.argv[1])
    logits, initial = {}, {}
    for name in MODELS:
        with torch.no_grad():
            initial[name] = CausalLM(name).lm.eval()(FIXED_INPUT).logits
        reference = fit(name, "ddp")[0].lm.eval()
        with torch.no_grad():
            logits[name] = reference(FIXED_INPUT).logits
        fit(name, "zero3")[1].save_checkpoint(out / f"{name}-zero3.ckpt")
    torch.save({"logits": logits, "initial": initial}, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
