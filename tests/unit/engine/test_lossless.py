"""Greedy DFlash and DDTree emit exactly AR's tokens (float32 on CPU, so equality is exact).

With random weights the real drafter never agrees with the target, which would leave the
verify path untested (every round accepts only the bonus token). So most cases use
``PeakedDraftHook``: the drafter still runs, then its logits are peaked on the target's own
greedy continuation (known from the AR run) with controlled noise that puts the true token
at rank 0, 1 or 2. Rank 0 everywhere gives deep accepted paths; rank 1 makes DFlash's chain
fail at once while DDTree can only accept through a sibling. The hook changes proposals,
never the target's verification, so any difference from AR is an engine bug.
"""

from __future__ import annotations

import random

import pytest

from ddtree_cli.engine.decoding import Engine, RequestState, generate
from ddtree_cli.engine.oracle import PeakedDraftHook
from ddtree_cli.errors import ConfigError
from tests.unit.engine.helpers import ar_outputs, tiny_pair

MAX_NEW = 48
PAIR = tiny_pair(0)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(256) for _ in range(_rng.randint(1, 40))] for _ in range(12)]
REFERENCE = ar_outputs(PAIR, PROMPTS, MAX_NEW)
REFS = {tuple(p): out for p, out in zip(PROMPTS, REFERENCE, strict=True)}

CASES = [
    # algo, batch, block, budget, rank probabilities of the true token (None: real drafter)
    ("dflash", 1, 16, None, (1.0, 0.0, 0.0)),
    ("dflash", 3, 5, None, (0.7, 0.2, 0.1)),
    ("dflash", 8, 2, None, (0.9, 0.1, 0.0)),
    ("dflash", 8, 16, None, None),
    ("ddtree", 1, 16, 15, (1.0, 0.0, 0.0)),
    ("ddtree", 1, 16, 40, (0.5, 0.35, 0.15)),
    ("ddtree", 3, 5, 1, (0.7, 0.2, 0.1)),
    ("ddtree", 3, 16, 4, (0.7, 0.2, 0.1)),
    ("ddtree", 8, 8, 30, (0.0, 1.0, 0.0)),
    ("ddtree", 8, 2, 3, (0.6, 0.4, 0.0)),
    ("ddtree", 8, 16, 15, None),
    ("ddtree", 5, 16, 64, (0.8, 0.15, 0.05)),
]


def run(algo, batch, block, budget, probs, prompts=PROMPTS, max_new=MAX_NEW, stops=frozenset()):
    engine = Engine(PAIR, algo, block_size=block, budget=budget, max_batch=batch, context_len=256)
    if probs is not None:
        engine.draft_hook = PeakedDraftHook(REFS, probs, seed=batch)
    return generate(engine, prompts, max_new, stop_ids=stops)


@pytest.mark.parametrize(("algo", "batch", "block", "budget", "probs"), CASES)
def test_greedy_speculative_equals_ar(algo, batch, block, budget, probs):
    seqs = run(algo, batch, block, budget, probs)
    assert [s.output for s in seqs] == REFERENCE
    assert all(s.finish_reason == {"type": "length", "length": MAX_NEW} for s in seqs)
    if probs is not None and probs[0] >= 0.7:
        assert sum(s.correct_drafts for s in seqs) > len(seqs)  # the drafts did get accepted


def test_deep_paths_are_accepted():
    seqs = run("ddtree", 4, 16, 15, (1.0, 0.0, 0.0))
    assert [s.output for s in seqs] == REFERENCE
    deepest = max(len(s.correct_drafts_histogram) - 1 for s in seqs)
    assert deepest >= 8


def test_acceptance_through_a_sibling():
    # The true token is always the drafter's second choice: the chain never matches, only
    # the tree's rank-1 siblings can.
    chain = run("dflash", 4, 8, None, (0.0, 1.0, 0.0))
    tree = run("ddtree", 4, 8, 30, (0.0, 1.0, 0.0))
    assert [s.output for s in chain] == REFERENCE == [s.output for s in tree]
    assert sum(s.correct_drafts for s in chain) == 0
    assert sum(s.correct_drafts for s in tree) > len(PROMPTS)


@pytest.mark.parametrize("max_new", [1, 2, 7, 17])
@pytest.mark.parametrize("algo", ["ar", "dflash", "ddtree"])
def test_length_limit_is_exact(algo, max_new):
    seqs = run(algo, 4, 16, 15, None if algo == "ar" else (1.0, 0.0, 0.0), max_new=max_new)
    assert [s.output for s in seqs] == [r[:max_new] for r in REFERENCE]
    assert all(len(s.output) == max_new for s in seqs)


@pytest.mark.parametrize("algo", ["ar", "dflash", "ddtree"])
def test_stop_tokens_end_output_exactly(algo):
    # Stop at tokens that occur mid-output, so full accepted blocks run past them.
    stops = frozenset({REFERENCE[0][20], REFERENCE[3][11], REFERENCE[7][30]})
    seqs = run(algo, 5, 16, 20, None if algo == "ar" else (1.0, 0.0, 0.0), stops=stops)
    for seq, ref in zip(seqs, REFERENCE, strict=True):
        cut = next((i + 1 for i, t in enumerate(ref) if t in stops), len(ref))
        assert seq.output == ref[:cut]
        if cut < len(ref) or ref[cut - 1] in stops:
            assert seq.finish_reason == {"type": "stop", "matched": ref[cut - 1]}


def test_greedy_rows_stay_exact_next_to_sampled_rows():
    engine = Engine(PAIR, "ddtree", budget=15, max_batch=6, context_len=256)
    engine.draft_hook = PeakedDraftHook(REFS, (0.8, 0.2, 0.0))
    seqs = [
        RequestState(p, MAX_NEW, temperature=0.0 if i % 2 else 1.0)
        for i, p in enumerate(PROMPTS[:6])
    ]
    for s in seqs:
        engine.add(s)
    while engine.seqs:
        engine.step()
    for i, s in enumerate(seqs):
        assert len(s.output) == MAX_NEW
        if i % 2:
            assert s.output == REFERENCE[i]


@pytest.mark.parametrize("span_bucket", [7, 64])
@pytest.mark.parametrize(
    ("algo", "batch", "block", "budget", "probs"),
    [
        ("ar", 3, 16, None, None),
        ("dflash", 4, 16, None, (0.7, 0.2, 0.1)),
        ("ddtree", 4, 16, 15, (1.0, 0.0, 0.0)),
        ("ddtree", 5, 8, 30, (0.5, 0.35, 0.15)),
        ("ddtree", 3, 16, 4, (0.7, 0.2, 0.1)),
    ],
)
def test_padded_key_span_equals_ar(span_bucket, algo, batch, block, budget, probs):
    # CUDA graphs replay a verify pass whose key span is rounded up to a bucket; the masks
    # must hide the extra cache columns (stale K/V from longer rows and compacted paths).
    engine = Engine(
        PAIR,
        algo,
        block_size=block,
        budget=budget,
        max_batch=batch,
        context_len=256,
        span_bucket=span_bucket,
    )
    if probs is not None:
        engine.draft_hook = PeakedDraftHook(REFS, probs, seed=batch)
    seqs = generate(engine, PROMPTS, MAX_NEW)
    assert [s.output for s in seqs] == REFERENCE
    if probs is not None and probs[0] >= 0.7:
        assert sum(s.correct_drafts for s in seqs) > len(seqs)


def test_cuda_graphs_need_cuda():
    with pytest.raises(ConfigError, match="CUDA graphs"):
        Engine(PAIR, "ddtree", max_batch=1, context_len=64, cuda_graphs=True)
    with pytest.raises(ConfigError, match="span bucket"):
        Engine(PAIR, "dflash", max_batch=1, context_len=64, span_bucket=0)
