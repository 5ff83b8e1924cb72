"""Plain-Python oracles for DDTree, written from the paper's description (arXiv 2604.12989).

- :func:`heap_tree`: the best-first construction (paper §4.3, Algorithm 1): a max-heap of
  frontier nodes keyed by the log-probability of the path; popping a node pushes its next
  sibling (same parent, next rank) and its first child (rank 0 at the next position).
- :func:`brute_force_scores`: every prefix of the top-K ranks, ranked by score.
- :func:`reference_walk`: the verify walk over ``child_maps`` keyed by token.
- :func:`lcrs_walk`: the walk as SGLang's greedy tree verify does it, over the
  first-child / next-sibling arrays.

Path scores are accumulated in float32 from the root down (parent score + log-prob), the
same arithmetic as the batched implementation, so equal paths give bit-equal scores and
ties are real ties rather than rounding noise.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np


@dataclass
class OracleTree:
    """Nodes in pop order; node 0 is the root."""

    ranks: list[tuple[int, ...]] = field(default_factory=lambda: [()])
    scores: list[float] = field(default_factory=lambda: [0.0])
    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    next_score: float | None = None  # best score left in the heap: the boundary

    def token_paths(self) -> set[tuple[int, ...]]:
        return {self.token_path(i) for i in range(1, len(self.ranks))}

    def token_path(self, i: int) -> tuple[int, ...]:
        path = []
        while i > 0:
            path.append(self.tokens[i])
            i = self.parents[i]
        return tuple(reversed(path))


def _f32_add(a: float, b: float) -> float:
    return float(np.float32(a) + np.float32(b))


def heap_tree(lp: np.ndarray, ids: np.ndarray, budget: int) -> OracleTree:
    """Best-first tree over ``lp [L, K]`` (rows sorted descending) and ``ids [L, K]``."""
    n_pos, k = lp.shape
    k = min(k, budget)
    tree = OracleTree()
    if budget <= 0 or n_pos == 0 or k == 0:
        return tree
    # entries: (-score, rank tuple, parent index, score); ties pop the smaller rank tuple.
    heap = [(-_f32_add(0.0, lp[0, 0]), (0,), 0, _f32_add(0.0, lp[0, 0]))]
    while heap and len(tree.ranks) - 1 < budget:
        _, ranks, parent, score = heapq.heappop(heap)
        index = len(tree.ranks)
        depth, rank = len(ranks), ranks[-1]
        tree.ranks.append(ranks)
        tree.scores.append(score)
        tree.tokens.append(int(ids[depth - 1, rank]))
        tree.parents.append(parent)
        if rank + 1 < k:
            sib = _f32_add(tree.scores[parent], lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-sib, ranks[:-1] + (rank + 1,), parent, sib))
        if depth < n_pos:
            child = _f32_add(score, lp[depth, 0])
            heapq.heappush(heap, (-child, ranks + (0,), index, child))
    tree.next_score = heap[0][3] if heap else None
    return tree


def brute_force_scores(lp: np.ndarray, budget: int) -> list[tuple[float, tuple[int, ...]]]:
    """All prefixes of the top-``min(K, budget)`` ranks with their scores, best first."""
    n_pos, k = lp.shape
    k = min(k, budget)
    out = []
    for depth in range(1, n_pos + 1):
        for ranks in itertools.product(range(k), repeat=depth):
            score = 0.0
            for d, r in enumerate(ranks):
                score = _f32_add(score, lp[d, r])
            out.append((score, ranks))
    out.sort(key=lambda e: (-e[0], len(e[1]), e[1]))
    return out


def reference_walk(parents: list[int], tokens: list[int], target: list[int]):
    """``cur = root; while target[cur] is a child's token: go there`` -> (accepted, bonus)."""
    child_maps: dict[int, dict[int, int]] = {}
    for i in range(1, len(parents)):
        child_maps.setdefault(parents[i], {})[tokens[i]] = i
    accepted = [0]
    cur, nxt = 0, target[0]
    while nxt in child_maps.get(cur, {}):
        cur = child_maps[cur][nxt]
        accepted.append(cur)
        nxt = target[cur]
    return accepted, nxt


def lcrs_walk(candidates, next_token, next_sibling, target):
    """SGLang's greedy tree verify loop: scan a node's children through the sibling links."""
    accepted = [0]
    cur = 0
    while True:
        child, found = next_token[cur], -1
        while child != -1:
            if candidates[child] == target[cur]:
                found = child
                break
            child = next_sibling[child]
        if found == -1:
            return accepted, target[cur]
        accepted.append(found)
        cur = found
