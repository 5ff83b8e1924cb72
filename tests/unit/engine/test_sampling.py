"""At temperature > 0, DDTree's (and DFlash's) outputs follow the target's distribution.

Small vocabulary (6 tokens), so the exact distribution of the first three generated tokens
(216 outcomes) can be enumerated from the target's own probabilities. 12000 draws per mode;
Pearson's chi-square test at significance level alpha = 0.001 (cells with expected count
below 5 merged). Seeds are fixed, so a run is deterministic; the power check below shows the
same test does reject a slightly different distribution.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ddtree_cli.engine.decoding import Engine, generate
from tests.unit.engine.helpers import full_forward, tiny_pair

VOCAB = 6
PROMPT = [1, 4, 2]
DEPTH = 3
DRAWS = 12000
ALPHA = 1e-3
PAIR = tiny_pair(seed=5, vocab=VOCAB)


def exact_distribution(temperature: float) -> dict[tuple[int, ...], float]:
    probs = {}
    for head in itertools.product(range(VOCAB), repeat=DEPTH - 1):
        logits = full_forward(PAIR, PROMPT + list(head))[len(PROMPT) - 1 :]
        p = torch.softmax(logits.double() / temperature, dim=-1)
        for last in range(VOCAB):
            seq = (*head, last)
            probs[seq] = float(torch.prod(p[torch.arange(DEPTH), torch.tensor(seq)]))
    return probs


def chi_square_p_value(counts: dict, expected_probs: dict, n: int) -> float:
    cells = sorted(expected_probs, key=expected_probs.get)
    stat, dof, pool_obs, pool_exp = 0.0, -1, 0.0, 0.0
    for cell in cells:  # merge the smallest cells until each has expected count >= 5
        pool_obs += counts.get(cell, 0)
        pool_exp += expected_probs[cell] * n
        if pool_exp >= 5:
            stat += (pool_obs - pool_exp) ** 2 / pool_exp
            dof += 1
            pool_obs = pool_exp = 0.0
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        dof += 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def draw(algo: str, temperature: float, budget: int | str | None = None) -> tuple[dict, Engine]:
    engine = Engine(PAIR, algo, block_size=4, budget=budget, max_batch=400, context_len=16, seed=11)
    seqs = generate(engine, [PROMPT] * DRAWS, DEPTH, temperature=temperature)
    counts: dict[tuple[int, ...], int] = {}
    for s in seqs:
        counts[tuple(s.output)] = counts.get(tuple(s.output), 0) + 1
    return counts, engine


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algo", "budget"), [("ddtree", 8), ("ddtree", 2), ("ddtree", "auto"), ("dflash", None)]
)
def test_sampled_outputs_follow_the_target_distribution(algo, budget):
    exact = exact_distribution(1.0)
    counts, engine = draw(algo, 1.0, budget)
    # The drafts were really accepted, or the test would only check the bonus tokens.
    assert engine.total_accepted > 1.2 * engine.total_rounds
    assert chi_square_p_value(counts, exact, DRAWS) > ALPHA


@pytest.mark.slow
def test_the_test_rejects_a_wrong_distribution():
    counts, _ = draw("ddtree", 0.8, 8)  # samples at T=0.8, compared against T=1.0
    assert chi_square_p_value(counts, exact_distribution(1.0), DRAWS) < ALPHA
