"""DDTree draft trees on the GPU: build, verify inputs, verify walk, KV compaction indices.

DDTree (arXiv 2604.12989) turns the per-position draft distributions of one block-diffusion
drafter pass (DFlash) into a best-first tree of continuations under a node budget ``B`` and
verifies the whole tree in one target pass with an ancestor-only attention mask.

This module is self-contained: it imports torch and the standard library only (and, on CUDA,
optional Triton kernels imported lazily), so it can be copied verbatim into other code bases.
Everything is batched, stays on the device of its inputs, has fixed shapes for a given
``(batch, positions, budget)``, never synchronises with the host and can be captured in a CUDA
graph. The pure-PyTorch path is the reference and runs on the CPU too.

Notation: ``b`` batch, ``L`` drafted positions (block size - 1, e.g. 15), ``V`` vocabulary,
``B`` budget (drafted nodes per request), ``N = B + 1`` node slots (slot 0 is the root).

The tree
--------
Let ``lp[d, r]`` be the ``r``-th largest log-probability at drafted position ``d`` and
``K = min(B, V)``. A node at depth ``d`` is a rank tuple ``(r_1, ..., r_d)``; its score is
``lp[0, r_1] + ... + lp[d-1, r_d]`` (the log of the draft probability of that prefix).
Because every log-probability is <= 0 and every row is sorted, a node never scores higher than
its parent or its previous sibling, so the ``B`` best nodes form a tree; it is the set the
reference best-first heap pops (paper Prop. 2-3, ``build_ddtree_tree`` of liranringel/ddtree).

Instead of a heap (``B`` sequential pops) the selection runs depth by depth (``L`` steps):
``A_d``, the best ``B`` nodes of depth ``d``, is the top ``B`` of the children of ``A_{d-1}``.
Only children ``(i, r)`` of the ``i``-th parent with rank ``r`` where ``(i+1)(r+1) <= B`` can
make it (the others have ``B`` better candidates: the staircase), which leaves about
``B ln B`` candidates per depth. The tree is then the top ``B`` of all ``A_d`` together.

Ties are broken so that an ancestor always comes before its descendants: within a depth by
(score desc, parent position asc, rank asc), across depths by (score desc, depth asc,
position asc). Hence the selected nodes of each depth are a prefix of ``A_d`` and the set is
closed under taking parents. With exact ties the reference heap (which breaks them by rank
tuple) can pick different nodes of equal score; the tree's value (sum of draft probabilities,
the expected acceptance length under the draft) is the same.

Nodes are numbered breadth first: depth 1 first, then depth 2, ...; within a depth by score.
So every parent index is lower than its child's, and an accepted path has increasing indices.

Padding: when fewer than ``B`` nodes exist (``B`` larger than the number of prefixes, or
``V < B`` with few positions), slots after ``num_nodes`` are padding: token 0, parent -1,
depth 0, a visibility row holding only itself; the walk never accepts them.

Log-probabilities below ``LOGPROB_FLOOR`` (tokens of zero draft probability, ``-inf`` logits)
are raised to it, so they stay orderable and are drafted only when nothing better is left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

LOGPROB_FLOOR = -1.0e30
"""Finite floor for log-probabilities: 15 of them still sum to a finite fp32 number."""

_NEG_INF = float("-inf")

__all__ = [
    "LOGPROB_FLOOR",
    "CompactionIndices",
    "DraftTree",
    "VerifyInputs",
    "WalkResult",
    "accepted_tokens",
    "build_tree",
    "build_tree_from_topk",
    "committed_tokens",
    "compaction_indices",
    "full_mask_numel",
    "merge_shard_topk",
    "shard_topk",
    "topk_logprobs",
    "verify_inputs",
    "verify_walk",
]


@dataclass
class DraftTree:
    """A batch of draft trees; every tensor lives on the device of the draft logits.

    Attributes:
        tokens: int64 ``[b, B]``, the token of node ``i + 1`` (node 0 is the root, the bonus
            token of the previous round, which is not drafted). Padding: 0.
        parents: int64 ``[b, N]``; ``parents[:, 0] == -1``; every parent index is lower than
            its child's. Padding: -1.
        depths: int64 ``[b, N]``; the root has depth 0, a node drafted at position ``d``
            (1-based) has depth ``d``. Padding: 0.
        visibility: bool ``[b, N, N]``; ``visibility[q, k]`` is True when node ``k`` is node
            ``q`` or one of its ancestors. Padding rows hold only themselves.
        num_nodes: int64 ``[b]``, drafted nodes per request; slots ``> num_nodes`` are padding.
        scores: float32 ``[b, N]``, log of the draft probability of each node's path (root 0,
            padding ``-inf``).
        max_depth: the number of drafted positions ``L``; no node is deeper.
    """

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    visibility: Tensor
    num_nodes: Tensor
    scores: Tensor
    max_depth: int

    @property
    def budget(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[1] + 1


@dataclass
class VerifyInputs:
    """What the target's tree-verify pass needs, for a batch (SGLang's layout).

    Attributes:
        input_ids: int64 ``[b, N]``, the root (bonus) token first, then the node tokens.
        positions: int64 ``[b, N]``, ``prefix_len + depth`` (siblings share a position).
        tree_mask: flat bool, SGLang's FULL_MASK layout: per request a row-major
            ``[N, prefix_len + N]`` block (prefix columns True, then the visibility block),
            blocks concatenated over the batch. Entries past ``mask_indptr[-1]`` (when a
            larger static size was asked for) are False.
        mask_indptr: int64 ``[b + 1]``, start of each request's block in ``tree_mask``.
        retrieve_index: int64 ``[b, N]``, ``request * N + node``: the flat row of a node.
        retrieve_next_token: int64 ``[b, N]``, a node's first child (lowest index), -1: none.
        retrieve_next_sibling: int64 ``[b, N]``, the next node (higher index) with the same
            parent, -1: none.
    """

    input_ids: Tensor
    positions: Tensor
    tree_mask: Tensor
    mask_indptr: Tensor
    retrieve_index: Tensor
    retrieve_next_token: Tensor
    retrieve_next_sibling: Tensor


@dataclass
class WalkResult:
    """The outcome of verifying a batch of trees.

    Attributes:
        accepted: int64 ``[b, L + 1]``, the accepted node indices in path order (root first),
            -1 after ``accept_len``.
        accept_len: int64 ``[b]``, accepted nodes including the root. It equals the number of
            tokens committed this round: the matched drafts plus the bonus token.
        bonus: int64 ``[b]``, the target's token at the last accepted node: the next root.
    """

    accepted: Tensor
    accept_len: Tensor
    bonus: Tensor


@dataclass
class CompactionIndices:
    """Gather indices that move the accepted path's rows to the front of the verify window.

    Attributes:
        src_slots: int64 ``[b, L + 1]``; row ``k`` of the compacted window comes from node slot
            ``src_slots[:, k]`` (the accepted node at depth ``k``; ``k`` itself after
            ``accept_len``, so the copy is the identity there). ``src_slots[:, k] >= k``, so
            gathering all sources before writing is safe in place.
        src_rows: int64 ``[b, L + 1]``, the same as flat rows ``request * N + slot`` into a
            ``[b * N, ...]`` tensor (hidden states, logits).
        keep: bool ``[b, L + 1]``, ``k < accept_len``.
    """

    src_slots: Tensor
    src_rows: Tensor
    keep: Tensor


# ----------------------------------------------------------------------------- top-K


def topk_logprobs(draft_logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-``k`` log-probabilities of every row of ``draft_logits [b, L, V]``.

    Returns ``(logprobs [b, L, k'] float32, ids [b, L, k'] int64)`` with ``k' = min(k, V)``,
    each row sorted descending. Any float dtype; computed in float32; floored at
    ``LOGPROB_FLOOR``.
    """
    if draft_logits.dim() != 3:
        raise ValueError(
            f"draft_logits must be [batch, positions, vocab], got {draft_logits.shape}"
        )
    kk = max(0, min(int(k), draft_logits.shape[-1]))
    if kk == 0:
        b, n_pos, _ = draft_logits.shape
        return (
            draft_logits.new_empty((b, n_pos, 0), dtype=torch.float32),
            torch.empty((b, n_pos, 0), dtype=torch.int64, device=draft_logits.device),
        )
    # topk on the input dtype reads half the bytes of fp32; the order is the same.
    values, ids = torch.topk(draft_logits, kk, dim=-1, largest=True, sorted=True)
    lse = torch.logsumexp(draft_logits.float(), dim=-1, keepdim=True)
    return (values.float() - lse).clamp_min(LOGPROB_FLOOR), ids


def shard_topk(local_logits: Tensor, k: int, vocab_start: int) -> tuple[Tensor, Tensor, Tensor]:
    """One tensor-parallel rank's part of :func:`merge_shard_topk`.

    ``local_logits [b, L, V_local]`` holds vocabulary ids ``vocab_start ...``. Returns
    ``(values [b, L, k'] float32 raw logits, ids [b, L, k'] global int64, lse [b, L] float32)``
    with ``k' = min(k, V_local)``: ``2 k' + 1`` numbers per row to all-gather instead of the
    whole vocabulary.
    """
    kk = max(0, min(int(k), local_logits.shape[-1]))
    values, ids = torch.topk(local_logits, kk, dim=-1, largest=True, sorted=True)
    lse = torch.logsumexp(local_logits.float(), dim=-1)
    return values.float(), ids + vocab_start, lse


def merge_shard_topk(
    shard_values: Tensor | Sequence[Tensor],
    shard_ids: Tensor | Sequence[Tensor],
    shard_lse: Tensor | Sequence[Tensor],
    k: int,
) -> tuple[Tensor, Tensor]:
    """Merge per-shard top-K of a vocabulary split over tensor-parallel ranks.

    Args:
        shard_values: per shard, the raw logits of its local top-K, ``[b, L, k_s]`` (a
            sequence, or one tensor ``[S, b, L, k_s]``); any float dtype.
        shard_ids: matching global vocabulary ids, int64, same shapes.
        shard_lse: per shard, the log-sum-exp of all its logits, ``[b, L]`` (or ``[S, b, L]``).
        k: how many to keep.

    Returns:
        ``(logprobs [b, L, k'] float32, ids [b, L, k'] int64)``, ``k' = min(k, S * k_s)``,
        rows sorted descending: the same as :func:`topk_logprobs` on the full vocabulary
        (up to rounding of the log-sum-exp and the order of equal logits), because the
        global top-K is contained in the union of the shards' top-K.
    """
    values = _stack_last(shard_values).float()
    ids = _stack_last(shard_ids).to(torch.int64)
    lse_parts = shard_lse if isinstance(shard_lse, Tensor) else torch.stack(list(shard_lse))
    lse = torch.logsumexp(lse_parts.float(), dim=0)
    kk = max(0, min(int(k), values.shape[-1]))
    top, pos = torch.topk(values, kk, dim=-1, largest=True, sorted=True)
    logprobs = (top - lse.unsqueeze(-1)).clamp_min(LOGPROB_FLOOR)
    return logprobs, ids.gather(-1, pos)


def _stack_last(parts: Tensor | Sequence[Tensor]) -> Tensor:
    """``[S, b, L, k]`` or a sequence of ``[b, L, k]`` -> ``[b, L, S * k]``."""
    if isinstance(parts, Tensor):
        return torch.cat(list(parts.unbind(0)), dim=-1)
    return torch.cat(list(parts), dim=-1)


# ------------------------------------------------------------------------------ build


def build_tree(draft_logits: Tensor, budget: int, *, use_triton: bool | None = None) -> DraftTree:
    """Build the DDTree of every request from its draft logits ``[b, L, V]``.

    ``use_triton``: None picks the fused Triton kernels when the logits are on CUDA and Triton
    imports (set ``DDTREE_DISABLE_TRITON=1`` to opt out); False forces the PyTorch path.
    Both return the same trees (equal-score ties may resolve differently).
    """
    if draft_logits.dim() != 3:
        raise ValueError(
            f"draft_logits must be [batch, positions, vocab], got {draft_logits.shape}"
        )
    budget = max(0, int(budget))
    logprobs, ids = topk_logprobs(draft_logits, budget)
    return build_tree_from_topk(logprobs, ids, budget)


def build_tree_from_topk(topk_logprobs: Tensor, topk_ids: Tensor, budget: int) -> DraftTree:
    """Build the trees from precomputed top-K log-probabilities ``[b, L, K]`` and ids.

    Each row must be normalised log-probabilities sorted descending (as
    :func:`topk_logprobs` and :func:`merge_shard_topk` return). Only the first ``min(K, B)``
    ranks are used (Lemma 1 of the paper: a larger K cannot help).
    """
    if topk_logprobs.dim() != 3 or topk_logprobs.shape != topk_ids.shape:
        raise ValueError(
            f"topk logprobs/ids must both be [batch, positions, k]; got "
            f"{tuple(topk_logprobs.shape)} and {tuple(topk_ids.shape)}"
        )
    b, n_pos, k_in = topk_logprobs.shape
    budget = max(0, int(budget))
    device = topk_logprobs.device
    kk = min(k_in, budget)
    if budget == 0 or n_pos == 0 or kk == 0:
        return _empty_tree(b, budget, n_pos, device)
    lp = topk_logprobs[..., :kk].float().clamp_min(LOGPROB_FLOOR)
    ids = topk_ids[..., :kk].to(torch.int64)
    scores, ranks, parent_pos = _select_per_depth(lp, budget)
    return _flatten(scores, ranks, parent_pos, ids, budget)


def _empty_tree(b: int, budget: int, n_pos: int, device: torch.device) -> DraftTree:
    n = budget + 1
    parents = torch.full((b, n), -1, dtype=torch.int64, device=device)
    scores = torch.full((b, n), _NEG_INF, dtype=torch.float32, device=device)
    scores[:, 0] = 0.0
    return DraftTree(
        tokens=torch.zeros((b, budget), dtype=torch.int64, device=device),
        parents=parents,
        depths=torch.zeros((b, n), dtype=torch.int64, device=device),
        visibility=torch.eye(n, dtype=torch.bool, device=device).expand(b, n, n).clone(),
        num_nodes=torch.zeros((b,), dtype=torch.int64, device=device),
        scores=scores,
        max_depth=n_pos,
    )


@lru_cache(maxsize=64)
def _staircase(budget: int, k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Candidate (parent position, rank) pairs that can enter a depth's top ``budget``.

    Parents are sorted by score and ranks by log-prob, so candidate ``(i, r)`` is beaten by
    all ``(i', r')`` with ``i' <= i, r' <= r``; it can only be among the best ``budget`` when
    ``(i + 1)(r + 1) <= budget``. Ordered by (i, r): the tie-break order of a stable sort.
    """
    pairs = [(i, r) for i in range(budget) for r in range(min(k, budget // (i + 1)))]
    cand = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
    return cand[:, 0].contiguous().to(device), cand[:, 1].contiguous().to(device)


def _select_per_depth(lp: Tensor, budget: int) -> tuple[Tensor, Tensor, Tensor]:
    """``A_d`` for every depth: score, rank and parent position of its best ``budget`` nodes.

    Returns three ``[b, L, budget]`` tensors, each depth sorted by (score desc, parent asc,
    rank asc); missing entries score ``-inf``.
    """
    b, n_pos, kk = lp.shape
    device = lp.device
    width = min(kk, budget)
    first = torch.full((b, budget), _NEG_INF, dtype=torch.float32, device=device)
    first[:, :width] = lp[:, 0, :width]
    scores = [first]
    ranks = [torch.arange(budget, device=device).expand(b, budget)]
    parent_pos = [torch.full((b, budget), -1, dtype=torch.int64, device=device)]
    cand_i, cand_r = _staircase(budget, kk, device)
    for d in range(1, n_pos):
        cand = scores[-1][:, cand_i] + lp[:, d, cand_r]
        # Stable: equal scores keep the (parent, rank) order of the candidate list.
        order = torch.sort(cand, dim=-1, descending=True, stable=True).indices[:, :budget]
        scores.append(cand.gather(1, order))
        ranks.append(cand_r[order])
        parent_pos.append(cand_i[order])
    return torch.stack(scores, 1), torch.stack(ranks, 1), torch.stack(parent_pos, 1)


def _flatten(
    scores: Tensor, ranks: Tensor, parent_pos: Tensor, ids: Tensor, budget: int
) -> DraftTree:
    """Pick the global top ``budget`` of all ``A_d`` and number the nodes breadth first."""
    b, n_pos, _ = scores.shape
    device = scores.device
    flat_scores = scores.reshape(b, n_pos * budget)
    # Candidates are laid out (depth, position): a stable sort breaks ties by that order.
    order = torch.sort(flat_scores, dim=-1, descending=True, stable=True).indices[:, :budget]
    chosen = flat_scores.gather(1, order) > _NEG_INF
    depth_of = order // budget
    levels = torch.arange(n_pos, device=device)
    counts = ((depth_of.unsqueeze(-1) == levels) & chosen.unsqueeze(-1)).sum(1)  # [b, L]
    ends = torch.cumsum(counts, dim=1) + 1  # one past the last slot of each depth
    starts = ends - counts
    num_nodes = counts.sum(1)

    slot = torch.arange(1, budget + 1, device=device).expand(b, budget).contiguous()
    valid = slot <= num_nodes.unsqueeze(1)
    level = torch.searchsorted(ends, slot, right=True).clamp_max(n_pos - 1)
    pos = (slot - starts.gather(1, level)).clamp(0, budget - 1)
    flat = level * budget + pos
    rank = ranks.reshape(b, -1).gather(1, flat)
    kk = ids.shape[-1]
    token = ids.reshape(b, -1).gather(1, level * kk + rank.clamp(0, kk - 1))
    parent_start = starts.gather(1, (level - 1).clamp_min(0))
    parent = torch.where(level == 0, 0, parent_start + parent_pos.reshape(b, -1).gather(1, flat))
    node_score = flat_scores.gather(1, flat)

    zero = torch.zeros((b, 1), dtype=torch.int64, device=device)
    tokens = torch.where(valid, token, 0)
    parents = torch.cat([zero - 1, torch.where(valid, parent, -1)], dim=1)
    depths = torch.cat([zero, torch.where(valid, level + 1, 0)], dim=1)
    root_score = torch.zeros((b, 1), dtype=torch.float32, device=device)
    node_scores = torch.cat([root_score, torch.where(valid, node_score, _NEG_INF)], dim=1)
    return DraftTree(
        tokens=tokens,
        parents=parents,
        depths=depths,
        visibility=_visibility(parents, n_pos),
        num_nodes=num_nodes,
        scores=node_scores,
        max_depth=n_pos,
    )


def _jump_steps(max_depth: int) -> int:
    """Pointer-jumping rounds that cover a path of ``max_depth`` edges."""
    return max(1, math.ceil(math.log2(max_depth + 1)))


def _self_parents(parents: Tensor) -> Tensor:
    """Parents with the root and padding pointing at themselves (a fixed point for jumping)."""
    slots = torch.arange(parents.shape[1], device=parents.device).expand_as(parents)
    return torch.where(parents >= 0, parents, slots)


def _visibility(parents: Tensor, max_depth: int) -> Tensor:
    """Ancestor-or-self matrix by pointer jumping: ``ceil(log2(L + 1))`` gather-ORs."""
    b, n = parents.shape
    vis = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    jump = _self_parents(parents)
    for _ in range(_jump_steps(max_depth)):
        # After round t each row holds itself and its 2**t - 1 nearest ancestors.
        vis = vis | vis.gather(1, jump.unsqueeze(-1).expand(b, n, n))
        jump = jump.gather(1, jump)
    return vis


# ----------------------------------------------------------------------- verify inputs


def full_mask_numel(num_slots: int, prefix_lens: Tensor) -> Tensor:
    """Size of the FULL_MASK tree mask, ``sum(N * (prefix_len + N))``, as a 0-d tensor."""
    return (num_slots * (prefix_lens.to(torch.int64) + num_slots)).sum()


def verify_inputs(
    tree: DraftTree,
    root_tokens: Tensor,
    prefix_lens: Tensor,
    *,
    mask_numel: int | None = None,
) -> VerifyInputs:
    """Inputs of the target's tree-verify pass (SGLang's FULL_MASK layout and retrieve_*).

    Args:
        tree: the batch of trees.
        root_tokens: int64 ``[b]``, the bonus token of the previous round (each tree's root).
        prefix_lens: int64 ``[b]``, tokens already in each request's KV cache.
        mask_numel: static size of the flat ``tree_mask`` (e.g. ``b * N * (max_context + N)``,
            the size of a CUDA-graph buffer); entries past the real size are False. None sizes
            it exactly, which reads ``prefix_lens`` on the host once: use it outside graphs.
    """
    b, n = tree.parents.shape
    device = tree.parents.device
    prefix = prefix_lens.to(device=device, dtype=torch.int64)
    input_ids = torch.cat(
        [root_tokens.to(device=device, dtype=torch.int64).view(b, 1), tree.tokens], 1
    )
    positions = prefix.unsqueeze(1) + tree.depths

    row_len = prefix + n
    indptr = torch.zeros((b + 1,), dtype=torch.int64, device=device)
    indptr[1:] = torch.cumsum(n * row_len, 0)
    if mask_numel is None:
        mask_numel = int(indptr[-1])
    tree_mask = _full_mask(tree.visibility, prefix, indptr, mask_numel)

    slots = torch.arange(n, device=device)
    parents = tree.parents
    # first child: the lowest j whose parent is i (padding has parent -1 and never matches).
    is_child = parents.unsqueeze(1) == slots.view(1, n, 1)
    next_token = torch.where(is_child, slots, n).amin(-1)
    # next sibling: the lowest j > i with the same (real) parent as i.
    same_parent = (parents.unsqueeze(1) == parents.unsqueeze(2)) & (parents.unsqueeze(2) >= 0)
    later = slots.view(1, 1, n) > slots.view(1, n, 1)
    next_sibling = torch.where(same_parent & later, slots, n).amin(-1)
    retrieve_index = torch.arange(b, device=device).unsqueeze(1) * n + slots
    return VerifyInputs(
        input_ids=input_ids,
        positions=positions,
        tree_mask=tree_mask,
        mask_indptr=indptr,
        retrieve_index=retrieve_index,
        retrieve_next_token=torch.where(next_token == n, -1, next_token),
        retrieve_next_sibling=torch.where(next_sibling == n, -1, next_sibling),
    )


def _full_mask(visibility: Tensor, prefix: Tensor, indptr: Tensor, numel: int) -> Tensor:
    """The flat FULL_MASK: one index computation per element, no data-dependent shapes."""
    b, n, _ = visibility.shape
    device = visibility.device
    k = torch.arange(numel, device=device)
    req = torch.searchsorted(indptr[1:], k, right=True).clamp_max(b - 1)
    local = k - indptr[req]
    row_len = prefix[req] + n
    row = torch.div(local, row_len, rounding_mode="floor")
    col = local - row * row_len - prefix[req]
    in_range = (k < indptr[-1]) & (row < n)
    flat_vis = (req * n + row.clamp(0, n - 1)) * n + col.clamp(0, n - 1)
    tree_part = visibility.reshape(-1)[flat_vis.clamp(0, b * n * n - 1)]
    return in_range & ((col < 0) | tree_part)


# -------------------------------------------------------------------------------- walk


def verify_walk(tree: DraftTree, target_tokens: Tensor) -> WalkResult:
    """Follow each tree from the root while the target agrees with the draft.

    ``target_tokens [b, N]`` is the target's token at every node: its argmax, or at
    temperature > 0 one independent sample per node (then the output keeps the target's
    distribution exactly). A child is accepted when its token equals the target's token at
    its parent and its parent is accepted. Siblings carry distinct tokens, so at most one
    child per node matches and the accepted nodes form one path from the root.
    """
    b, n = tree.parents.shape
    device = tree.parents.device
    target = target_tokens.to(device=device, dtype=torch.int64)
    slots = torch.arange(n, device=device).expand(b, n)
    jump = _self_parents(tree.parents)
    is_node = (tree.parents >= 0) & (slots <= tree.num_nodes.unsqueeze(1))
    drafted = torch.cat([torch.zeros_like(tree.tokens[:, :1]), tree.tokens], 1)
    accepted_mask = ((drafted == target.gather(1, jump)) & is_node) | (slots == 0)
    for _ in range(_jump_steps(tree.max_depth)):
        accepted_mask = accepted_mask & accepted_mask.gather(1, jump)
        jump = jump.gather(1, jump)

    depth_key = torch.where(accepted_mask, tree.depths, -1)
    last = depth_key.argmax(1, keepdim=True)
    accept_len = tree.depths.gather(1, last).squeeze(1) + 1
    bonus = target.gather(1, last).squeeze(1)
    levels = torch.arange(tree.max_depth + 1, device=device).view(1, -1, 1)
    at_level = (tree.depths.unsqueeze(1) == levels) & accepted_mask.unsqueeze(1)
    node = torch.where(at_level, slots.unsqueeze(1), n).amin(-1)
    return WalkResult(accepted=torch.where(node == n, -1, node), accept_len=accept_len, bonus=bonus)


def accepted_tokens(tree: DraftTree, root_tokens: Tensor, walk: WalkResult) -> Tensor:
    """Tokens of the accepted nodes in path order, ``[b, L + 1]``, root token first, -1 after.

    These are the tokens whose KV stays in the cache (at ``prefix_len + k``).
    """
    b = tree.tokens.shape[0]
    ids = torch.cat([root_tokens.to(tree.tokens).view(b, 1), tree.tokens], 1)
    keep = walk.accepted >= 0
    return torch.where(keep, ids.gather(1, walk.accepted.clamp_min(0)), -1)


def committed_tokens(tree: DraftTree, walk: WalkResult) -> Tensor:
    """The tokens this round emits, ``[b, L + 1]``: matched drafts, then the bonus, -1 after.

    Exactly ``accept_len`` of them; the root is not among them (it was the previous round's
    bonus token).
    """
    b, width = walk.accepted.shape
    drafted = torch.cat([torch.zeros_like(tree.tokens[:, :1]), tree.tokens], 1)
    nxt = torch.cat([walk.accepted[:, 1:], walk.accepted.new_full((b, 1), -1)], 1)
    matched = drafted.gather(1, nxt.clamp_min(0))
    k = torch.arange(width, device=walk.accepted.device).expand(b, width)
    last = walk.accept_len.unsqueeze(1) - 1
    out = torch.where(k < last, matched, -1)
    return torch.where(k == last, walk.bonus.unsqueeze(1), out)


def compaction_indices(walk: WalkResult, num_slots: int) -> CompactionIndices:
    """Gather indices that compact the accepted path's KV / hidden rows to the front.

    Use ``window[:, :L+1] = window.gather(src_slots)`` on a ``[b, N, ...]`` verify window, or
    ``hidden[src_rows]`` on flat ``[b * N, H]`` hidden states (the drafter's next context).
    """
    b, width = walk.accepted.shape
    device = walk.accepted.device
    k = torch.arange(width, device=device).expand(b, width)
    keep = k < walk.accept_len.unsqueeze(1)
    src_slots = torch.where(keep, walk.accepted, k).clamp_max(num_slots - 1)
    src_rows = torch.arange(b, device=device).unsqueeze(1) * num_slots + src_slots
    return CompactionIndices(src_slots=src_slots, src_rows=src_rows, keep=keep)
