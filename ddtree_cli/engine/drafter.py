"""The DFlash drafter, laid out as SGLang's ``DFlashDraftModel`` (``fc``, ``hidden_norm``,
``layers.*`` with q/k norm, ``norm``; embedding and LM head borrowed from the target).

Context: the target's hidden features at ``target_layer_ids`` for every committed token are
projected once (``hidden_norm(fc(features))``) and turned into per-layer K/V that live in the
drafter's own context cache. A round runs one forward over the block ``[root, mask, ...]``,
non-causal inside the block, attending to the row's context; the block's own K/V are
discarded afterwards, the context cache is extended with the accepted tokens' features.
"""

from __future__ import annotations

import torch
from torch import nn

from ddtree_cli.engine.layers import DecoderLayer, RMSNorm, Rope
from ddtree_cli.engine.model_config import DraftConfig


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DraftConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(
                h,
                cfg.intermediate_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.rms_norm_eps,
            )
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, max_positions)

    def new_cache(self, slots: int, capacity: int, device, dtype) -> torch.Tensor:
        c = self.config
        shape = (c.num_hidden_layers, 2, slots, capacity, c.num_key_value_heads, c.head_dim)
        return torch.zeros(shape, device=device, dtype=dtype)

    def write_context(
        self,
        cache: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        write_index: torch.Tensor,
    ) -> None:
        """Append context K/V for rows 0..b-1; features [b, m, F], positions/write_index [b, m]."""
        b = features.shape[0]
        rows = torch.arange(b, device=features.device).unsqueeze(1)
        ctx = self.hidden_norm(self.fc(features))
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, positions, self.rope)
            cache[i, 0, :b][rows, write_index] = k
            cache[i, 1, :b][rows, write_index] = v

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        context_lens: torch.Tensor,
        span: int,
    ) -> torch.Tensor:
        """Hidden states [b, B, H] of the block; context = cache columns < context_lens[b]."""
        b, width = block_embeds.shape[:2]
        device = block_embeds.device
        ctx_visible = torch.arange(span, device=device).unsqueeze(0) < context_lens.unsqueeze(1)
        mask = torch.cat(
            [ctx_visible, torch.ones(b, width, dtype=torch.bool, device=device)], dim=1
        )
        mask = mask[:, None, None, :].expand(b, 1, width, span + width)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.project_q(h, positions, self.rope)
            k, v = attn.project_kv(h, positions, self.rope)
            keys = torch.cat([cache[i, 0, :b, :span], k], dim=1)
            values = torch.cat([cache[i, 1, :b, :span], v], dim=1)
            x = layer.finish(x, attn.attend(q, keys, values, mask))
        return self.norm(x)
