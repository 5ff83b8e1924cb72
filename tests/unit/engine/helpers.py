"""Small models and reference computations shared by the engine tests (float32, CPU)."""

from __future__ import annotations

import torch

from ddtree_cli.engine.decoding import Engine, generate
from ddtree_cli.engine.model_config import DraftConfig, TargetConfig
from ddtree_cli.engine.weights import ModelPair, random_pair

TINY_TARGET = TargetConfig(
    vocab_size=260,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)
TINY_DRAFT = DraftConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=260,
    target_layer_ids=(0, 2),
)


def tiny_pair(seed: int = 0, vocab: int | None = None) -> ModelPair:
    if vocab is None:
        return random_pair(TINY_TARGET, TINY_DRAFT, seed=seed)
    from dataclasses import replace

    return random_pair(
        replace(TINY_TARGET, vocab_size=vocab),
        replace(TINY_DRAFT, vocab_size=vocab, mask_token_id=vocab - 1),
        seed=seed,
    )


@torch.no_grad()
def full_forward(pair: ModelPair, ids: list[int]) -> torch.Tensor:
    """Logits [n, V] of one sequence run as a single causal block (no incremental cache)."""
    target = pair.target
    n = len(ids)
    cache = target.new_cache(1, n, "cpu", torch.float32)
    pos = torch.arange(n).unsqueeze(0)
    mask = (pos.unsqueeze(-1) >= pos.unsqueeze(-2)).unsqueeze(1)
    hidden, _ = target(torch.tensor([ids]), pos, cache, pos, mask)
    return target.logits(hidden)[0]


def ar_outputs(pair: ModelPair, prompts, max_new: int, stop_ids=frozenset(), max_batch=4):
    engine = Engine(pair, "ar", max_batch=max_batch, context_len=256)
    return [s.output for s in generate(engine, prompts, max_new, stop_ids=stop_ids)]
