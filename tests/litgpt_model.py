"""LitGPT's own model when it is installed, else the copy of its shape in ``tests/litgpt_shaped.py``.

LitGPT's requirements would change this environment's ``jsonargparse`` and ``huggingface_hub``, so the test set-up
installs it without them (``pip install --no-deps litgpt``; ``litgpt.model`` and ``litgpt.config`` need only torch
and Lightning). ``SOURCE`` says which model the tests ran.
"""

from __future__ import annotations

from typing import Any

try:
    from litgpt.config import Config as _LitConfig
    from litgpt.model import GPT

    SOURCE = "litgpt"

    def Config(**overrides: Any) -> Any:  # noqa: N802 (the class it stands for)
        """A tiny LitGPT config shaped as ``tests/litgpt_shaped.py``'s defaults (Llama-style blocks)."""
        fields = dict(block_size=32, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=4, n_query_groups=2,
                      n_embd=32, head_size=8, intermediate_size=48, rotary_percentage=1.0, bias=False,
                      norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", parallel_residual=False)
        return _LitConfig(**(fields | overrides))
except ImportError:
    from tests.litgpt_shaped import GPT, Config  # noqa: F401

    SOURCE = "litgpt_shaped"
