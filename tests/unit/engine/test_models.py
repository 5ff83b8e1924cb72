"""The target and drafter compute what a plain full-sequence transformer computes."""

from __future__ import annotations

import torch

from ddtree_cli.draft_tree import build_tree
from ddtree_cli.engine.target import compact_block
from tests.unit.engine.helpers import full_forward, tiny_pair


def test_incremental_cache_matches_full_forward():
    pair = tiny_pair()
    target = pair.target
    ids = [5, 17, 200, 3, 3, 99, 42, 7]
    ref = full_forward(pair, ids)
    cache = target.new_cache(1, 16, "cpu", torch.float32)
    out = []
    with torch.no_grad():
        for i, tok in enumerate(ids):
            pos = torch.tensor([[i]])
            mask = (torch.arange(i + 1) <= i).view(1, 1, 1, -1)
            hidden, _ = target(torch.tensor([[tok]]), pos, cache, pos, mask)
            out.append(target.logits(hidden)[0, 0])
    torch.testing.assert_close(torch.stack(out), ref, rtol=1e-5, atol=1e-5)


def test_tree_block_under_ancestor_mask_matches_each_path_run_causally():
    pair = tiny_pair(seed=1)
    target = pair.target
    prefix = [11, 22, 33, 44, 55]
    gen = torch.Generator().manual_seed(0)
    tree = build_tree(torch.randn(1, 4, 260, generator=gen), 9)
    n = tree.parents.shape[1]
    p = len(prefix)
    cache = target.new_cache(1, p + n, "cpu", torch.float32)
    with torch.no_grad():
        pos = torch.arange(p).unsqueeze(0)
        target(
            torch.tensor([prefix]),
            pos,
            cache,
            pos,
            (pos.unsqueeze(-1) >= pos.unsqueeze(-2)).unsqueeze(1),
        )
        root = 7
        ids = torch.cat([torch.tensor([[root]]), tree.tokens], 1)
        positions = p + tree.depths
        write = p + torch.arange(n).unsqueeze(0)
        mask = torch.cat([torch.ones(1, n, p, dtype=torch.bool), tree.visibility], dim=2)
        hidden, _ = target(ids, positions, cache, write, mask.unsqueeze(1))
        logits = target.logits(hidden)[0]
    tokens = [root] + tree.tokens[0].tolist()
    parents = tree.parents[0].tolist()
    for node in range(int(tree.num_nodes[0]) + 1):
        path, cur = [], node
        while cur >= 0:
            path.append(tokens[cur])
            cur = parents[cur]
        ref = full_forward(pair, prefix + path[::-1])[-1]
        torch.testing.assert_close(logits[node], ref, rtol=1e-4, atol=1e-4)


def test_compaction_moves_the_accepted_path_to_the_front():
    cache = torch.arange(2 * 2 * 10, dtype=torch.float32).view(1, 2, 2, 10, 1, 1).clone()
    before = cache.clone()
    base = torch.tensor([2, 3])
    accepted = torch.tensor([[0, 2, 5, -1], [0, 1, -1, -1]])
    compact_block(cache, base, accepted)
    assert cache[0, 0, 0, 2:5].flatten().tolist() == before[0, 0, 0, [2, 4, 7]].flatten().tolist()
    assert torch.equal(cache[0, :, 0, :2], before[0, :, 0, :2])  # the prefix is untouched
    assert cache[0, 1, 1, 3:5].flatten().tolist() == before[0, 1, 1, [3, 4]].flatten().tolist()


def test_drafter_block_is_non_causal_and_reads_its_context():
    pair = tiny_pair(seed=2)
    drafter, target = pair.drafter, pair.target
    feats = torch.randn(1, 6, 2 * 64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6).unsqueeze(0)
    cache = drafter.new_cache(1, 32, "cpu", torch.float32)
    with torch.no_grad():
        drafter.write_context(cache, feats, pos, pos)
        block = torch.tensor([[9, 257, 257, 257]])
        bpos = 6 + torch.arange(4).unsqueeze(0)

        def run(blk, ctx_len=6, c=cache):
            return drafter(target.embed(blk), bpos, c, torch.tensor([ctx_len]), 6)

        base = run(block)
        changed_last = run(torch.tensor([[9, 257, 257, 100]]))
        # Position 1 sees position 3 inside the block: bidirectional attention.
        assert not torch.allclose(base[0, 1], changed_last[0, 1])
        # The context matters, and only the visible part of it.
        assert not torch.allclose(base, run(block, ctx_len=3))
        split = drafter.new_cache(1, 32, "cpu", torch.float32)
        drafter.write_context(split, feats[:, :4], pos[:, :4], pos[:, :4])
        drafter.write_context(split, feats[:, 4:], pos[:, 4:], pos[:, 4:])
        torch.testing.assert_close(run(block, c=split), base)


def test_checkpoint_names_follow_hf_qwen3_and_sglang_dflash():
    pair = tiny_pair()
    target_names = set(pair.target.state_dict())
    assert "model.embed_tokens.weight" in target_names
    assert "model.norm.weight" in target_names
    for suffix in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    ):
        assert f"model.layers.0.{suffix}.weight" in target_names
    assert pair.target.lm_head.weight is pair.target.model.embed_tokens.weight  # tied
    draft_names = set(pair.drafter.state_dict())
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.0.self_attn.q_norm.weight",
        "layers.0.mlp.gate_proj.weight",
    } <= draft_names
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in draft_names)
    assert pair.drafter.fc.weight.shape == (64, 2 * 64)  # fc over the target layers' features
    hf = pair.drafter.config.to_hf()
    assert hf["architectures"] == ["DFlashDraftModel"]
    assert hf["dflash_config"] == {
        "block_size": 16,
        "mask_token_id": 257,
        "target_layer_ids": [0, 2],
    }
    assert pair.target.config.to_hf()["architectures"] == ["Qwen3ForCausalLM"]
