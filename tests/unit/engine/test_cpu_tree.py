"""cpu_tree (the engine's CPU tree build and walk) against draft_tree, field for field.

draft_tree itself is checked against the reference heap and brute force in
tests/unit/test_draft_tree.py; here the scalar heap must give its exact trees (ties, padding,
floored -inf logits and scores included) and its exact walks.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from ddtree_cli import draft_tree
from ddtree_cli.engine import cpu_tree
from ddtree_cli.engine.decoding import Engine, generate
from ddtree_cli.engine.oracle import PeakedDraftHook
from tests.unit.engine.helpers import ar_outputs, tiny_pair
from tests.unit.test_draft_tree import PROPERTY, make_topk

FIELDS = ("tokens", "parents", "depths", "visibility", "num_nodes", "scores")


def assert_same_tree(got: draft_tree.DraftTree, want: draft_tree.DraftTree) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: {a} != {b}"
    assert got.max_depth == want.max_depth


def assert_same_walk(tree: draft_tree.DraftTree, target: torch.Tensor) -> None:
    got, want = cpu_tree.verify_walk(tree, target), draft_tree.verify_walk(tree, target)
    for name in ("accepted", "accept_len", "bonus"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def walk_targets(tree: draft_tree.DraftTree, vocab: int, seed: int) -> list[torch.Tensor]:
    """A random target and one that follows the tree (the token of node i + 1 at node i)."""
    b, n = tree.parents.shape
    random_target = torch.randint(
        0, max(vocab, 1), (b, n), generator=torch.Generator().manual_seed(seed)
    )
    following = torch.cat([tree.tokens, tree.tokens[:, :1]], 1) if tree.budget else random_target
    return [random_target, following]


@PROPERTY
@given(
    seed=st.integers(0, 2**32 - 1),
    b=st.integers(1, 3),
    n_pos=st.integers(1, 6),
    vocab=st.integers(1, 12),
    budget=st.integers(0, 40),
    ties=st.booleans(),
)
def test_same_trees_and_walks_as_draft_tree(seed, b, n_pos, vocab, budget, ties):
    lp, ids = make_topk(seed, b, n_pos, vocab, ties=ties)
    tree = cpu_tree.build_tree_from_topk(lp, ids, budget)
    want = draft_tree.build_tree_from_topk(lp, ids, budget, use_triton=False)
    assert_same_tree(tree, want)
    for target in walk_targets(want, vocab, seed):
        assert_same_walk(want, target)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), budget=st.sampled_from([1, 7, 15, 31, 64]))
def test_same_trees_from_draft_logits(seed, budget):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 15, 260, generator=gen) * 3
    logits[0, 2, :250] = float("-inf")  # few finite tokens: floored log-probs get drafted
    logits[1, 5] = 0.0  # a flat row: 260 equal log-probs
    assert_same_tree(
        cpu_tree.build_tree(logits, budget), draft_tree.build_tree(logits, budget, use_triton=False)
    )


def test_engine_uses_it_on_cpu_and_decodes_as_with_draft_tree():
    pair = tiny_pair(0)
    prompts = [[(7 * i + j) % 256 for j in range(5 + i)] for i in range(6)]
    refs = {tuple(p): out for p, out in zip(prompts, ar_outputs(pair, prompts, 40), strict=True)}
    runs = []
    for tree_ops in (cpu_tree, draft_tree):
        engine = Engine(pair, "ddtree", budget=12, max_batch=3, context_len=128)
        assert engine._tree is cpu_tree
        engine._tree = tree_ops
        engine.draft_hook = PeakedDraftHook(refs, (0.6, 0.3, 0.1), seed=3)
        seqs = generate(engine, prompts, 40)
        runs.append([(s.output, s.correct_drafts_histogram) for s in seqs])
    assert runs[0] == runs[1]
    assert [out for out, _ in runs[0]] == [refs[tuple(p)] for p in prompts]
    assert any(len(hist) > 2 for _, hist in runs[0])  # drafts were accepted, trees walked
