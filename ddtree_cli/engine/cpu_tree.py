"""DDTree's tree build and verify walk for CPU rounds, in Python scalars.

On the CPU a round's tensors are tiny (a 16-node tree, a 260-token vocabulary) and
``draft_tree``'s batched PyTorch path pays a fixed dispatch cost for each of its ~200 small
ops: about 1.2 ms a round, 9 % of the embedded pair's DFlash round. Here the same trees come
from a best-first heap over the top-K log-probabilities (about 0.1 ms): nothing on a CPU
waits for a host read, so the heap's sequential pops cost nothing but their own work.

Same results as ``draft_tree.build_tree`` / ``verify_walk``, field for field, ties included:
the heap orders nodes by (score desc, depth asc, parent's place in its depth asc, rank asc),
which is ``draft_tree``'s order, and path scores are summed in float32 from the root down
(a double sum of two float32 numbers rounded to float32 is the float32 sum). The tests
compare both on tie-free and tie-heavy inputs. CUDA (and CUDA graphs) keep ``draft_tree``.
"""

from __future__ import annotations

import heapq
import math
import struct
from collections.abc import Sequence

import torch
from torch import Tensor

from ddtree_cli import draft_tree
from ddtree_cli.draft_tree import DraftTree, WalkResult

_F32 = struct.Struct("f")


def _f32(x: float) -> float:
    return _F32.unpack(_F32.pack(x))[0]


def build_tree(draft_logits: Tensor, budget: int) -> DraftTree:
    """``draft_tree.build_tree(draft_logits, budget)`` for CPU logits ``[b, L, V]``."""
    logprobs, ids = draft_tree.topk_logprobs(draft_logits, budget, use_triton=False)
    return _from_sorted(logprobs, ids, budget)


def build_tree_from_topk(topk_logprobs: Tensor, topk_ids: Tensor, budget: int) -> DraftTree:
    """``draft_tree.build_tree_from_topk`` on CPU tensors (rows sorted descending)."""
    lp = topk_logprobs.float().clamp_min(draft_tree.LOGPROB_FLOOR)
    return _from_sorted(lp, topk_ids, budget)


def _from_sorted(lp: Tensor, ids: Tensor, budget: int) -> DraftTree:
    """The trees from float32 log-probabilities already floored at ``LOGPROB_FLOOR``."""
    b, n_pos, k_in = lp.shape
    budget = max(0, int(budget))
    kk = min(k_in, budget)
    if budget == 0 or n_pos == 0 or kk == 0:
        return draft_tree.build_tree_from_topk(lp, ids, budget, use_triton=False)
    lp_rows = lp[..., :kk].tolist()
    id_rows = ids[..., :kk].tolist()
    n = budget + 1
    # One list per output, filled row by row: a round costs a handful of tensor creations.
    parents, depths, tokens, scores, counts, visibility = [], [], [], [], [], []
    for r in range(b):
        nodes = _best_first(lp_rows[r], kk, budget)
        # Breadth-first numbering: depth by depth, each depth in pop order.
        nodes.sort(key=lambda node: (node[1], node[3]))
        slot_of = {id(node): i + 1 for i, node in enumerate(nodes)}
        vis_rows = [[True] + [False] * budget]
        parents.append(-1)
        depths.append(0)
        scores.append(0.0)
        for i, (score, depth, rank, _, parent) in enumerate(nodes, 1):
            p = slot_of[id(parent)] if parent is not None else 0
            parents.append(p)
            depths.append(depth)
            scores.append(score)
            tokens.append(id_rows[r][depth - 1][rank])
            row = vis_rows[p].copy()
            row[i] = True
            vis_rows.append(row)
        pad = n - 1 - len(nodes)
        parents += [-1] * pad
        depths += [0] * pad
        scores += [float("-inf")] * pad
        tokens += [0] * pad
        counts.append(len(nodes))
        for i in range(len(nodes) + 1, n):
            vis_rows.append([j == i for j in range(n)])
        for row in vis_rows:
            visibility += row
    # The integer fields are views of one tensor: fewer tensor creations, the same values.
    ints = torch.tensor(parents + depths + tokens + counts, dtype=torch.int64)
    bn = b * n
    return DraftTree(
        tokens=ints[2 * bn : 2 * bn + b * budget].view(b, budget),
        parents=ints[:bn].view(b, n),
        depths=ints[bn : 2 * bn].view(b, n),
        visibility=torch.tensor(visibility, dtype=torch.bool).view(b, n, n),
        num_nodes=ints[2 * bn + b * budget :],
        scores=torch.tensor(scores, dtype=torch.float32).view(b, n),
        max_depth=n_pos,
    )


def _best_first(lp: list[list[float]], kk: int, budget: int) -> list[list]:
    """The ``budget`` best nodes of one request, in pop order.

    A node is ``[score, depth, rank, place in its depth, parent node or None]``. The heap key
    (-score, depth, parent's place, rank) names one node, and a node never comes before its
    parent or its previous sibling under it, so popping yields the top nodes in order.
    """
    n_pos = len(lp)
    first = [_f32(lp[0][0]), 1, 0, 0, None]
    heap = [(-first[0], 1, 0, 0, first)]
    placed = [0] * (n_pos + 1)
    out: list[list] = []
    while heap and len(out) < budget:
        _, depth, parent_place, rank, node = heapq.heappop(heap)
        node[3] = placed[depth]
        placed[depth] += 1
        out.append(node)
        parent = node[4]
        if rank + 1 < kk:
            base = parent[0] if parent is not None else 0.0
            sib = [_f32(base + lp[depth - 1][rank + 1]), depth, rank + 1, 0, parent]
            heapq.heappush(heap, (-sib[0], depth, parent_place, rank + 1, sib))
        if depth < n_pos:
            child = [_f32(node[0] + lp[depth][0]), depth + 1, 0, 0, node]
            heapq.heappush(heap, (-child[0], depth + 1, node[3], 0, child))
    return out


def verify_walk(tree: DraftTree, target_tokens: Tensor) -> WalkResult:
    """``draft_tree.verify_walk(tree, target_tokens)`` for CPU tensors."""
    b, n = tree.parents.shape
    width = tree.depth_limit + 1
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    counts = tree.num_nodes.tolist()
    target = target_tokens.tolist()
    accepted, accept_len, bonus = [], [], []
    for r in range(b):
        # Children by token: siblings carry distinct tokens, so a match is unique.
        children: dict[tuple[int, int], int] = {}
        for i in range(1, min(counts[r], n - 1) + 1):
            if parents[r][i] >= 0:
                children[(parents[r][i], tokens[r][i - 1])] = i
        path = [0]
        while len(path) < width:
            nxt = children.get((path[-1], target[r][path[-1]]))
            if nxt is None:
                break
            path.append(nxt)
        accepted.append(path + [-1] * (width - len(path)))
        accept_len.append(len(path))
        bonus.append(target[r][path[-1]])
    flat = torch.tensor([x for row in accepted for x in row] + accept_len + bonus)
    return WalkResult(
        accepted=flat[: b * width].view(b, width),
        accept_len=flat[b * width : b * width + b],
        bonus=flat[b * width + b :],
    )


def prefix_stats(
    tree: DraftTree, walk: WalkResult | None, budgets: Sequence[int], b: int
) -> list[list[float]]:
    """``[values, accepted]`` per budget ``B'`` in ``budgets`` (none above the tree's), summed
    over rows ``0..b-1``: the value of the budget-``B'`` tree, the ``B'`` best nodes of this
    one, and (given the walk; else 0) the drafted tokens it would have accepted, the path's
    nodes among them. ``draft_tree.prefix_stats`` for CPU rounds, in scalars; ranks break
    equal scores by node index, as a stable sort does."""
    values = [0.0] * len(budgets)
    accepted = [0.0] * len(budgets)
    paths = walk.accepted[:b, 1:].tolist() if walk is not None else [[]] * b
    for scores, path in zip(tree.scores[:b, 1:].tolist(), paths, strict=True):
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        total, best = 0.0, []
        for i in order:
            total += math.exp(scores[i])
            best.append(total)
        for j, budget in enumerate(budgets):
            values[j] += best[budget - 1]
        if path:
            rank = [0] * len(order)
            for place, i in enumerate(order):
                rank[i] = place
            ranks = [rank[node - 1] for node in path if node > 0]
            for j, budget in enumerate(budgets):
                accepted[j] += sum(r < budget for r in ranks)
    return [values, accepted]
