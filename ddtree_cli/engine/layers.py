"""Qwen3 building blocks: RMSNorm, RoPE (rotate-half), per-head q/k norm, SwiGLU, GQA attention.

Parameter names follow the HF/SGLang checkpoints (``q_proj``, ``q_norm``, ``gate_proj``, ...)
so a ``state_dict`` exports without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rope(nn.Module):
    """cos/sin tables indexed by absolute position; siblings in a tree share a position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [b, n, heads, head_dim], positions: [b, n]
        cos = self.cos[positions].unsqueeze(2).to(x.dtype)
        sin = self.sin[positions].unsqueeze(2).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Projections and norms of one Qwen3 attention layer; the caller owns the KV cache."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def project_q(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim)))
        return rope(q, positions)

    def project_kv(
        self, x: torch.Tensor, positions: torch.Tensor, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V, each [b, n, kv_heads, head_dim]."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        return rope(k, positions), v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [b, n, h, d]; k, v [b, T, kvh, d]; mask [b, 1, n, T] bool (True = may attend)."""
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            enable_gqa=self.heads != self.kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DecoderLayer(nn.Module):
    def __init__(self, hidden, intermediate, heads, kv_heads, head_dim, eps):
        super().__init__()
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps)
        self.mlp = MLP(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))
