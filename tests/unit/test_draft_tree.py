"""draft_tree.py against plain-Python oracles (tests/unit/tree_oracle.py) on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree_cli import draft_tree as dt
from tests.unit import tree_oracle as oracle

PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TIE_LEVELS = np.array([0.0, -0.25, -0.5, -1.0, -1.5, -3.0], dtype=np.float32)


def make_topk(seed: int, b: int, n_pos: int, vocab: int, ties: bool):
    """Sorted log-prob rows and distinct token ids per row, as top-K over the vocab gives."""
    rng = np.random.default_rng(seed)
    if ties:
        lp = rng.choice(TIE_LEVELS, size=(b, n_pos, vocab))
    else:
        logits = torch.from_numpy(rng.normal(0.0, 2.0, size=(b, n_pos, vocab)))
        lp = torch.log_softmax(logits, -1).float().numpy()
    lp = -np.sort(-lp, axis=-1)
    ids = np.stack([rng.permutation(vocab) for _ in range(b * n_pos)]).reshape(b, n_pos, vocab)
    return torch.from_numpy(lp.astype(np.float32)), torch.from_numpy(ids.astype(np.int64))


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def token_paths(tokens: list[int], parents: list[int], n: int) -> set[tuple[int, ...]]:
    paths = set()
    for i in range(1, n + 1):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        paths.add(tuple(reversed(path)))
    return paths


def check_request(tree: dt.DraftTree, r: int, lp: np.ndarray, ids: np.ndarray, budget: int):
    """One request's tree: structure, padding, visibility, and the oracle's node set."""
    want = oracle.heap_tree(lp, ids, budget)
    n = int(tree.num_nodes[r])
    parents = tree.parents[r].tolist()
    depths = tree.depths[r].tolist()
    tokens = [-1, *tree.tokens[r].tolist()]
    scores = tree.scores[r].tolist()
    n_slots = budget + 1
    assert n == len(want.ranks) - 1
    assert (parents[0], depths[0], scores[0]) == (-1, 0, 0.0)
    for i in range(1, n + 1):
        p = parents[i]
        assert 0 <= p < i, "every parent index is lower than its child's"
        assert depths[i] == depths[p] + 1
        assert depths[i] >= depths[i - 1], "breadth-first numbering"
        rank = ids[depths[i] - 1].tolist().index(tokens[i])
        assert scores[i] == oracle._f32_add(scores[p], lp[depths[i] - 1, rank])
    for p in range(n + 1):
        kids = [tokens[i] for i in range(1, n + 1) if parents[i] == p]
        assert len(kids) == len(set(kids)), "siblings carry distinct tokens"
    for i in range(n + 1, n_slots):
        assert (tokens[i], parents[i], depths[i], scores[i]) == (0, -1, 0, float("-inf"))
    vis = tree.visibility[r]
    expected = torch.zeros((n_slots, n_slots), dtype=torch.bool)
    for i in range(n_slots):
        for j in ancestors_or_self(parents, i):
            expected[i, j] = True
    assert torch.equal(vis, expected)
    # The surrogate value is the multiset of path scores; with a strict boundary (the worst
    # selected node beats everything left) the node set itself is unique.
    assert sorted(scores[1 : n + 1]) == sorted(want.scores[1:])
    strict = n == 0 or want.next_score is None or min(want.scores[1:]) > want.next_score
    if strict:
        assert token_paths(tokens, parents, n) == want.token_paths()
    return strict


def check_batch(lp: torch.Tensor, ids: torch.Tensor, budget: int) -> list[bool]:
    tree = dt.build_tree_from_topk(lp, ids, budget)
    b, n_pos, _ = lp.shape
    assert tree.tokens.shape == (b, budget) and tree.parents.shape == (b, budget + 1)
    assert tree.visibility.shape == (b, budget + 1, budget + 1)
    assert tree.max_depth == n_pos
    return [check_request(tree, r, lp[r].numpy(), ids[r].numpy(), budget) for r in range(b)]


# ------------------------------------------------------------------------ tree vs oracle


@PROPERTY
@given(
    seed=st.integers(0, 2**32 - 1),
    b=st.integers(1, 3),
    n_pos=st.integers(1, 6),
    vocab=st.integers(1, 12),
    budget=st.integers(0, 40),
)
def test_tree_matches_heap_tie_free(seed, b, n_pos, vocab, budget):
    check_batch(*make_topk(seed, b, n_pos, vocab, ties=False), budget)


@PROPERTY
@given(
    seed=st.integers(0, 2**32 - 1),
    b=st.integers(1, 3),
    n_pos=st.integers(1, 6),
    vocab=st.integers(1, 8),
    budget=st.integers(0, 40),
)
def test_tree_matches_heap_tie_heavy(seed, b, n_pos, vocab, budget):
    # Many equal log-probs, exact zeros included (child scores equal to their parent's).
    check_batch(*make_topk(seed, b, n_pos, vocab, ties=True), budget)


def test_tie_free_cases_compare_node_sets():
    strict = []
    for seed in range(40):
        strict += check_batch(*make_topk(seed, 2, 4, 6, ties=False), 1 + seed)
    assert sum(strict) >= 0.9 * len(strict), "tie-free inputs must mostly have a strict boundary"


@pytest.mark.parametrize("ties", [False, True])
def test_brute_force_on_tiny_cases(ties):
    for seed in range(60):
        rng = np.random.default_rng(seed)
        n_pos, vocab, budget = (
            int(rng.integers(1, 4)),
            int(rng.integers(1, 5)),
            int(rng.integers(1, 30)),
        )
        lp, ids = make_topk(seed, 1, n_pos, vocab, ties)
        tree = dt.build_tree_from_topk(lp, ids, budget)
        everything = oracle.brute_force_scores(lp[0].numpy(), budget)
        best = sorted(s for s, _ in everything[:budget])
        n = int(tree.num_nodes[0])
        assert n == min(budget, len(everything))
        assert sorted(tree.scores[0, 1 : n + 1].tolist()) == best
        check_request(tree, 0, lp[0].numpy(), ids[0].numpy(), budget)


@pytest.mark.parametrize(("b", "n_pos", "vocab", "budget"), [(4, 15, 300, 256), (2, 15, 64, 128)])
def test_full_size_trees(b, n_pos, vocab, budget):
    assert all(check_batch(*make_topk(7, b, n_pos, vocab, ties=False), budget))
    check_batch(*make_topk(8, b, n_pos, vocab, ties=True), budget)


def test_batch_of_different_trees():
    lp, ids = make_topk(3, 5, 6, 10, ties=False)
    tree = dt.build_tree_from_topk(lp, ids, 24)
    for r in range(5):
        alone = dt.build_tree_from_topk(lp[r : r + 1], ids[r : r + 1], 24)
        for name in ("tokens", "parents", "depths", "visibility", "num_nodes", "scores"):
            assert torch.equal(getattr(tree, name)[r], getattr(alone, name)[0]), name
    assert len({tuple(t) for t in tree.tokens.tolist()}) == 5


def test_budget_zero_is_root_only():
    tree = dt.build_tree(torch.randn(3, 15, 50), 0)
    assert tree.tokens.shape == (3, 0)
    assert tree.parents.tolist() == [[-1]] * 3 and tree.depths.tolist() == [[0]] * 3
    assert tree.visibility.tolist() == [[[True]]] * 3
    assert tree.num_nodes.tolist() == [0, 0, 0]
    walk = dt.verify_walk(tree, torch.tensor([[7], [8], [9]]))
    assert walk.accept_len.tolist() == [1, 1, 1] and walk.bonus.tolist() == [7, 8, 9]


def test_budget_above_possible_node_count_pads():
    lp, ids = make_topk(5, 2, 2, 3, ties=False)
    tree = dt.build_tree_from_topk(lp, ids, 50)
    assert tree.num_nodes.tolist() == [12, 12]  # 3 + 3 * 3 prefixes
    check_batch(lp, ids, 50)


def test_vocab_smaller_than_budget():
    logits = torch.randn(2, 4, 3)
    tree = dt.build_tree(logits, 10)
    lp, ids = dt.topk_logprobs(logits, 10)
    assert lp.shape == (2, 4, 3)
    check_batch(lp, ids, 10)
    assert tree.num_nodes.tolist() == [10, 10]


def test_single_position():
    lp, ids = make_topk(11, 3, 1, 20, ties=False)
    tree = dt.build_tree_from_topk(lp, ids, 8)
    assert tree.depths[:, 1:].tolist() == [[1] * 8] * 3
    assert tree.tokens.tolist() == ids[:, 0, :8].tolist()
    check_batch(lp, ids, 8)


def test_larger_k_than_budget_is_ignored():
    lp, ids = make_topk(12, 2, 5, 40, ties=False)
    a = dt.build_tree_from_topk(lp, ids, 9)
    b = dt.build_tree_from_topk(lp[..., :9], ids[..., :9], 9)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


# ------------------------------------------------------------------------------- top-K


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_topk_logprobs_any_dtype(dtype):
    logits = (torch.randn(2, 5, 97) * 3).to(dtype)
    lp, ids = dt.topk_logprobs(logits, 16)
    assert lp.dtype == torch.float32 and ids.dtype == torch.int64 and lp.shape == (2, 5, 16)
    full = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(lp.double(), full.gather(-1, ids), atol=1e-5)
    assert torch.allclose(lp.double(), full.sort(-1, descending=True).values[..., :16], atol=1e-5)
    assert (lp[..., :-1] >= lp[..., 1:]).all()


def test_build_tree_from_logits_equals_from_topk():
    logits = torch.randn(3, 15, 500)
    a = dt.build_tree(logits, 64)
    b = dt.build_tree_from_topk(*dt.topk_logprobs(logits, 64), 64)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert a.num_nodes.tolist() == [64, 64, 64]


def test_minus_inf_logits_are_floored_not_nan():
    logits = torch.randn(1, 3, 6)
    logits[..., 3:] = float("-inf")
    tree = dt.build_tree(logits, 30)
    assert not torch.isnan(tree.scores).any()
    assert int(tree.num_nodes[0]) == 30
    assert set(tree.tokens[0, :3].tolist()) == {0, 1, 2}


@pytest.mark.parametrize("splits", [[97], [40, 57], [10, 30, 20, 37], [1, 1, 95]])
def test_shard_merge_equals_unsharded_topk(splits):
    logits = torch.randn(2, 4, 97) * 2
    k = 16
    parts, start = [], 0
    for size in splits:
        parts.append(dt.shard_topk(logits[..., start : start + size], k, start))
        start += size
    values, ids, lse = zip(*parts, strict=True)
    lp, merged_ids = dt.merge_shard_topk(values, ids, lse, k)
    want_lp, want_ids = dt.topk_logprobs(logits, k)
    assert torch.equal(merged_ids, want_ids)
    assert torch.allclose(lp, want_lp, atol=1e-5)


def test_shard_merge_accepts_stacked_tensors():
    logits = torch.randn(3, 2, 64)
    parts = [dt.shard_topk(logits[..., s : s + 16], 8, s) for s in range(0, 64, 16)]
    values, ids, lse = (torch.stack(x) for x in zip(*parts, strict=True))
    lp, merged = dt.merge_shard_topk(values, ids, lse, 8)
    want_lp, want_ids = dt.topk_logprobs(logits, 8)
    assert torch.equal(merged, want_ids) and torch.allclose(lp, want_lp, atol=1e-5)


# ----------------------------------------------------------------------- verify inputs


def expected_full_mask(tree: dt.DraftTree, prefix: list[int]) -> list[bool]:
    out: list[bool] = []
    n = tree.num_slots
    for r, plen in enumerate(prefix):
        for q in range(n):
            out += [True] * plen
            out += tree.visibility[r, q].tolist()
    return out


@PROPERTY
@given(
    seed=st.integers(0, 2**32 - 1),
    b=st.integers(1, 3),
    n_pos=st.integers(1, 5),
    vocab=st.integers(1, 8),
    budget=st.integers(0, 20),
)
def test_verify_inputs_match_per_request_reconstruction(seed, b, n_pos, vocab, budget):
    rng = np.random.default_rng(seed)
    tree = dt.build_tree_from_topk(*make_topk(seed, b, n_pos, vocab, ties=seed % 2 == 0), budget)
    prefix = rng.integers(0, 7, size=b).tolist()
    roots = rng.integers(0, 1000, size=b).tolist()
    vi = dt.verify_inputs(tree, torch.tensor(roots), torch.tensor(prefix))
    n = budget + 1
    for r in range(b):
        parents = tree.parents[r].tolist()
        real = int(tree.num_nodes[r])
        assert vi.input_ids[r].tolist() == [roots[r], *tree.tokens[r].tolist()]
        assert vi.positions[r].tolist() == [prefix[r] + d for d in tree.depths[r].tolist()]
        assert vi.retrieve_index[r].tolist() == [r * n + i for i in range(n)]
        for i in range(n):
            kids = [j for j in range(1, real + 1) if parents[j] == i]
            assert vi.retrieve_next_token[r, i] == (min(kids) if kids else -1)
            sibs = [j for j in range(i + 1, real + 1) if i > 0 and parents[j] == parents[i]]
            want_sib = min(sibs) if sibs and 0 < i <= real else -1
            assert vi.retrieve_next_sibling[r, i] == want_sib
        # SGLang's contract for rebuilding links from the mask: ancestors are mask[i, j] with
        # j < i, the parent is the largest of them, the depth their count.
        block = vi.tree_mask[int(vi.mask_indptr[r]) : int(vi.mask_indptr[r + 1])]
        block = block.view(n, prefix[r] + n)[:, prefix[r] :]
        for i in range(1, real + 1):
            anc = [j for j in range(i) if block[i, j]]
            assert max(anc) == parents[i] and len(anc) == tree.depths[r, i]
    assert vi.tree_mask.tolist() == expected_full_mask(tree, prefix)
    assert vi.mask_indptr.tolist() == [0, *np.cumsum([n * (p + n) for p in prefix]).tolist()]


def test_verify_inputs_static_mask_size_pads_with_false():
    tree = dt.build_tree(torch.randn(2, 3, 9), 6)
    prefix = torch.tensor([4, 2])
    exact = dt.verify_inputs(tree, torch.tensor([1, 2]), prefix)
    numel = int(dt.full_mask_numel(7, prefix))
    assert exact.tree_mask.numel() == numel
    padded = dt.verify_inputs(tree, torch.tensor([1, 2]), prefix, mask_numel=numel + 50)
    assert torch.equal(padded.tree_mask[:numel], exact.tree_mask)
    assert not padded.tree_mask[numel:].any()


def test_verify_inputs_into_a_buffer_leave_or_clear_its_tail():
    """``mask_out``: the mask is written into the buffer's start and the buffer returned;
    what follows the real size is kept (a CUDA graph's shared buffer, cut by the caller)
    unless ``mask_numel`` says how far to clear. The other inputs are unchanged."""
    tree = dt.build_tree(torch.randn(2, 3, 9), 6)
    prefix, roots = torch.tensor([4, 2]), torch.tensor([1, 2])
    exact = dt.verify_inputs(tree, roots, prefix)
    numel = exact.tree_mask.numel()
    buffer = torch.ones(numel + 40, dtype=torch.bool)
    kept = dt.verify_inputs(tree, roots, prefix, mask_out=buffer)
    assert kept.tree_mask is buffer
    assert torch.equal(buffer[:numel], exact.tree_mask) and buffer[numel:].all()
    assert torch.equal(kept.input_ids, exact.input_ids)
    assert torch.equal(kept.positions, exact.positions)
    buffer.fill_(True)
    cleared = dt.verify_inputs(tree, roots, prefix, mask_out=buffer, mask_numel=numel + 10)
    assert torch.equal(cleared.tree_mask[:numel], exact.tree_mask)
    assert not buffer[numel : numel + 10].any() and buffer[numel + 10 :].all()


# -------------------------------------------------------------------------------- walk


def biased_targets(rng, tree: dt.DraftTree, vocab: int, p_follow: float) -> torch.Tensor:
    """Target tokens that often pick one of the node's children (long acceptances)."""
    b, n = tree.parents.shape
    target = rng.integers(0, vocab, size=(b, n))
    for r in range(b):
        parents, tokens = tree.parents[r].tolist(), [-1, *tree.tokens[r].tolist()]
        for i in range(n):
            kids = [tokens[j] for j in range(1, int(tree.num_nodes[r]) + 1) if parents[j] == i]
            if kids and rng.random() < p_follow:
                target[r, i] = kids[int(rng.integers(len(kids)))]
    return torch.from_numpy(target)


@PROPERTY
@given(
    seed=st.integers(0, 2**32 - 1),
    b=st.integers(1, 4),
    n_pos=st.integers(1, 7),
    vocab=st.integers(1, 10),
    budget=st.integers(0, 30),
    p_follow=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
)
def test_walk_matches_reference_walk(seed, b, n_pos, vocab, budget, p_follow):
    rng = np.random.default_rng(seed)
    lp, ids = make_topk(seed, b, n_pos, vocab, ties=seed % 3 == 0)
    tree = dt.build_tree_from_topk(lp, ids, budget)
    target = biased_targets(rng, tree, vocab, p_follow)
    roots = torch.from_numpy(rng.integers(0, vocab, size=b))
    walk = dt.verify_walk(tree, target)
    vi = dt.verify_inputs(tree, roots, torch.zeros(b, dtype=torch.int64))
    kept = dt.accepted_tokens(tree, roots, walk)
    emitted = dt.committed_tokens(tree, walk)
    comp = dt.compaction_indices(walk, budget + 1)
    assert walk.accepted.shape == (b, n_pos + 1)
    for r in range(b):
        n = int(tree.num_nodes[r])
        parents = tree.parents[r, : n + 1].tolist()
        tokens = [-1, *tree.tokens[r, :n].tolist()]
        path, bonus = oracle.reference_walk(parents, tokens, target[r].tolist())
        lcrs = oracle.lcrs_walk(
            vi.input_ids[r].tolist(),
            vi.retrieve_next_token[r].tolist(),
            vi.retrieve_next_sibling[r].tolist(),
            target[r].tolist(),
        )
        assert lcrs == (path, bonus)
        pad = n_pos + 1 - len(path)
        assert walk.accepted[r].tolist() == path + [-1] * pad
        assert walk.accept_len[r] == len(path) and walk.bonus[r] == bonus
        ids_r = vi.input_ids[r].tolist()
        assert kept[r].tolist() == [ids_r[i] for i in path] + [-1] * pad
        assert emitted[r].tolist() == [ids_r[i] for i in path[1:]] + [bonus] + [-1] * pad
        assert comp.keep[r].tolist() == [True] * len(path) + [False] * pad
        identity = [min(k, budget) for k in range(len(path), n_pos + 1)]
        assert comp.src_slots[r].tolist() == path + identity
        assert comp.src_rows[r].tolist() == [r * (budget + 1) + s for s in comp.src_slots[r]]


def test_budget_chain_reduces_to_dflash_chain_acceptance():
    n_pos, vocab = 15, 50
    rng = np.random.default_rng(0)
    logits = torch.zeros(6, n_pos, vocab)
    chain = torch.from_numpy(rng.integers(0, vocab, size=(6, n_pos)))
    logits.scatter_(2, chain.unsqueeze(-1), 30.0)  # a confident top-1 at every position
    tree = dt.build_tree(logits, n_pos)
    assert tree.parents[:, 1:].tolist() == [list(range(n_pos))] * 6, "a chain of rank-0 nodes"
    assert torch.equal(tree.tokens, chain)
    for r, agree in enumerate([0, 1, 5, 14, 15, 7]):
        # DFlash accepts the longest prefix of drafts equal to the target's tokens, then
        # the target's token after it: target[i] is its choice after root + drafts[:i].
        target = rng.integers(0, vocab, size=n_pos + 1)
        target[:agree] = chain[r, :agree].numpy()
        if agree < n_pos and target[agree] == chain[r, agree]:
            target[agree] = (target[agree] + 1) % vocab
        walk = dt.verify_walk(_row(tree, r), torch.from_numpy(target)[None])
        assert walk.accept_len.tolist() == [agree + 1]
        assert walk.bonus.tolist() == [int(target[agree])]


def _row(tree: dt.DraftTree, r: int) -> dt.DraftTree:
    return dt.DraftTree(
        tokens=tree.tokens[r : r + 1],
        parents=tree.parents[r : r + 1],
        depths=tree.depths[r : r + 1],
        visibility=tree.visibility[r : r + 1],
        num_nodes=tree.num_nodes[r : r + 1],
        scores=tree.scores[r : r + 1],
        max_depth=tree.max_depth,
    )


def test_walk_never_accepts_padding():
    tree = dt.build_tree(torch.randn(1, 1, 3), 8)  # 3 real nodes, 5 padding slots (token 0)
    target = torch.zeros((1, 9), dtype=torch.int64)
    target[0, 0] = 77  # no child of the root carries 77; padding carries 0 but is not a child
    walk = dt.verify_walk(tree, target)
    assert walk.accept_len.tolist() == [1] and walk.bonus.tolist() == [77]


# ------------------------------------------------------------------- no host sync, static


def test_whole_round_runs_on_meta_tensors_with_static_shapes():
    # Meta tensors have no data: any .item(), .tolist(), nonzero() or boolean indexing
    # raises, so this proves the round never needs values on the host.
    meta = torch.device("meta")
    b, n_pos, vocab, budget = 3, 15, 1000, 64
    logits = torch.empty(b, n_pos, vocab, dtype=torch.bfloat16, device=meta)
    tree = dt.build_tree(logits, budget)
    ints = torch.empty(b, dtype=torch.int64, device=meta)
    vi = dt.verify_inputs(tree, ints, ints, mask_numel=b * 65 * (4096 + 65))
    walk = dt.verify_walk(tree, torch.empty(b, budget + 1, dtype=torch.int64, device=meta))
    comp = dt.compaction_indices(walk, budget + 1)
    kept = dt.accepted_tokens(tree, ints, walk)
    emitted = dt.committed_tokens(tree, walk)
    assert tree.visibility.shape == (b, 65, 65) and vi.tree_mask.shape == (b * 65 * 4161,)
    assert vi.retrieve_next_sibling.shape == (b, 65)
    assert walk.accepted.shape == kept.shape == emitted.shape == comp.src_rows.shape == (b, 16)
    lp, ids = dt.merge_shard_topk(
        [torch.empty(b, n_pos, 8, device=meta)] * 2,
        [torch.empty(b, n_pos, 8, dtype=torch.int64, device=meta)] * 2,
        [torch.empty(b, n_pos, device=meta)] * 2,
        8,
    )
    assert lp.shape == ids.shape == (b, n_pos, 8)


@pytest.mark.parametrize("budget", [2, 5, 16, 33])
@pytest.mark.parametrize("shape", ["one_parent_many_ranks", "many_parents_rank_zero"])
def test_staircase_corners(budget, shape):
    # The staircase keeps candidate (i, r) only when (i + 1)(r + 1) <= budget; these inputs
    # make the corners i = 0, r = budget - 1 and i = budget - 1, r = 0 the ones that count.
    vocab = budget + 3
    flat = -0.01 * np.arange(vocab, dtype=np.float32) - 1.0
    peaked = np.full(vocab, -40.0, dtype=np.float32)
    peaked[0] = 0.0
    rows = [peaked, flat, flat] if shape == "one_parent_many_ranks" else [flat, peaked, flat]
    lp = torch.from_numpy(np.stack(rows))[None]
    ids = torch.from_numpy(
        np.stack([np.random.default_rng(i).permutation(vocab) for i in range(3)])
    )
    check_batch(lp, ids[None], budget)


def test_tree_made_elsewhere_needs_only_the_documented_fields():
    built = dt.build_tree(torch.randn(2, 3, 20), 10)
    bare = dt.DraftTree(
        tokens=built.tokens,
        parents=built.parents,
        depths=built.depths,
        visibility=built.visibility,
        num_nodes=built.num_nodes,
    )
    target = biased_targets(np.random.default_rng(1), built, 20, 0.9)
    a, b = dt.verify_walk(built, target), dt.verify_walk(bare, target)
    assert b.accepted.shape == (2, 11)  # no depth known: as wide as the node slots
    assert torch.equal(b.accepted[:, :4], a.accepted) and (b.accepted[:, 4:] == -1).all()
    assert torch.equal(a.accept_len, b.accept_len) and torch.equal(a.bonus, b.bonus)


def test_cpu_path_never_needs_triton(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "triton", None)  # `import triton` fails
    dt._triton_importable.cache_clear()
    try:
        logits = torch.randn(2, 4, 30)
        assert not dt._want_triton(logits, True)
        tree = dt.build_tree(logits, 12, use_triton=True)
        vi = dt.verify_inputs(tree, torch.tensor([1, 2]), torch.tensor([3, 4]), use_triton=True)
        walk = dt.verify_walk(tree, vi.input_ids, use_triton=True)
        assert walk.accept_len.shape == (2,)
    finally:
        dt._triton_importable.cache_clear()


def test_pdl_is_on_from_the_start_of_a_process_with_its_environment_switch():
    """``DDTREE_PDL=1`` turns programmatic dependent launch on in a process whose tuning
    nobody sets (a server's copy of this module); unset, ``0`` or anything else leaves it off.
    Off the GPU the launches stay plain whatever is asked."""
    import os
    import subprocess
    import sys

    code = "from ddtree_cli import draft_tree as dt; print(dt._TUNING['pdl'])"
    for env, want in [(None, "0"), ("1", "1"), ("0", "0"), ("yes", "0")]:
        environ = {k: v for k, v in os.environ.items() if k != dt.PDL_ENV}
        if env is not None:
            environ[dt.PDL_ENV] = env
        got = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
        assert got == want, (env, got)
    tuning = dict(dt._TUNING)
    try:
        dt._TUNING["pdl"] = 1
        assert dt._pdl(torch.device("cpu")) == {"PDL": False}
    finally:
        dt._TUNING.update(tuning)
