"""The target: a decoder-only transformer that is architecturally Qwen3.

The KV cache is one tensor ``[layers, 2, slots, capacity, kv_heads, head_dim]``; a forward
writes its block's K/V at per-row cache indices and attends under a per-row boolean mask, so
one call serves a prefill (causal), an AR step, a DFlash chain and a DDTree tree. Compaction
of an accepted path to the front of the block is one gather and one scatter over all layers.
"""

from __future__ import annotations

import torch
from torch import nn

from ddtree_cli.engine.layers import DecoderLayer, RMSNorm, Rope
from ddtree_cli.engine.model_config import TargetConfig


class _Backbone(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg.hidden_size,
                cfg.intermediate_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.rms_norm_eps,
            )
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3Target(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)

    def new_cache(self, slots: int, capacity: int, device, dtype) -> torch.Tensor:
        c = self.config
        shape = (c.num_hidden_layers, 2, slots, capacity, c.num_key_value_heads, c.head_dim)
        return torch.zeros(shape, device=device, dtype=dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        write_index: torch.Tensor,
        mask: torch.Tensor,
        feature_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run a block of ``n`` tokens per row for cache rows ``0..b-1``.

        input_ids, positions, write_index: [b, n]; mask: [b, 1, n, T] over cache columns
        ``0..T-1`` (which must include this block's write_index). Returns the final normed
        hidden states [b, n, H] and the concatenated outputs of ``feature_layers``
        ([b, n, len(feature_layers) * H], the drafter's context features) or None.
        """
        b = input_ids.shape[0]
        span = mask.shape[-1]
        rows = torch.arange(b, device=input_ids.device).unsqueeze(1)
        x = self.embed(input_ids)
        features = []
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.project_q(h, positions, self.rope)
            k, v = attn.project_kv(h, positions, self.rope)
            k_cache, v_cache = cache[i, 0, :b], cache[i, 1, :b]
            k_cache[rows, write_index] = k
            v_cache[rows, write_index] = v
            x = layer.finish(x, attn.attend(q, k_cache[:, :span], v_cache[:, :span], mask))
            if i in feature_layers:
                features.append(x)
        feats = torch.cat(features, dim=-1) if features else None
        return self.model.norm(x), feats


def compact_block(cache: torch.Tensor, base: torch.Tensor, accepted: torch.Tensor) -> None:
    """Move the accepted nodes' K/V to the front of each row's block, in place.

    base [b]: first cache index of the block; accepted [b, P]: block-local node indices in
    path order (-1 padded). Gather first, then scatter, so overlapping source and target
    positions are safe; entries past a row's accepted length land beyond its new length
    and are never attended.
    """
    b, width = accepted.shape
    rows = torch.arange(b, device=cache.device).unsqueeze(1)
    src = base.unsqueeze(1) + accepted.clamp(min=0)
    dst = base.unsqueeze(1) + torch.arange(width, device=cache.device)
    move_columns(cache, rows, src, dst)


def move_columns(cache: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor):
    """``cache[..., rows, dst] = cache[..., rows, src]`` over all layers, K and V, in place.

    rows [b, 1] (cache rows 0..b-1), src/dst [b, P] cache indices; every source is gathered
    before anything is written, so overlapping source and target columns are safe.
    """
    view = cache[:, :, : rows.shape[0]]
    view[:, :, rows, dst] = view[:, :, rows, src]
