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
``A_d`` is the top ``B`` of the children of ``A_{d-1}``; by induction the tree's nodes of
depth ``d`` are a prefix of it. Only children ``(i, r)`` of the ``i``-th parent with rank ``r``
where ``(i+1)(r+2) <= B`` can be in the tree (a tree holding it also holds the
``(i+1)(r+1)`` at least as good nodes ``(i' <= i, r' <= r)`` and their ``i+1`` parents: the
staircase), which leaves fewer than ``B ln B`` candidates per depth. The tree is then the top
``B`` of all ``A_d`` together.

The Triton tree kernel (CUDA) adds a floor under the tree's scores: chain ``j`` is root child
``j`` followed by rank 0 at every later position, and the chains of root children ``0..j`` cut
at depths ``1..h`` are ``(j+1) h`` paths scoring at least chain ``j`` at depth ``h``; with
``h = ceil(B / (j+1))`` the best such chain is a floor. Depths whose best candidate is below it
are not built, a depth where even the best parent's second child is below it is ``A_{d-1}``
plus the rank-0 log-prob (no sort), and the final choice sorts only the entries at or above
it. Two switches (``_TUNING``) tighten or narrow that work: ``tree_rise`` raises the floor
after each sorted depth to the ``B``-th best of the paths seen so far, and ``tree_narrow``
sorts a depth's candidates at or above the floor in ``B`` lanes (a rectangle of parents by
ranks that holds all of them) instead of all of the staircase's, when they fit. All of it is
exact: the trees are the PyTorch path's, node for node.

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
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
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
            padding ``-inf``); None when the tree was made elsewhere.
        max_depth: the number of drafted positions ``L``; no node is deeper. None (a tree made
            elsewhere) means "up to the budget": the walk's outputs are then ``N`` wide.
    """

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    visibility: Tensor
    num_nodes: Tensor
    scores: Tensor | None = None
    max_depth: int | None = None

    @property
    def budget(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[1] + 1

    @property
    def depth_limit(self) -> int:
        """``max_depth`` when known, else the budget (no tree is deeper than its node count)."""
        return self.budget if self.max_depth is None else self.max_depth


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
    # (num_slots, indices) when the walk already computed :func:`compaction_indices`.
    _compaction: tuple[int, CompactionIndices] | None = field(
        default=None, repr=False, compare=False
    )


@dataclass
class CompactionIndices:
    """Gather indices that move the accepted path's rows to the front of the verify window.

    Attributes:
        src_slots: int64 ``[b, L + 1]``; row ``k`` of the compacted window comes from node slot
            ``src_slots[:, k]`` (the accepted node at depth ``k``; ``min(k, N - 1)`` after
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


def topk_logprobs(
    draft_logits: Tensor, k: int, *, use_triton: bool | None = None
) -> tuple[Tensor, Tensor]:
    """Top-``k`` log-probabilities of every row of ``draft_logits [b, L, V]``.

    Returns ``(logprobs [b, L, k'] float32, ids [b, L, k'] int64)`` with ``k' = min(k, V)``,
    each row sorted descending. Any float dtype; computed in float32; floored at
    ``LOGPROB_FLOOR``.

    ``use_triton``: as in :func:`build_tree`. On CUDA the fused kernels read the logits once
    for the top-K and the log-sum-exp together (two launches, against ``torch.topk`` plus a
    separate log-sum-exp pass over the vocabulary); equal logits may come in another order.
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
    if _want_triton(draft_logits, use_triton):
        return _triton_topk_logprobs(draft_logits, kk)
    # topk on the input dtype reads half the bytes of fp32; the order is the same.
    values, ids = torch.topk(draft_logits, kk, dim=-1, largest=True, sorted=True)
    lse = torch.logsumexp(draft_logits.float(), dim=-1, keepdim=True)
    return (values.float() - lse).clamp_min(LOGPROB_FLOOR), ids


def shard_topk(local_logits: Tensor, k: int, vocab_start: int) -> tuple[Tensor, Tensor, Tensor]:
    """One tensor-parallel rank's part of :func:`merge_shard_topk`.

    ``local_logits [b, L, V_local]`` holds vocabulary ids ``vocab_start ...``. Returns
    ``(values [b, L, k'] float32 raw logits, ids [b, L, k'] global int64, lse [b, L] float32)``
    with ``k' = min(k, V_local)``: ``2 k' + 1`` numbers per row to all-gather instead of the
    whole vocabulary. An all-gather needs the same ``k'`` on every rank, so every shard must
    hold at least ``k`` ids (true of real vocabularies: tens of thousands of ids per rank).
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
        rows sorted descending: the same as :func:`topk_logprobs` on the full vocabulary,
        because the global top-K is contained in the union of the shards' top-K.

    "The same" means: the same log-probabilities place by place (up to the rounding of the
    log-sum-exp), the same logit behind the id in every place, and every id whose logit is
    above the K-th largest in both. Among equal logits neither path promises an order
    (``torch.topk`` does not; the fused kernels order them another way), so tied ids may come
    in another order and, at the K-th value, be other ids of that value; the trees built from
    them have the same shape and scores. Every tensor-parallel rank merges the same gathered
    tensors the same way, so all ranks get the same ids.
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

    The first call for a given (budget, K, device) puts a small index table on the device
    and the first Triton call compiles the kernels: make one call before capturing a CUDA
    graph.
    """
    if draft_logits.dim() != 3:
        raise ValueError(
            f"draft_logits must be [batch, positions, vocab], got {draft_logits.shape}"
        )
    budget = max(0, int(budget))
    if _want_triton(draft_logits, use_triton):
        return _triton_build_tree(draft_logits, budget)
    logprobs, ids = topk_logprobs(draft_logits, budget, use_triton=False)
    return build_tree_from_topk(logprobs, ids, budget, use_triton=False)


def build_tree_from_topk(
    topk_logprobs: Tensor, topk_ids: Tensor, budget: int, *, use_triton: bool | None = None
) -> DraftTree:
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
    if _want_triton(lp, use_triton):
        return _triton_tree_from_topk(lp, ids, budget)
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
def _staircase(budget: int, k: int, device: torch.device) -> tuple[Tensor, Tensor, int]:
    """Candidate (parent position ``i``, rank ``r``) pairs worth scoring at depths >= 2.

    A tree node ``(i, r)`` comes with ``(i + 1)(r + 1)`` nodes of its depth that are at least
    as good (``i' <= i, r' <= r``: parents and ranks are sorted) and with their ``i + 1``
    parents, all of which the tree must then hold too: so ``(i + 1)(r + 2) <= budget``.
    Ordered by (i, r), the tie-break order of a stable sort. Padded with (0, 0) to at least
    ``budget`` entries; returns ``(cand_i, cand_r, number of real candidates)``.
    """
    pairs = [(i, r) for i in range(budget) for r in range(min(k, budget // (i + 1) - 1))]
    real = len(pairs)
    pairs += [(0, 0)] * max(0, budget - real)
    cand = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
    return cand[:, 0].contiguous().to(device), cand[:, 1].contiguous().to(device), real


def _select_per_depth(lp: Tensor, budget: int) -> tuple[Tensor, Tensor, Tensor]:
    """``A_d`` for every depth: score, rank and parent position of ``budget`` candidates.

    Returns three ``[b, L, budget]`` tensors, each depth sorted by (score desc, parent asc,
    rank asc); missing entries score ``-inf``. The nodes of depth ``d`` that belong to the
    tree are a prefix of ``A_d``.
    """
    b, n_pos, kk = lp.shape
    device = lp.device
    width = min(kk, budget)
    first = torch.full((b, budget), _NEG_INF, dtype=torch.float32, device=device)
    first[:, :width] = lp[:, 0, :width]
    scores = [first]
    ranks = [torch.arange(budget, device=device).expand(b, budget)]
    parent_pos = [torch.full((b, budget), -1, dtype=torch.int64, device=device)]
    cand_i, cand_r, real = _staircase(budget, kk, device)
    padding = torch.arange(cand_i.numel(), device=device) >= real
    for d in range(1, n_pos):
        cand = (scores[-1][:, cand_i] + lp[:, d, cand_r]).masked_fill(padding, _NEG_INF)
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
    mask_out: Tensor | None = None,
    use_triton: bool | None = None,
) -> VerifyInputs:
    """Inputs of the target's tree-verify pass (SGLang's FULL_MASK layout and retrieve_*).

    Args:
        tree: the batch of trees.
        root_tokens: int64 ``[b]``, the bonus token of the previous round (each tree's root).
        prefix_lens: int64 ``[b]``, tokens already in each request's KV cache.
        mask_numel: static size of the flat ``tree_mask`` (e.g. ``b * N * (max_context + N)``,
            the size of a CUDA-graph buffer); entries past the real size are False. None sizes
            it exactly, which reads ``prefix_lens`` on the host once: use it outside graphs.
        mask_out: a flat bool buffer the mask is written into instead (from its start; the
            real size must fit), returned whole as ``tree_mask``: entries past the real size
            are cleared up to ``mask_numel`` only (None: none are, and the size is never read
            on the host, so it can be captured in a CUDA graph).
    """
    b, n = tree.parents.shape
    device = tree.parents.device
    prefix = prefix_lens.to(device=device, dtype=torch.int64)
    if _want_triton(tree.parents, use_triton):
        if mask_out is not None:
            return _triton_verify_inputs(tree, root_tokens, prefix, mask_numel or 0, mask_out)
        if mask_numel is None:
            mask_numel = int(full_mask_numel(n, prefix))
        return _triton_verify_inputs(tree, root_tokens, prefix, mask_numel)
    input_ids = torch.cat(
        [root_tokens.to(device=device, dtype=torch.int64).view(b, 1), tree.tokens], 1
    )
    positions = prefix.unsqueeze(1) + tree.depths

    row_len = prefix + n
    indptr = torch.zeros((b + 1,), dtype=torch.int64, device=device)
    indptr[1:] = torch.cumsum(n * row_len, 0)
    if mask_out is not None:
        numel = max(int(indptr[-1]), mask_numel or 0)
        mask_out[:numel].copy_(_full_mask(tree.visibility, prefix, indptr, numel))
        tree_mask = mask_out
    else:
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


def verify_walk(
    tree: DraftTree, target_tokens: Tensor, *, use_triton: bool | None = None
) -> WalkResult:
    """Follow each tree from the root while the target agrees with the draft.

    ``target_tokens [b, N]`` is the target's token at every node: its argmax, or at
    temperature > 0 one independent sample per node (then the output keeps the target's
    distribution exactly). A child is accepted when its token equals the target's token at
    its parent and its parent is accepted. Siblings carry distinct tokens, so at most one
    child per node matches and the accepted nodes form one path from the root.
    """
    if _want_triton(tree.parents, use_triton):
        return _triton_verify_walk(tree, target_tokens)
    b, n = tree.parents.shape
    device = tree.parents.device
    target = target_tokens.to(device=device, dtype=torch.int64)
    slots = torch.arange(n, device=device).expand(b, n)
    jump = _self_parents(tree.parents)
    is_node = (tree.parents >= 0) & (slots <= tree.num_nodes.unsqueeze(1))
    drafted = torch.cat([tree.tokens.new_zeros((b, 1)), tree.tokens], 1)
    accepted_mask = ((drafted == target.gather(1, jump)) & is_node) | (slots == 0)
    for _ in range(_jump_steps(tree.depth_limit)):
        accepted_mask = accepted_mask & accepted_mask.gather(1, jump)
        jump = jump.gather(1, jump)

    depth_key = torch.where(accepted_mask, tree.depths, -1)
    last = depth_key.argmax(1, keepdim=True)
    accept_len = tree.depths.gather(1, last).squeeze(1) + 1
    bonus = target.gather(1, last).squeeze(1)
    levels = torch.arange(tree.depth_limit + 1, device=device).view(1, -1, 1)
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
    drafted = torch.cat([tree.tokens.new_zeros((b, 1)), tree.tokens], 1)
    nxt = torch.cat([walk.accepted[:, 1:], walk.accepted.new_full((b, 1), -1)], 1)
    matched = drafted.gather(1, nxt.clamp_min(0))
    k = torch.arange(width, device=walk.accepted.device).expand(b, width)
    last = walk.accept_len.unsqueeze(1) - 1
    out = torch.where(k < last, matched, -1)
    return torch.where(k == last, walk.bonus.unsqueeze(1), out)


def prefix_stats(
    scores: Tensor, path: Tensor | None, budgets: Tensor, arange: Tensor | None = None
) -> Tensor:
    """What every smaller budget's tree would have given, from one tree: per candidate budget
    ``B'`` in ``budgets`` (int64, none above the tree's), summed over the rows, ``[2,
    candidates]``: the value of the budget-``B'`` tree and the drafted tokens it would have
    accepted (the second row zero without ``path``).

    ``scores`` is the tree's ``[b, 1 + N]`` path log-probabilities (root first; padding -inf
    counts 0), ``path`` the ``[b, L]`` node ids (>= 1) of each row's accepted drafted tokens,
    < 1 after; ``arange``, if given, holds at least ``0..N-1`` (saves a launch). The
    best-first tree is a prefix order: the budget-``B'`` tree is the ``B'`` best nodes of
    this one, so its value is the sum of the ``B'`` largest path probabilities, and it would
    have accepted the path's nodes among those ``B'`` (they are a prefix of the path, as the
    nodes are closed under taking parents). Ranks break equal scores by node index."""
    scores = scores[:, 1:]
    order = scores.argsort(dim=1, descending=True, stable=True)
    best = scores.gather(1, order).exp().cumsum(dim=1)
    values = best.index_select(1, budgets - 1).sum(dim=0)
    if path is None:
        return torch.stack([values, torch.zeros_like(values)])
    n = order.shape[1]
    places = (torch.arange(n, device=order.device) if arange is None else arange[:n]).expand_as(
        order
    )
    rank = torch.empty_like(order).scatter_(1, order, places)  # node -> place by score
    path_rank = rank.gather(1, (path - 1).clamp(min=0)).masked_fill(path < 1, n)
    accepted = (path_rank.unsqueeze(-1) < budgets).sum(dim=(0, 1))
    return torch.stack([values, accepted.to(values.dtype)])


def compaction_indices(walk: WalkResult, num_slots: int) -> CompactionIndices:
    """Gather indices that compact the accepted path's KV / hidden rows to the front.

    Use ``window[:, :L+1] = window.gather(src_slots)`` on a ``[b, N, ...]`` verify window, or
    ``hidden[src_rows]`` on flat ``[b * N, H]`` hidden states (the drafter's next context).
    """
    if walk._compaction is not None and walk._compaction[0] == num_slots:
        return walk._compaction[1]  # computed by the fused walk kernel
    b, width = walk.accepted.shape
    device = walk.accepted.device
    k = torch.arange(width, device=device).expand(b, width)
    keep = k < walk.accept_len.unsqueeze(1)
    src_slots = torch.where(keep, walk.accepted, k).clamp_max(num_slots - 1)
    src_rows = torch.arange(b, device=device).unsqueeze(1) * num_slots + src_slots
    return CompactionIndices(src_slots=src_slots, src_rows=src_rows, keep=keep)


# ------------------------------------------------------------------------------ triton
#
# Fused kernels for CUDA tensors. They compute what the PyTorch code above computes (the same
# staircase, the same tie-breaks, the same float32 sums) in five launches per round: two for
# the vocabulary pass, one per request for the whole tree, one per node row for the verify
# inputs, one per request for the walk and its compaction indices. Triton is imported on
# first use only.

# Warps per program = clamp(widest tensor // divisor), which the benchmark's --tune picks;
# and whether the tree kernel computes its floor from chains (the exit, the rank-0 shortcut
# and the compacted final choice need it): on by default, off only to measure what it saves.
# `tree_rise` raises that floor after each sorted depth to the budget-th best of the paths
# seen so far (fewer depths sorted on drafts shaped like a language model's, and a final
# choice that stays compacted; an earlier rule that rose after every built depth cost
# branchy and deep rows more than it saved, docs/performance.md). `tree_narrow` sorts a
# depth BP lanes wide instead of CP when its candidates at or above the floor fit there.
# Both need the floor, and --tune times both settings; on by default since the H200 run
# (docs/performance.md): best or within 1 us of the best setting on every kind of row.
# `pdl` launches every kernel with programmatic dependent launch (Hopper and later), so its
# start overlaps the previous kernel's end: exact, 2-4 % faster in an H100 run of the tree
# benchmark, off until a server has run with it (docs/performance.md). Two other switches
# timed in that run (the log-probs held in registers, a counting sort) were slower on every
# kind of row and were removed. `DDTREE_PDL=1` in a process's environment turns `pdl` on
# from its start (a server, whose copy of this module nobody tunes), read once here.
# `vocab_geom` is the vocabulary pass's block geometry (CH, CPG, GPP): chunks of CH logits,
# groups of CPG chunks, GPP groups per program of the full read (see _vocab_geom); any
# usable geometry gives the same top-K ids, and log-probs that differ at most by the
# rounding of the log-sum-exp's partial sums.
PDL_ENV = "DDTREE_PDL"
_TUNING: dict[str, int | tuple[int, int, int]] = {
    "tree_div": 128,
    "select_div": 512,
    "row_div": 64,
    "tree_exit": 1,
    "tree_rise": 1,
    "tree_narrow": 1,
    "pdl": int(os.environ.get(PDL_ENV) == "1"),
    "vocab_geom": (32, 16, 8),
}


def _warps(widest: int, divisor: int, most: int = 8) -> int:
    return max(1, min(most, widest // divisor))


def _pdl(device: torch.device) -> dict:
    """Launch arguments for programmatic dependent launch (``_TUNING["pdl"]``): each kernel
    may be launched while the previous one on the stream still runs, and waits for it to
    finish before touching memory, so it can only hide launch latency (also between the
    nodes of a CUDA graph), never change a result. NVIDIA GPUs of compute capability 9+
    with a Triton that knows ``launch_pdl``; elsewhere the launches are plain."""
    on = bool(_TUNING["pdl"]) and not _interpreting() and _pdl_capable(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@lru_cache(maxsize=16)
def _pdl_capable(device: torch.device) -> bool:
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _want_triton(x: Tensor, use_triton: bool | None) -> bool:
    # On the CPU only when asked for explicitly under Triton's interpreter (tests).
    if use_triton is False or not (x.is_cuda or (use_triton and _interpreting())):
        return False
    if use_triton is None and os.environ.get("DDTREE_DISABLE_TRITON") == "1":
        return False
    return _triton_importable()


def _interpreting() -> bool:
    """Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs the kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401 - only ever imported for CUDA tensors
    except ImportError:
        return False
    return True


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@lru_cache(maxsize=1)
def _kernels():
    """Define the Triton kernels (once, on first use)."""
    import triton
    import triton.language as tl

    # Kernels resolve names through this module's globals.
    globals()["tl"] = tl

    @triton.jit
    def _tt_pack(x, idx):
        # Order-preserving integer of a float32 in the high bits, the inverted index in the
        # low 31: a larger key is a larger value, equal values put the lower index first.
        u = (x + 0.0).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        ordv = tl.where(u >= 0x80000000, 0xFFFFFFFF - u, u + 0x80000000)
        return (ordv << 31) | (0x7FFFFFFF - idx.to(tl.int64))

    @triton.jit
    def _tt_index(key):
        return 0x7FFFFFFF - (key & 0x7FFFFFFF)

    @triton.jit
    def _tt_value(key):
        ordv = key >> 31
        u = tl.where(ordv >= 0x80000000, ordv - 0x80000000, 0xFFFFFFFF - ordv)
        return u.to(tl.uint32).to(tl.float32, bitcast=True)

    @triton.jit
    def _tt_pdl_start():
        # Programmatic dependent launch: wait until the previous kernel on the stream has
        # finished and its writes are visible (before any load or store, so buffers the
        # caching allocator reused are safe too), then let the next kernel's programs start
        # and wait in their turn. Launched this way the kernels' start-up overlaps the
        # previous kernel's end; without it the instructions do nothing.
        tl.inline_asm_elementwise(
            "griddepcontrol.wait; griddepcontrol.launch_dependents; // $0",
            "=r", [], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    globals().update(
        _tt_pack=_tt_pack, _tt_index=_tt_index, _tt_value=_tt_value, _tt_pdl_start=_tt_pdl_start
    )

    @triton.jit
    def vocab_stats(
        logits, stride, vocab, cmax, n_chunks, gmax, n_groups, pmax, psum, n_prog,
        CH: tl.constexpr, CPG: tl.constexpr, GPP: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # The one full read of the logits: the maximum of every CH-wide chunk and of every
        # group of CPG chunks, and a partial log-sum-exp per program.
        if PDL:
            _tt_pdl_start()
        row = tl.program_id(0)
        p = tl.program_id(1)
        g = p * GPP + tl.arange(0, GPP)
        c = tl.arange(0, CPG)
        offs = (g[:, None, None] * CPG + c[None, :, None]) * CH + tl.arange(0, CH)[None, None, :]
        x = tl.load(
            logits + row.to(tl.int64) * stride + offs, mask=offs < vocab, other=float("-inf")
        )
        x = x.to(tl.float32)
        chunk_max = tl.max(x, 2)
        chunk = g[:, None] * CPG + c[None, :]
        tl.store(cmax + row * n_chunks + chunk, chunk_max, mask=chunk < n_chunks)
        group_max = tl.max(chunk_max, 1)
        tl.store(gmax + row * n_groups + g, group_max, mask=g < n_groups)
        mx = tl.max(group_max, 0)
        safe = tl.where(mx == float("-inf"), 0.0, mx)
        tl.store(pmax + row * n_prog + p, mx)
        tl.store(psum + row * n_prog + p, tl.sum(tl.exp(x - safe)))

    @triton.jit
    def _tt_top_above(keys, tau, scratch, KP: tl.constexpr, CAP: tl.constexpr):
        # The top KP of `keys` (1-D, -1 = none), knowing that at least KP of them have a value
        # >= tau: only those can be in it. They are usually few, so they are compacted into
        # `scratch` and sorted there (CAP wide); when more than CAP pass, sort all of them.
        keep = (keys >= 0) & (_tt_value(keys) >= tau)
        n_keep = tl.sum(keep.to(tl.int32), 0)
        dst = tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(scratch + dst, keys, mask=keep & (dst < CAP))
        tl.debug_barrier()
        slots = tl.arange(0, CAP)
        few = tl.load(scratch + slots, mask=slots < n_keep, other=-1)
        if n_keep > CAP:  # noqa: SIM108 - a branch on the device, not a ternary
            top = tl.topk(keys, KP)
        else:
            top = tl.topk(few, KP)
        return top

    @triton.jit
    def _tt_floor_value(top):
        # The smallest value in a sorted top-KP, -inf when it is not full.
        last = tl.min(top, 0)
        return tl.where(last >= 0, _tt_value(last), float("-inf"))

    globals().update(_tt_top_above=_tt_top_above, _tt_floor_value=_tt_floor_value)

    @triton.jit
    def _tt_select(a, ci, logp, pk, cm, KP: tl.constexpr):
        # A_d from all staircase candidates (i, r), scoring a[i] + logp: the top KP keys and
        # their values. Keys carry the candidate (i << 16) | r itself as their tie-break:
        # ascending, it is the staircase's (parent, rank) order, and the sort needs no table
        # lookup afterwards.
        score = tl.where(cm, tl.gather(a, ci, 0) + logp, float("-inf"))
        top = tl.topk(_tt_pack(score, pk), KP)
        return _tt_value(top), top

    globals().update(_tt_select=_tt_select)

    @triton.jit
    def vocab_select(
        logits, stride, vocab, cmax, n_chunks, gmax, n_groups, pmax, psum, n_prog,
        lp_out, ids_out, k, floor, scratch,
        CH: tl.constexpr, CPG: tl.constexpr, GP: tl.constexpr, KP: tl.constexpr,
        PP: tl.constexpr, CAP: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # Exact top KP of a row in three narrowing steps. The KP blocks with the largest
        # maxima hold KP elements >= the KP-th largest maximum and every element above it, so
        # the top KP of their union has the row's top-KP values. Groups -> chunks -> logits.
        if PDL:
            _tt_pdl_start()
        row = tl.program_id(0)
        pp = tl.arange(0, PP)
        pm = tl.load(pmax + row * n_prog + pp, mask=pp < n_prog, other=float("-inf"))
        ps = tl.load(psum + row * n_prog + pp, mask=pp < n_prog, other=0.0)
        mx = tl.max(pm, 0)
        safe = tl.where(mx == float("-inf"), 0.0, mx)
        lse = safe + tl.log(tl.sum(ps * tl.exp(pm - safe), 0))
        gg = tl.arange(0, GP)
        gv = tl.load(gmax + row * n_groups + gg, mask=gg < n_groups, other=float("-inf"))
        gtop = tl.topk(tl.where(gg < n_groups, _tt_pack(gv, gg), -1), KP)
        g_ok = gtop >= 0
        cc = tl.where(g_ok, _tt_index(gtop), 0)[:, None] * CPG + tl.arange(0, CPG)[None, :]
        c_ok = g_ok[:, None] & (cc < n_chunks)
        cv = tl.load(cmax + row * n_chunks + cc, mask=c_ok, other=float("-inf"))
        ckeys = tl.reshape(tl.where(c_ok, _tt_pack(cv, cc), -1), [KP * CPG])
        scr = scratch + row.to(tl.int64) * (2 * CAP)
        ctop = _tt_top_above(ckeys, _tt_floor_value(gtop), scr, KP, CAP)
        ch_ok = ctop >= 0
        ee = tl.where(ch_ok, _tt_index(ctop), 0)[:, None] * CH + tl.arange(0, CH)[None, :]
        e_ok = ch_ok[:, None] & (ee < vocab)
        x = tl.load(logits + row.to(tl.int64) * stride + ee, mask=e_ok, other=float("-inf"))
        ekeys = tl.reshape(tl.where(e_ok, _tt_pack(x.to(tl.float32), ee), -1), [KP * CH])
        top = _tt_top_above(ekeys, _tt_floor_value(ctop), scr + CAP, KP, CAP)
        kk = tl.arange(0, KP)
        km = kk < k
        lp = tl.maximum(_tt_value(top) - lse, floor)
        tl.store(lp_out + row * k + kk, lp, mask=km)
        tl.store(ids_out + row * k + kk, _tt_index(top), mask=km)

    @triton.jit
    def tree(
        lp, ids, k, cand, n_cand, s_buf, c_buf, scratch,
        tokens, parents, depths, scores, num_nodes, vis,
        n_pos: tl.constexpr, budget: tl.constexpr, BP: tl.constexpr, CP: tl.constexpr,
        LBP: tl.constexpr, LP: tl.constexpr, NP: tl.constexpr, ZB: tl.constexpr,
        D1: tl.constexpr, BOUND: tl.constexpr, RISE: tl.constexpr, NARROW: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            _tt_pdl_start()
        req = tl.program_id(0)
        n: tl.constexpr = budget + 1
        # Zero this request's visibility block first; the stores drain during the selection.
        vis_r = vis + req.to(tl.int64) * (n * n)
        for z0 in range(0, n * n, ZB):
            zz = z0 + tl.arange(0, ZB)
            tl.store(vis_r + zz, tl.zeros([ZB], tl.uint8), mask=zz < n * n)
        lp_r = lp + req * n_pos * k
        ids_r = ids + req * n_pos * k
        s_r = s_buf + req * n_pos * budget
        c_r = c_buf + req * n_pos * budget
        scr = scratch + req.to(tl.int64) * (2 * BP)
        j = tl.arange(0, BP)
        jm = j < budget
        # A_1: the top ranks of position 1, children of the root.
        a = tl.load(lp_r + j, mask=j < k, other=float("-inf"))
        tl.store(s_r + j, a, mask=jm)
        c = tl.arange(0, CP)
        cm = c < n_cand
        pk = tl.load(cand + c, mask=cm, other=0)  # (parent position << 16) | rank
        ci = pk >> 16
        cr = pk & 0xFFFF
        logp = tl.load(lp_r + D1 * k + cr, mask=cm, other=float("-inf"))
        if BOUND:
            # A floor under the final tree's scores, from chains: root child j followed by
            # rank 0 at each later position. The chains of root children 0..j cut at depths
            # 1..h are (j + 1) * h distinct paths scoring at least chain j at depth h (ranks
            # and rank-0 steps are sorted, and adding a log-prob <= 0 never raises a float32
            # sum), so with h = ceil(budget / (j + 1)) the tree's lowest score is at least
            # that chain's: the bound is the best such chain over j. It is summed in the
            # order the selection sums (parent + log-prob), so it is the same float32 number.
            # Nothing below it can enter the tree. The best candidate at each depth (best
            # parent + rank 0) falls with depth too: the depths whose best is below the
            # bound, and all deeper ones, are left empty instead of sorted.
            h = (budget + j) // (j + 1)
            chain = tl.where(h == 1, a, float("-inf"))
            lv = tl.arange(0, LP)
            best = tl.load(lp_r)
            bests = tl.full([LP], float("-inf"), tl.float32)
            chain_v = a
            for d in tl.static_range(1, n_pos):
                y0 = tl.load(lp_r + d * k)
                chain_v = chain_v + y0
                chain = tl.where(h == d + 1, chain_v, chain)
                best = best + y0
                bests = tl.where(lv == d, best, bests)
            bound = tl.max(tl.where(jm, chain, float("-inf")), 0)
            live = (lv >= 1) & (lv < n_pos) & (bests >= bound)
            d_end = 1 + tl.sum(live.to(tl.int32), 0)
        else:
            bound = float("-inf")
            d_end = n_pos
        # Parent 0 of each depth is the best node of the depth above (the rank-0 chain), and
        # y0 / y1 are the position's two best log-probs, fetched a depth ahead.
        s0 = tl.load(lp_r)
        y0 = tl.load(lp_r + D1 * k)
        y1 = tl.load(lp_r + D1 * k + 1, mask=k > 1, other=float("-inf"))
        if NARROW:
            # Position d's log-probs by rank (the narrow selection's columns), a depth ahead.
            row = tl.load(lp_r + D1 * k + j, mask=j < k, other=float("-inf"))
        if RISE:
            # Scores of distinct paths seen so far (A_1, then each sorted depth's A_d),
            # descending: its first `budget` lanes are the best `budget` of them.
            run = a
            rev = BP - 1 - j
        for d in range(1, d_end):
            # Prefetch the next depth's log-probs: they do not depend on this depth's result.
            dn = tl.minimum(d + 1, n_pos - 1)
            nxt = tl.load(lp_r + dn * k + cr, mask=cm, other=float("-inf"))
            y0n = tl.load(lp_r + dn * k)
            y1n = tl.load(lp_r + dn * k + 1, mask=k > 1, other=float("-inf"))
            if NARROW:
                row_n = tl.load(lp_r + dn * k + j, mask=j < k, other=float("-inf"))
            if s0 + y1 < bound:
                # Not even the best parent's second child reaches the bound: only rank-0
                # children can enter the tree, and they keep their parents' order (the
                # candidate order breaks their ties the same way), so A_d is A_{d-1} + y0
                # with no sort; children below the bound are left empty. (Rank-0 children
                # the staircase leaves out, (i + 1) * 2 > budget, follow 2 (i + 1) - 1 better
                # nodes in the tie order, so the final choice never takes them.)
                a = tl.where(a + y0 >= bound, a + y0, float("-inf"))
                tl.store(s_r + d * budget + j, a, mask=jm)
                tl.store(c_r + d * budget + j, j << 16, mask=jm)
            else:
                if NARROW:
                    # Only candidates at or above the bound ("kept") can matter: an entry of
                    # A_d below it can never enter the tree, nor can its descendants (a
                    # child scores at most its parent), so A_d may hold -inf there, as the
                    # rank-0 shortcut already does (the final choice and the floor use only
                    # entries at or above it). The kept ones are a prefix of A_d in its
                    # order, so sorting only them gives the same prefix. `a` and each
                    # position's log-probs are sorted, so if (i, r) is kept, (i, 0) and
                    # (0, r) are too (both in the staircase, both scoring at least as much):
                    # every kept candidate lies in the rectangle of the n_par parents with a
                    # kept rank-0 child by the n_rank ranks kept under the best parent (s0,
                    # the best score of depth d - 1, at least a[0]). When that rectangle fits
                    # in BP lanes, it is laid out row by row, its cells outside the staircase
                    # or below the bound masked, and sorted BP wide instead of CP, with the
                    # same keys (ties by (i << 16) | r, the staircase's order).
                    kept = tl.where((j < budget // 2) & (a + y0 >= bound), 1, 0)
                    kept += tl.where((j < k) & (j < budget - 1) & (s0 + row >= bound), 1 << 16, 0)
                    kept = tl.sum(kept, 0)
                    n_par = kept & 0xFFFF
                    n_rank = kept >> 16
                    if n_par * n_rank <= BP:
                        w = tl.maximum(n_rank, 1)
                        gi = j // w  # < BP: the gathers stay in range
                        gr = j - gi * w
                        g_score = tl.gather(a, gi, 0) + tl.gather(row, gr, 0)
                        g_ok = (j < n_par * n_rank) & ((gi + 1) * (gr + 2) <= budget) & (gr < k)
                        g_ok = g_ok & (g_score >= bound)
                        top = tl.topk(tl.where(g_ok, _tt_pack(g_score, (gi << 16) | gr), -1), BP)
                        a = tl.where(top >= 0, _tt_value(top), float("-inf"))
                    else:
                        a, top = _tt_select(a, ci, logp, pk, cm, BP)
                else:
                    a, top = _tt_select(a, ci, logp, pk, cm, BP)
                tl.store(s_r + d * budget + j, a, mask=jm)
                tl.store(c_r + d * budget + j, _tt_index(top).to(tl.int32), mask=jm)
                if RISE:
                    # The floor rises: `run` and A_d are distinct paths, so the budget-th
                    # best of their union is at most the tree's lowest score. Of two
                    # descending lists X and Y, max(X[i], Y[BP - 1 - i]) is the top BP of
                    # their union, in bitonic order: one merge sorts it. Only after sorted
                    # depths (a rank-0 shortcut depth costs nothing extra). The floor only
                    # ever rises, so the entries A_d holds as -inf (below an earlier floor)
                    # change no floor: they are below it. A depth whose best is below the
                    # risen floor takes the rank-0 shortcut and comes out empty, as do
                    # deeper ones.
                    a_rev = tl.gather(tl.where(jm, a, float("-inf")), rev, 0)
                    run = tl.bitonic_merge(tl.maximum(run, a_rev), descending=True)
                    run_kth = tl.min(tl.where(jm, run, float("inf")), 0)
                    bound = tl.maximum(bound, run_kth)
            s0 = s0 + y0
            y0 = y0n
            y1 = y1n
            logp = nxt
            if NARROW:
                row = row_n
        tl.debug_barrier()
        # The global top `budget` over all depths, ties by (depth, position).
        f = tl.arange(0, LBP)
        fm = f < d_end * budget  # depths past d_end were never written: empty
        all_s = tl.load(s_r + f, mask=fm, other=float("-inf"))
        # Only entries at or above the bound can be chosen: usually about `budget` of them.
        keys = tl.where(all_s > float("-inf"), _tt_pack(all_s, f), -1)
        top = _tt_top_above(keys, bound, scr, BP, 2 * BP)
        val = tl.where(top >= 0, _tt_value(top), float("-inf"))
        flat = tl.where(jm & (top >= 0), _tt_index(top), 0)
        valid = jm & (val > float("-inf"))
        dd = flat // budget
        pos = flat - dd * budget
        lvl = tl.arange(0, LP)
        onehot = dd[:, None] == lvl[None, :]
        counts = tl.sum((onehot & valid[:, None]).to(tl.int32), 0)
        starts = tl.cumsum(counts, 0) - counts
        start_d = tl.sum(tl.where(onehot, starts[None, :], 0), 1)
        start_pd = tl.sum(tl.where(dd[:, None] - 1 == lvl[None, :], starts[None, :], 0), 1)
        n_nodes = tl.sum(valid.to(tl.int32), 0)
        pk_f = tl.load(c_r + flat, mask=valid & (dd > 0), other=0)
        rank = tl.where(dd == 0, pos, pk_f & 0xFFFF)
        tok = tl.load(ids_r + dd * k + rank, mask=valid, other=0)
        # Valid lanes come first (sorted), so valid slots 1..n and padding slots n+1..B
        # are disjoint: every slot is written exactly once.
        slot = tl.where(valid, 1 + start_d + pos, j + 1)
        parent = tl.where(dd == 0, 0, 1 + start_pd + (pk_f >> 16))
        tl.store(tokens + req * budget + slot - 1, tl.where(valid, tok, 0), mask=jm)
        tl.store(parents + req * n + slot, tl.where(valid, parent, -1).to(tl.int64), mask=jm)
        tl.store(depths + req * n + slot, tl.where(valid, dd + 1, 0).to(tl.int64), mask=jm)
        tl.store(scores + req * n + slot, tl.where(valid, val, float("-inf")), mask=jm)
        tl.store(parents + req * n, -1)
        tl.store(depths + req * n, 0)
        tl.store(scores + req * n, 0.0)
        tl.store(num_nodes + req, n_nodes.to(tl.int64))
        tl.debug_barrier()
        # Visibility: one store per (node, ancestor) into the zeroed block, walking every
        # node's parent chain at once (root and padding point at themselves).
        cols = tl.arange(0, NP)
        colm = cols < n
        par = tl.load(parents + req * n + cols, mask=colm, other=-1)
        up = tl.where(par >= 0, par, cols).to(tl.int32)
        row_ptr = vis_r + cols * n
        ones = tl.full([NP], 1, tl.uint8)
        tl.store(row_ptr + cols, ones, mask=colm)
        anc = up
        for _ in range(d_end):  # no node is deeper than d_end
            tl.store(row_ptr + anc, ones, mask=colm)
            anc = tl.gather(up, anc, 0)

    # `numel` (the mask's size) follows the prefix lengths. Specialised on its divisibility
    # by 16, as Triton does an integer argument by default, a round whose lengths change
    # that compiles a second variant mid-serving, which the start-up warm-up (one set of
    # lengths) does not cover: at width 16 numel is always a multiple of 16, at 33 and 65
    # only for some lengths, and the H200 run's first-use stalls in the build (300-470 ms)
    # came at widths 33 and 65 only. One variant serves every length.
    @triton.jit(do_not_specialize=["numel"])
    def verify(
        parents, depths, tokens, num_nodes, vis, roots, prefix, batch, n, numel,
        input_ids, positions, mask, indptr, next_token, next_sibling, retrieve_index,
        NP: tl.constexpr, BBP: tl.constexpr, MB: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            _tt_pdl_start()
        req = tl.program_id(0)
        q = tl.program_id(1)
        cols = tl.arange(0, NP)
        colm = cols < n
        par = tl.load(parents + req * n + cols, mask=colm, other=-1)
        nn = tl.load(num_nodes + req)
        p_q = tl.load(parents + req * n + q)
        real = (cols >= 1) & (cols <= nn)
        big = NP + 1
        child = tl.min(tl.where((par == q) & real, cols, big), 0)
        sib_ok = (par == p_q) & (p_q >= 0) & (cols > q) & real
        sib = tl.min(tl.where(sib_ok, cols, big), 0)
        out = req * n + q
        tl.store(next_token + out, tl.where(child == big, -1, child).to(tl.int64))
        tl.store(next_sibling + out, tl.where(sib == big, -1, sib).to(tl.int64))
        tl.store(retrieve_index + out, out.to(tl.int64))
        rr = tl.arange(0, BBP)
        all_p = tl.load(prefix + rr, mask=rr < batch, other=0)
        plen = tl.sum(tl.where(rr == req, all_p, 0), 0)
        tok = tl.load(tokens + req * (n - 1) + q - 1, mask=q > 0, other=0)
        tok = tl.where(q == 0, tl.load(roots + req), tok)
        tl.store(input_ids + out, tok)
        tl.store(positions + out, plen + tl.load(depths + out))
        start = tl.sum(tl.where(rr < req, n * (all_p + n), 0), 0)
        if q == 0:
            tl.store(indptr + req + 1, start + n * (plen + n))
            if req == 0:
                tl.store(indptr, start * 0)
        row_start = start + q * (plen + n)
        ones = tl.full([MB], 1, tl.uint8)
        for c0 in range(0, plen, MB):
            cc = c0 + tl.arange(0, MB)
            tl.store(mask + row_start + cc, ones, mask=cc < plen)
        v = tl.load(vis + out * n + cols, mask=colm, other=0)
        tl.store(mask + row_start + plen + cols, v, mask=colm)
        # Entries past the real size (a larger static buffer) are False: every program
        # clears its share of that tail, so no memset is needed.
        total = tl.sum(tl.where(rr < batch, n * (all_p + n), 0), 0)
        zeros = tl.zeros([MB], tl.uint8)
        for z0 in range(total + out * MB, numel, batch * n * MB):
            zz = z0 + tl.arange(0, MB)
            tl.store(mask + zz, zeros, mask=zz < numel)

    @triton.jit
    def walk(
        parents, depths, tokens, num_nodes, target, n,
        accepted, accept_len, bonus, src_slots, src_rows, keep,
        n_pos: tl.constexpr, NP: tl.constexpr, LP1: tl.constexpr, STEPS: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            _tt_pdl_start()
        req = tl.program_id(0)
        cols = tl.arange(0, NP)
        colm = cols < n
        par = tl.load(parents + req * n + cols, mask=colm, other=-1)
        dep = tl.load(depths + req * n + cols, mask=colm, other=0)
        tok = tl.load(tokens + req * (n - 1) + cols - 1, mask=colm & (cols >= 1), other=0)
        nn = tl.load(num_nodes + req)
        at_parent = tl.load(target + req * n + par, mask=par >= 0, other=-1)
        match = ((tok == at_parent) & (par >= 0) & (cols <= nn)) | (cols == 0)
        jump = tl.where(par >= 0, par, cols).to(tl.int32)
        acc = match.to(tl.int32)
        # Pointer jumping: after round t a node holds the AND over itself and its 2**t - 1
        # nearest ancestors.
        for _ in range(STEPS):
            acc = acc & tl.gather(acc, jump, 0)
            jump = tl.gather(jump, jump, 0)
        acc = acc != 0
        key = tl.where(acc & colm, dep, -1)
        best = tl.max(key, 0)
        big = NP + 1
        last = tl.min(tl.where(key == best, cols, big), 0)
        tl.store(accept_len + req, (best + 1).to(tl.int64))
        tl.store(bonus + req, tl.load(target + req * n + last))
        lv = tl.arange(0, LP1)
        lvm = lv < n_pos + 1
        hit = (dep[None, :] == lv[:, None]) & acc[None, :] & colm[None, :]
        node = tl.min(tl.where(hit, cols[None, :], big), 1)
        node = tl.where(node == big, -1, node).to(tl.int64)
        out = req * (n_pos + 1) + lv
        tl.store(accepted + out, node, mask=lvm)
        kept = lv <= best
        src = tl.where(kept, node, tl.minimum(lv, n - 1)).to(tl.int64)
        tl.store(src_slots + out, src, mask=lvm)
        tl.store(src_rows + out, req * n + src, mask=lvm)
        tl.store(keep + out, kept.to(tl.uint8), mask=lvm)

    return {
        "vocab_stats": vocab_stats,
        "vocab_select": vocab_select,
        "tree": tree,
        "verify": verify,
        "walk": walk,
    }


# Triton's limit on the elements of one block (triton._utils.TRITON_MAX_TENSOR_NUMEL).
_MAX_BLOCK = 1 << 20


def _vocab_geom() -> tuple[int, int, int]:
    """The vocabulary pass's block sizes ``(CH, CPG, GPP)``, ``_TUNING["vocab_geom"]``,
    checked (about 2 µs, as much as one of the round's buffers; a CUDA graph holds neither):
    chunks of ``CH`` logits, groups of ``CPG`` chunks, ``GPP`` groups per program of the full
    read. A ValueError unless the kernels can use them: each a power of two (Triton's block
    sizes), ``CH`` and ``CPG`` at least 2 (a narrowing step over blocks of one element is the
    next step's work), one program of the full read, ``CH * CPG * GPP`` logits, within a
    Triton block. The top-K is exact under any of them: a chunk or group with a lower index
    holds lower vocabulary ids, so the tie order of the block maxima is the logits' own."""
    geom = _TUNING["vocab_geom"]
    if not (
        isinstance(geom, (tuple, list))
        and len(geom) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) for v in geom)
    ):
        raise ValueError(f"vocab_geom must be three ints (CH, CPG, GPP), got {geom!r}")
    ch, cpg, gpp = geom
    for name, value, least in (("CH", ch, 2), ("CPG", cpg, 2), ("GPP", gpp, 1)):
        if value < least or value & (value - 1):
            raise ValueError(
                f"vocab_geom {tuple(geom)}: {name} must be a power of two >= {least}, got {value}"
            )
    if ch * cpg * gpp > _MAX_BLOCK:
        raise ValueError(
            f"vocab_geom {tuple(geom)}: CH * CPG * GPP = {ch * cpg * gpp} logits per program,"
            f" more than a Triton block holds ({_MAX_BLOCK})"
        )
    return ch, cpg, gpp


def _triton_topk_logprobs(draft_logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """:func:`topk_logprobs` in two launches: one read of the logits for the chunk and group
    maxima and the partial log-sum-exps, then per row the exact top K through the groups and
    chunks with the largest maxima."""
    b, n_pos, vocab = draft_logits.shape
    k = min(k, vocab)
    x = draft_logits.reshape(b * n_pos, vocab)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = b * n_pos
    kp = max(2, _pow2(k))  # tl.topk needs k >= 2
    ch, cpg, gpp = _vocab_geom()
    if kp * max(ch, cpg) > _MAX_BLOCK:  # the selection's candidate chunks or logits
        raise ValueError(f"k={k} too large for vocab_geom {(ch, cpg, gpp)} (Triton's block)")
    n_chunks = -(-vocab // ch)
    n_groups = -(-n_chunks // cpg)
    n_prog = -(-n_groups // gpp)
    dev = x.device
    cmax = torch.empty((rows, n_chunks), dtype=torch.float32, device=dev)
    gmax = torch.empty((rows, n_groups), dtype=torch.float32, device=dev)
    pmax = torch.empty((rows, n_prog), dtype=torch.float32, device=dev)
    psum = torch.empty((rows, n_prog), dtype=torch.float32, device=dev)
    lp = torch.empty((b, n_pos, k), dtype=torch.float32, device=dev)
    ids = torch.empty((b, n_pos, k), dtype=torch.int64, device=dev)
    scratch = torch.empty((rows, 4 * kp), dtype=torch.int64, device=dev)
    kern = _kernels()
    kern["vocab_stats"][(rows, n_prog)](
        x, x.stride(0), vocab, cmax, n_chunks, gmax, n_groups, pmax, psum, n_prog,
        CH=ch, CPG=cpg, GPP=gpp, num_warps=8, **_pdl(dev),
    )  # fmt: skip
    warps = _warps(kp * max(ch, cpg), _TUNING["select_div"])
    kern["vocab_select"][(rows,)](
        x, x.stride(0), vocab, cmax, n_chunks, gmax, n_groups, pmax, psum, n_prog,
        lp, ids, k, LOGPROB_FLOOR, scratch,
        CH=ch, CPG=cpg, GP=max(_pow2(n_groups), kp), KP=kp, PP=_pow2(n_prog), CAP=2 * kp,
        num_warps=warps, **_pdl(dev),
    )  # fmt: skip
    return lp, ids


@lru_cache(maxsize=64)
def _staircase_packed(budget: int, k: int, device: torch.device) -> tuple[Tensor, int]:
    """:func:`_staircase` as one int32 table, ``(parent position << 16) | rank``."""
    cand_i, cand_r, real = _staircase(budget, k, torch.device("cpu"))
    packed = (cand_i << 16) | cand_r
    return packed.to(torch.int32).to(device), real


def _triton_tree_from_topk(lp: Tensor, ids: Tensor, budget: int) -> DraftTree:
    """The selection, flattening and visibility of every request in one launch."""
    if budget >= 1 << 15:
        raise ValueError(f"budget {budget} too large for the Triton path (< 32768)")
    b, n_pos, k = lp.shape
    dev = lp.device
    n = budget + 1
    cand, n_cand = _staircase_packed(budget, k, dev)
    lp = lp.contiguous()
    ids = ids.contiguous()
    s_buf = torch.empty((b, n_pos, budget), dtype=torch.float32, device=dev)
    c_buf = torch.empty((b, n_pos, budget), dtype=torch.int32, device=dev)
    tokens = torch.empty((b, budget), dtype=torch.int64, device=dev)
    parents = torch.empty((b, n), dtype=torch.int64, device=dev)
    depths = torch.empty((b, n), dtype=torch.int64, device=dev)
    scores = torch.empty((b, n), dtype=torch.float32, device=dev)
    num_nodes = torch.empty((b,), dtype=torch.int64, device=dev)
    vis = torch.empty((b, n, n), dtype=torch.bool, device=dev)
    bp = max(2, _pow2(budget))  # tl.topk needs k >= 2
    cp = max(bp, _pow2(cand.numel()))
    lbp = max(bp, _pow2(n_pos * budget))
    scratch = torch.empty((b, 2 * bp), dtype=torch.int64, device=dev)
    # One request is one latency-bound program: few warps keep the sorts inside a warp.
    warps = _warps(max(cp, lbp), _TUNING["tree_div"])
    _kernels()["tree"][(b,)](
        lp, ids, k, cand, n_cand, s_buf, c_buf, scratch,
        tokens, parents, depths, scores, num_nodes, vis.view(torch.uint8),
        n_pos=n_pos, budget=budget, BP=bp, CP=cp, LBP=lbp, LP=_pow2(n_pos),
        NP=_pow2(n), ZB=1024, D1=min(1, n_pos - 1), BOUND=bool(_TUNING["tree_exit"]),
        RISE=bool(_TUNING["tree_exit"] and _TUNING["tree_rise"]),
        NARROW=bool(_TUNING["tree_exit"] and _TUNING["tree_narrow"]),
        num_warps=warps,
        **_pdl(dev),
    )  # fmt: skip
    return DraftTree(tokens, parents, depths, vis, num_nodes, scores, n_pos)


def _triton_build_tree(draft_logits: Tensor, budget: int) -> DraftTree:
    if budget == 0 or draft_logits.shape[1] == 0:
        return _empty_tree(
            draft_logits.shape[0], budget, draft_logits.shape[1], draft_logits.device
        )
    lp, ids = _triton_topk_logprobs(draft_logits, budget)
    return _triton_tree_from_topk(lp, ids, budget)


def _dense(*tensors: Tensor) -> list[Tensor]:
    """The kernels index rows by shape: trees made elsewhere may hold strided views."""
    return [t.to(torch.int64).contiguous() for t in tensors]


def _row_warps(n: int) -> int:
    return _warps(_pow2(n), _TUNING["row_div"], most=4)


def _triton_verify_inputs(
    tree: DraftTree,
    root_tokens: Tensor,
    prefix_lens: Tensor,
    mask_numel: int,
    mask_out: Tensor | None = None,
) -> VerifyInputs:
    b, n = tree.parents.shape
    dev = tree.parents.device
    roots = root_tokens.to(device=dev, dtype=torch.int64).contiguous()
    prefix = prefix_lens.to(device=dev, dtype=torch.int64).contiguous()
    shape = (b, n)
    out = {
        name: torch.empty(shape, dtype=torch.int64, device=dev)
        for name in ("input_ids", "positions", "next_token", "next_sibling", "retrieve_index")
    }
    # The kernel clears entries from the real size up to mask_numel (0: none).
    mask = (
        torch.empty((mask_numel,), dtype=torch.bool, device=dev) if mask_out is None else mask_out
    )
    indptr = torch.empty((b + 1,), dtype=torch.int64, device=dev)
    _kernels()["verify"][(b, n)](
        *_dense(tree.parents, tree.depths, tree.tokens, tree.num_nodes),
        tree.visibility.contiguous().view(torch.uint8),
        roots, prefix, b, n, mask_numel, out["input_ids"], out["positions"],
        mask.view(torch.uint8), indptr,
        out["next_token"], out["next_sibling"], out["retrieve_index"],
        NP=_pow2(n), BBP=max(128, _pow2(b + 1)), MB=1024, num_warps=_row_warps(n),
        **_pdl(dev),
    )  # fmt: skip
    return VerifyInputs(
        input_ids=out["input_ids"],
        positions=out["positions"],
        tree_mask=mask,
        mask_indptr=indptr,
        retrieve_index=out["retrieve_index"],
        retrieve_next_token=out["next_token"],
        retrieve_next_sibling=out["next_sibling"],
    )


def _triton_verify_walk(tree: DraftTree, target_tokens: Tensor) -> WalkResult:
    b, n = tree.parents.shape
    dev = tree.parents.device
    target = target_tokens.to(device=dev, dtype=torch.int64).contiguous()
    width = tree.depth_limit + 1
    accepted = torch.empty((b, width), dtype=torch.int64, device=dev)
    accept_len = torch.empty((b,), dtype=torch.int64, device=dev)
    bonus = torch.empty((b,), dtype=torch.int64, device=dev)
    src_slots = torch.empty((b, width), dtype=torch.int64, device=dev)
    src_rows = torch.empty((b, width), dtype=torch.int64, device=dev)
    keep = torch.empty((b, width), dtype=torch.bool, device=dev)
    _kernels()["walk"][(b,)](
        *_dense(tree.parents, tree.depths, tree.tokens, tree.num_nodes), target, n,
        accepted, accept_len, bonus, src_slots, src_rows, keep.view(torch.uint8),
        n_pos=tree.depth_limit, NP=_pow2(n), LP1=_pow2(width),
        STEPS=_jump_steps(tree.depth_limit), num_warps=_row_warps(n), **_pdl(dev),
    )  # fmt: skip
    comp = CompactionIndices(src_slots=src_slots, src_rows=src_rows, keep=keep)
    return WalkResult(accepted, accept_len, bonus, _compaction=(n, comp))
