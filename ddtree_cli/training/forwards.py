"""Full-sequence forwards through the engine's own modules (``Qwen3Target``, ``DFlashDrafter``
and their layers) with a causal / block mask, so what is trained is exactly what the engine
decodes with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree_cli.engine.drafter import DFlashDrafter
from ddtree_cli.engine.target import Qwen3Target


def attend(attn, q, k, v, **kw):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True, **kw
    )
    return attn.o_proj(out.transpose(1, 2).flatten(2))


def target_forward(
    target: Qwen3Target,
    ids: torch.Tensor,
    feature_layers: tuple[int, ...] = (),
    features_only: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Causal forward over whole sequences (no cache): final normed hidden, features.

    ``features_only`` stops after the last feature layer and returns no hidden states.
    """
    b, n = ids.shape
    pos = torch.arange(n, device=ids.device).expand(b, n)
    x = target.embed(ids)
    feats = []
    for i, layer in enumerate(target.model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.project_q(h, pos, target.rope)
        k, v = attn.project_kv(h, pos, target.rope)
        x = layer.finish(x, attend(attn, q, k, v, is_causal=True))
        if i in feature_layers:
            feats.append(x)
            if features_only and len(feats) == len(feature_layers):
                return None, torch.cat(feats, dim=-1)
    return target.model.norm(x), (torch.cat(feats, dim=-1) if feats else None)


def drafter_forward(
    drafter: DFlashDrafter,
    target: Qwen3Target,
    tokens: torch.Tensor,
    feats: torch.Tensor,
    anchors: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of K blocks per sequence, as the engine's drafter computes them in decoding.

    tokens [b, T], feats [b, T, F] (the target's features), anchors [b, K]: block k is
    ``[tokens[a], mask * (B-1)]`` at positions a..a+B-1 and sees the context features at
    positions < a plus its own block (non-causal). Returns logits [b, K, B-1, V] for
    positions a+1..a+B-1 and their labels [b, K, B-1].
    """
    cfg = drafter.config
    bsz, seq = tokens.shape
    width, k_blocks = cfg.block_size, anchors.shape[1]
    dev = tokens.device
    offs = torch.arange(width, device=dev)
    blk_pos = anchors.unsqueeze(-1) + offs  # [b, K, B]
    blk_ids = torch.full_like(blk_pos, cfg.mask_token_id)
    blk_ids[:, :, 0] = tokens.gather(1, anchors)
    labels = tokens.gather(1, blk_pos[:, :, 1:].flatten(1)).view(bsz, k_blocks, width - 1)
    ctx = drafter.hidden_norm(drafter.fc(feats))
    ctx_pos = torch.arange(seq, device=dev).expand(bsz, seq)
    qpos = blk_pos.flatten(1)
    ctx_vis = torch.arange(seq, device=dev).view(1, 1, 1, seq) < anchors.view(bsz, k_blocks, 1, 1)
    ctx_vis = ctx_vis.expand(bsz, k_blocks, width, seq).reshape(bsz, k_blocks * width, seq)
    blk = torch.arange(k_blocks * width, device=dev) // width
    own = (blk.unsqueeze(0) == blk.unsqueeze(1)).expand(bsz, -1, -1)
    mask = torch.cat([ctx_vis, own], dim=-1).unsqueeze(1)
    with torch.no_grad():
        x = target.embed(blk_ids.flatten(1))
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.project_q(h, qpos, drafter.rope)
        k, v = attn.project_kv(h, qpos, drafter.rope)
        ck, cv = attn.project_kv(ctx, ctx_pos, drafter.rope)
        keys, values = torch.cat([ck, k], dim=1), torch.cat([cv, v], dim=1)
        x = layer.finish(x, attend(attn, q, keys, values, attn_mask=mask))
    hidden = drafter.norm(x).view(bsz, k_blocks, width, -1)[:, :, 1:]
    return target.logits(hidden), labels
