"""``budget="auto"`` in the embedded engine: the prefix order it relies on, exactness, choices.

The policy reads every candidate's tree value from one tree at the largest budget, because
the best-first tree is a prefix order: the budget-B tree is the B best nodes of the
budget-M tree (M > B). Both tree builders (``cpu_tree``, the engine's CPU path, and
``draft_tree``'s PyTorch path, used on CUDA) are checked here. Then the engine itself: with
the policy choosing (and exploring) budgets round by round, greedy outputs stay AR's.
"""

from __future__ import annotations

import random

import pytest
import torch

from ddtree_cli import draft_tree
from ddtree_cli.engine import cpu_tree
from ddtree_cli.engine.decoding import Engine, generate
from ddtree_cli.engine.oracle import PeakedDraftHook
from ddtree_cli.errors import ConfigError
from tests.unit.engine.helpers import ar_outputs, tiny_pair

PAIR = tiny_pair(0)
MAX_NEW = 96
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(256) for _ in range(_rng.randint(1, 40))] for _ in range(12)]
REFERENCE = ar_outputs(PAIR, PROMPTS, MAX_NEW)
REFS = {tuple(p): out for p, out in zip(PROMPTS, REFERENCE, strict=True)}

BUILDERS = {
    "cpu_tree": cpu_tree.build_tree,
    "draft_tree": lambda logits, budget: draft_tree.build_tree(logits, budget, use_triton=False),
}


def paths(tree, row: int) -> list[tuple[int, ...]]:
    """Each node's token path from the root, in node order (padding left out)."""
    parents, tokens = tree.parents[row].tolist(), tree.tokens[row].tolist()
    out: list[tuple[int, ...]] = [()]
    for i in range(1, int(tree.num_nodes[row]) + 1):
        out.append(out[parents[i]] + (tokens[i - 1],))
    return out[1:]


def logits(kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 15, 260, generator=gen) * 3
    if kind == "ties":  # few distinct values: many equal path scores
        x = x.round().clamp(-2, 2)
    return x


@pytest.mark.parametrize("builder", sorted(BUILDERS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_budget_b_tree_is_the_b_best_nodes_of_a_larger_tree(builder, seed):
    build = BUILDERS[builder]
    x = logits("random", seed)
    big = build(x, 64)
    for budget in (1, 3, 15, 32, 63):
        small = build(x, budget)
        for row in range(x.shape[0]):
            best = big.scores[row, 1:].argsort(descending=True, stable=True)[:budget]
            big_paths = paths(big, row)
            assert set(paths(small, row)) == {big_paths[int(i)] for i in best}
            assert torch.equal(
                small.scores[row, 1:].sort(descending=True).values,
                big.scores[row, 1:].sort(descending=True).values[:budget],
            )


@pytest.mark.parametrize("builder", sorted(BUILDERS))
@pytest.mark.parametrize("kind", ["random", "ties"])
def test_the_engine_reads_every_candidates_value_from_the_largest_tree(builder, kind):
    engine = Engine(PAIR, "ddtree", budget="auto", max_batch=3)
    assert engine.budgets == (15, 32, 64)
    x = logits(kind, 7)
    largest = BUILDERS[builder](x, 64)
    from_largest = engine._tree_values(largest, 3)[0].tolist()
    own = [float(BUILDERS[builder](x, b).scores[:, 1:].exp().sum()) for b in engine.budgets]
    assert from_largest == pytest.approx(own, rel=1e-6)
    assert engine._stats(largest, 3)[0] == pytest.approx(own, rel=1e-6)  # CPU rounds
    assert from_largest[0] < from_largest[1] < from_largest[2]


def path_target(x: torch.Tensor, tree) -> torch.Tensor:
    """A target whose token after each node depends on the node's path only: one of the
    draft's top 3 at the next position, picked by the path (as a model's would)."""
    top3 = x.topk(3, dim=-1).indices
    out = torch.zeros(tree.parents.shape, dtype=torch.long)
    for row in range(x.shape[0]):
        for i, path in enumerate([(), *paths(tree, row)]):
            if len(path) < x.shape[1]:
                out[row, i] = top3[row, len(path), sum(path) * 7 % 3]
    return out


@pytest.mark.parametrize("builder", sorted(BUILDERS))
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_round_at_a_larger_budget_says_what_each_smaller_tree_would_accept(builder, seed):
    engine = Engine(PAIR, "ddtree", budget="auto", max_batch=3)
    walk_of = cpu_tree.verify_walk if builder == "cpu_tree" else draft_tree.verify_walk
    x = logits("random", seed)
    big = BUILDERS[builder](x, 64)
    walk = walk_of(big, path_target(x, big))
    tensors = engine._tree_values(big, 3, walk).tolist()  # the CUDA rounds' version
    scalars = cpu_tree.prefix_stats(big, walk, engine.budgets, 3)  # the CPU rounds'
    really = []
    for budget in engine.budgets:
        tree = BUILDERS[builder](x, budget)
        really.append(int((walk_of(tree, path_target(x, tree)).accept_len - 1).sum()))
    assert tensors[1] == scalars[1] == really
    assert tensors[0] == pytest.approx(scalars[0], rel=1e-6)
    assert really[-1] > really[0] > 0  # deep enough to tell the budgets apart


CASES = [
    # batch, block, max_budget, rank probabilities of the true token (None: real drafter),
    # passes over the prompts (enough rounds for one bucket to explore every candidate:
    # 7 rounds each, four candidates at max budget 100)
    (1, 16, None, (0.5, 0.35, 0.15), 1),
    (3, 5, None, (0.7, 0.2, 0.1), 1),
    (8, 8, 20, (0.0, 1.0, 0.0), 1),
    (5, 16, 100, (0.8, 0.15, 0.05), 2),
    (4, 16, None, None, 1),
]


@pytest.mark.parametrize(("batch", "block", "max_budget", "probs", "passes"), CASES)
def test_auto_is_exact_and_records_its_choices(batch, block, max_budget, probs, passes):
    engine = Engine(
        PAIR,
        "ddtree",
        block_size=block,
        budget="auto",
        max_budget=max_budget,
        max_batch=batch,
        context_len=256,
    )
    if probs is not None:
        engine.draft_hook = PeakedDraftHook(REFS, probs, seed=batch)
    seqs = generate(engine, PROMPTS * passes, MAX_NEW)
    assert [s.output for s in seqs] == REFERENCE * passes
    snap = engine.policy.snapshot()
    assert snap["candidates"] == list(engine.budgets)
    assert engine.budgets[0] == block - 1
    assert engine.width == engine.budgets[-1] + 1
    # Every candidate was verified (exploration); a bucket that finished exploring chose one.
    assert all(n > 0 for n in snap["calibration_rounds"].values())
    full = snap["buckets"][str(1 << (batch - 1).bit_length())]
    assert set(full["round_ms"]) <= {str(b) for b in engine.budgets}
    settled = [s for s in snap["buckets"].values() if s["budget"] is not None]
    assert settled and all(s["budget"] in engine.budgets for s in settled)
    assert all(set(s["round_ms"]) == {str(b) for b in engine.budgets} for s in settled)
    assert snap["budget_changes"] >= len(settled)
    if probs is not None and probs[0] >= 0.7:
        assert sum(s.correct_drafts for s in seqs) > len(seqs)


@pytest.mark.parametrize("tree_module", [cpu_tree, draft_tree], ids=["cpu_tree", "draft_tree"])
def test_auto_and_a_fixed_budget_commit_the_same_tokens_with_the_real_drafter(tree_module):
    # draft_tree is what the engine runs on CUDA; here its PyTorch path on the CPU.
    fixed = generate(Engine(PAIR, "ddtree", budget=15, max_batch=4), PROMPTS, MAX_NEW)
    engine = Engine(PAIR, "ddtree", budget="auto", max_batch=4)
    engine._tree = tree_module
    auto = generate(engine, PROMPTS, MAX_NEW)
    assert [s.output for s in auto] == [s.output for s in fixed] == REFERENCE
    assert engine.policy.snapshot()["rounds"] > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"algo": "ddtree", "budget": 15, "max_budget": 64}, "applies to budget 'auto' only"),
        ({"algo": "ddtree", "budget": "auto", "max_budget": 8}, "below the drafter's block"),
        ({"algo": "dflash", "budget": "auto"}, "applies to ddtree only"),
        ({"algo": "ddtree", "budget": "autox"}, "neither a number nor 'auto'"),
    ],
)
def test_bad_budget_settings_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Engine(PAIR, **kwargs)
