"""A model with the shape of LitGPT's ``litgpt/model.py`` (0.5), for tests that run client code the way LitGPT does
without installing it (its requirements would change the environment's ``jsonargparse`` and ``huggingface_hub``).

What matters for sharded construction is kept as LitGPT writes it: a ``Config`` dataclass, ``lm_head`` and a
``transformer`` ``ModuleDict`` (``wte``, ``h`` a ``ModuleList`` of blocks, ``ln_f``), fused ``qkv`` attention with
grouped queries, ``LLaMAMLP``, ``RMSNorm`` with a ``torch.ones`` weight, and the RoPE cache: non-persistent ``cos``
and ``sin`` buffers made by the ``max_seq_length`` setter (``torch.arange``, ``torch.outer``, powers of the base) and
rebuilt by ``reset_parameters``. Nothing initializes the weights but the ``nn`` modules' own ``reset_parameters``,
as in LitGPT, whose scripts build under ``fabric.init_module(empty_init=True)`` and never initialize again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Config:
    block_size: int = 32
    vocab_size: int = 64
    padded_vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_query_groups: int = 2
    n_embd: int = 32
    head_size: int = 8
    intermediate_size: int = 48
    rotary_percentage: float = 1.0
    rope_base: int = 10000
    bias: bool = False
    norm_eps: float = 1e-5

    @property
    def rope_n_elem(self) -> int:
        return int(self.rotary_percentage * self.head_size)


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=config.bias)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=RMSNorm(config.n_embd, eps=config.norm_eps),
        ))
        self.max_seq_length = config.block_size

    @property
    def max_seq_length(self) -> int:
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self._max_seq_length = value
        if not hasattr(self, "cos"):
            cos, sin = self.rope_cache()
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def reset_parameters(self) -> None:
        # as LitGPT: trigger resetting the rope cache
        self.cos, self.sin = self.rope_cache(device=self.cos.device)

    def rope_cache(self, device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
        return build_rope_cache(self.max_seq_length, self.config.rope_n_elem, device, self.config.rope_base)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        return self.lm_head(self.transformer.ln_f(x))


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = LLaMAMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), cos, sin)
        return x + self.mlp(self.norm_2(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        shape = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.qkv = nn.Linear(config.n_embd, shape, bias=config.bias)
        self.proj = nn.Linear(config.head_size * config.n_head, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, t, _ = x.shape
        q_per_kv = c.n_head // c.n_query_groups
        qkv = self.qkv(x).view(b, t, c.n_query_groups, q_per_kv + 2, c.head_size).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        k = k.expand(b, c.n_query_groups, q_per_kv, t, c.head_size)
        v = v.expand(b, c.n_query_groups, q_per_kv, t, c.head_size)
        q, k, v = (z.reshape(b, -1, t, c.head_size) for z in (q, k, v))
        n = c.rope_n_elem
        q = torch.cat((apply_rope(q[..., :n], cos, sin), q[..., n:]), dim=-1)
        k = torch.cat((apply_rope(k[..., :n], cos, sin), k[..., n:]), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c.head_size * c.n_head))


class LLaMAMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class RMSNorm(nn.Module):
    def __init__(self, size: int, dim: int = -1, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.dim = eps, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        return (x * torch.rsqrt(norm_x + self.eps)).to(dtype) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def build_rope_cache(seq_len: int, n_elem: int, device: Optional[torch.device] = None,
                     base: int = 10000) -> tuple[torch.Tensor, torch.Tensor]:
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, device=device).float() / n_elem))
    seq_idx = torch.arange(seq_len, device=device) / 1.0
    idx_theta = torch.outer(seq_idx, theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    head_size = x.size(-1)
    x1, x2 = x[..., : head_size // 2], x[..., head_size // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return ((x * cos) + (rotated * sin)).to(dtype=x.dtype)
