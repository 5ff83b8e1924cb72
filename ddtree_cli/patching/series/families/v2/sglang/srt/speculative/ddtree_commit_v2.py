"""What a DDTREE v2 round commits, from the tree walk, in one launch.

After ``ddtree_tree.verify_walk`` (the accepted path, its length, the bonus token and the
rows that compact the path to the front of the verify window), the round hands the scheduler
the tokens it emits, the committed lengths and the new sequence lengths, and moves the
accepted nodes' KV to the front of each request's verify window. Written with PyTorch that is
about ten small launches plus SGLang's ``move_accept_tokens_to_target_kvcache`` (two
zero-fills, two additions and three Triton launches) on a path where the spec-v2 round is
bound by the host's launches on a small target (docs/validation.md, the seventeenth and
eighteenth GPU runs). ``commit_round`` computes all of it, the KV moves' source and target
slots included, in one Triton launch on a GPU; the worker then hands the moves to the KV
pool's own ``move_kv_cache`` (one launch).

The KV moves are SGLang's own (0.5.23's reading, which earlier releases agree with): the
targets are the first ``accept_len`` slots of each request's verify window
(``batch.out_cache_loc``), the sources the window's slots of the accepted nodes, in path
order. A move's source slot is never before its target (the path's slots increase with the
depth), so the pool's copy kernel, which reads every source of a launch before it writes,
and its chunks in order leave the right KV. Rows past ``accept_len`` move slot 0 (the pool's
padding slot) onto itself, as SGLang's zero-filled tails do.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from sglang.srt.speculative import ddtree_tree

# The v2 worker's switch for ``window_kv_move`` (on unless off; ``check``: ``checked_kv_move``).
WINDOW_MOVE_ENV = "SGLANG_DDTREE_WINDOW_KV_MOVE"
WINDOW_MOVE_CHECK = "check"


@dataclass
class RoundCommit:
    """A round's outcome, ``W`` = the walk's width (the draft block: the tree is at most
    ``block_size - 1`` deep).

    Attributes:
        out_tokens: int64 ``[b, W]``: the target's token at every accepted node (the matched
            drafts, then the bonus), 0 after ``accept_len``.
        num_correct: int32 ``[b]``, matched drafts (``accept_len - 1``).
        commit_lens: int32 ``[b]``, tokens committed (``accept_len``).
        new_seq_lens: ``[b]``, ``prefix_lens + accept_len`` in ``prefix_lens``' dtype.
        kv_targets: int64 ``[b * W]``, the KV slots the accepted path moves to (0 after it).
        kv_sources: int64 ``[b * W]``, the slots it moves from (0 after it).
        hidden_rows: int64 ``[b, W]``, the verify's flat rows (``request * N + slot``) that
            feed the draft KV: the accepted path first, the window's own rows after it
            (``ddtree_tree.compaction_indices``).
    """

    out_tokens: torch.Tensor
    num_correct: torch.Tensor
    commit_lens: torch.Tensor
    new_seq_lens: torch.Tensor
    kv_targets: torch.Tensor
    kv_sources: torch.Tensor
    hidden_rows: torch.Tensor


def commit_round(
    walk: ddtree_tree.WalkResult,
    target: torch.Tensor,
    prefix_lens: torch.Tensor,
    window_locs: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> RoundCommit:
    """The round's commit from ``walk`` (``ddtree_tree.verify_walk`` over ``target``, the
    target's int64 token per node ``[b, N]``), the committed ``prefix_lens [b]`` and the
    verify window's KV slots ``window_locs [b * N]``. ``use_triton``: None (on CUDA
    tensors), True (also on the CPU under Triton's interpreter: tests) or False, as for
    ``ddtree_tree``'s kernels."""
    b, n = target.shape
    comp = ddtree_tree.compaction_indices(walk, n)
    width = comp.src_slots.shape[1]
    if ddtree_tree._want_triton(target, use_triton):
        return _triton_commit(walk, comp, target, prefix_lens, window_locs, b, n, width)
    keep = comp.keep
    locs = window_locs.view(b, n)
    commit_lens = walk.accept_len.to(torch.int32)
    return RoundCommit(
        out_tokens=torch.where(keep, target.gather(1, comp.src_slots), 0),
        num_correct=commit_lens - 1,
        commit_lens=commit_lens,
        new_seq_lens=prefix_lens + walk.accept_len.to(prefix_lens.dtype),
        kv_targets=torch.where(keep, locs[:, :width], 0).reshape(-1),
        kv_sources=torch.where(keep, locs.gather(1, comp.src_slots), 0).reshape(-1),
        hidden_rows=comp.src_rows,
    )


def accept_round(tree, target: torch.Tensor, prefix_lens: torch.Tensor, locs: torch.Tensor,
                 move) -> tuple:  # fmt: skip
    """A v2 round's accept: the walk (``ddtree_tree.verify_walk``), ``commit_round`` and
    ``move(kv_targets, kv_sources, commit_lens)`` (``pool_move``: the KV pool's
    ``move_kv_cache``, or ``window_kv_move``). Returns the matched drafts, committed lengths,
    bonus tokens, emitted tokens, new sequence lengths and hidden rows (``[b, W]``), each
    with the batch first (what the step graphs cut to a batch)."""
    walk = ddtree_tree.verify_walk(tree, target)
    commit = commit_round(walk, target, prefix_lens, locs)
    move(commit.kv_targets, commit.kv_sources, commit.commit_lens)
    return (
        commit.num_correct,
        commit.commit_lens,
        walk.bonus,
        commit.out_tokens,
        commit.new_seq_lens,
        commit.hidden_rows,
    )


def _triton_commit(walk, comp, target, prefix_lens, window_locs, b, n, width) -> RoundCommit:
    dev = target.device
    out = RoundCommit(
        out_tokens=torch.empty((b, width), dtype=torch.int64, device=dev),
        num_correct=torch.empty((b,), dtype=torch.int32, device=dev),
        commit_lens=torch.empty((b,), dtype=torch.int32, device=dev),
        new_seq_lens=torch.empty_like(prefix_lens),
        kv_targets=torch.empty((b * width,), dtype=torch.int64, device=dev),
        kv_sources=torch.empty((b * width,), dtype=torch.int64, device=dev),
        hidden_rows=comp.src_rows,
    )
    _kernel()[(b,)](
        walk.accept_len, comp.src_slots, target, prefix_lens, window_locs, n, width,
        out.out_tokens, out.num_correct, out.commit_lens, out.new_seq_lens,
        out.kv_targets, out.kv_sources, WP=ddtree_tree._pow2(width),
    )  # fmt: skip
    return out


@lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def commit(
        accept_len, src_slots, target, prefix_lens, window_locs, n, width,
        out_tokens, num_correct, commit_lens, new_seq_lens, kv_targets, kv_sources,
        WP: tl.constexpr,
    ):  # fmt: skip
        req = tl.program_id(0)
        k = tl.arange(0, WP)
        inside = k < width
        alen = tl.load(accept_len + req)
        keep = inside & (k < alen)
        slot = tl.load(src_slots + req * width + k, mask=inside, other=0)
        tok = tl.load(target + req * n + slot, mask=keep, other=0)
        at = req * width + k
        tl.store(out_tokens + at, tok, mask=inside)
        tgt = tl.load(window_locs + req * n + k, mask=keep, other=0)
        src = tl.load(window_locs + req * n + slot, mask=keep, other=0)
        tl.store(kv_targets + at, tgt.to(tl.int64), mask=inside)
        tl.store(kv_sources + at, src.to(tl.int64), mask=inside)
        tl.store(num_correct + req, (alen - 1).to(tl.int32))
        tl.store(commit_lens + req, alen.to(tl.int32))
        prefix = tl.load(prefix_lens + req)
        tl.store(new_seq_lens + req, prefix + alen.to(prefix.dtype))

    return commit


def pool_move(pool):
    """``move(targets, sources, commit_lens)`` through the pool's own ``move_kv_cache``: every
    row of the window is copied, the rows past ``commit_lens`` slot 0 onto itself."""
    return lambda targets, sources, commit_lens: pool.move_kv_cache(targets, sources)


def window_kv_move(pool):
    """``move(targets, sources, commit_lens)`` for ``pool``'s slot rows in one launch that
    copies only what moves, or None where ``pool`` does not keep its KV as the plain
    ``MHATokenToKVPool``'s unquantised slot rows (then ``pool_move``).

    The pool's ``move_kv_cache`` copies all ``b * width`` rows of a round (its tiled kernel
    holds every row of a chunk for one layer in one program, so that all sources are read
    before any target is written): with a batch of 32 and 16 slots per window that is 512
    rows, most of them slot 0 onto itself, in two launches that took about 1 ms each on an
    H100 (the 8B-cost target, 72 K and V buffers; docs/performance.md). Here one program per
    (request, buffer, byte tile) copies that request's first ``commit_lens`` rows whose
    source is not their target, all reads before a barrier and the writes after it. Moves
    never cross requests (each reads and writes its own verify window), so that is the
    same in-place safety. ``targets`` / ``sources`` are ``[b * W]`` as ``commit_round`` lays
    them out."""
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache import memory_pool

    base = getattr(memory_pool, "MHATokenToKVPool", None)
    cls = type(pool)
    # The native move as the pool reads it: its attribute (0.5.16 on), else the switch
    # itself (0.5.14, 0.5.15 read it at every move).
    native = getattr(pool, "use_native_move_kv_cache", None)
    if (
        base is None
        or cls.move_kv_cache is not base.move_kv_cache
        or getattr(cls, "_move_kv_cache_impl", None) is not getattr(base, "_move_kv_cache_impl", None)
        # No tiled copy configured (every v2 release leaves it None for an HND layout and
        # for a pool without layers): not slot rows this kernel can copy.
        or getattr(pool, "_kv_copy_config", None) is None
        or (envs.SGLANG_NATIVE_MOVE_KV_CACHE.get() if native is None else native)
        # quantised KV: the pool's move carries its scales too (0.5.21 on: FP4 scales)
        or getattr(pool, "k_scale_buffer", None) is not None
        or getattr(pool, "native_k_scale_buffer", None) is not None
    ):
        return None
    ptrs, strides = pool.data_ptrs, pool.data_strides
    buffers = int(ptrs.numel())
    tiles = -(-int(strides.max()) // _MOVE_TILE)
    # Rows of whole 8-byte words (every usual KV row) are copied a word at a time; the
    # buffers themselves come from PyTorch's allocator, aligned far beyond that.
    unit = 8 if bool((strides % 8 == 0).all()) else 1
    kernel = _move_kernel()

    def move(targets, sources, commit_lens):
        b = int(commit_lens.shape[0])
        width = int(targets.numel()) // max(b, 1)
        kernel[(b, buffers, tiles)](
            ptrs, strides, targets, sources, commit_lens, width,
            WP=ddtree_tree._pow2(width), TILE=_MOVE_TILE // unit, UNIT=unit,
        )  # fmt: skip

    return move


def checked_kv_move(pool, fast, own):
    """``move(targets, sources, commit_lens)`` that runs both moves every round from the same
    pool, for ``SGLANG_DDTREE_WINDOW_KV_MOVE=check``: ``fast`` (``window_kv_move``) first,
    the window's rows it leaves set aside, the rows put back, then ``own`` (the pool's
    ``move_kv_cache``), whose result stays, so the server serves what the default one does.
    ``move.counts`` (on the device: rounds, rounds where the two left different rows, rows
    times buffers that differed) is kept without a host sync, so the accept graphs capture
    it as it is: whether the window move ever leaves a pool other than the pool's own move
    does, in a server's real rounds. A diagnostic: per round and buffer, three gathers and
    a scatter of the window's rows."""
    buffers = list(pool.k_buffer) + list(pool.v_buffer)
    counts = torch.zeros(3, dtype=torch.int64, device=buffers[0].device)

    def move(targets, sources, commit_lens):
        before = [t.index_select(0, targets) for t in buffers]
        fast(targets, sources, commit_lens)
        got = [t.index_select(0, targets) for t in buffers]
        for t, rows in zip(buffers, before):
            t.index_copy_(0, targets, rows)
        own(targets, sources, commit_lens)
        differ = torch.stack([
            (t.index_select(0, targets) != g).reshape(g.shape[0], -1).any(1).sum()
            for t, g in zip(buffers, got)
        ]).sum()  # fmt: skip
        counts[0] += 1
        counts[1] += (differ > 0).to(torch.int64)
        counts[2] += differ

    def snapshot() -> dict:
        rounds, differing, rows = (int(x) for x in counts.tolist())
        return {"rounds": rounds, "differing_rounds": differing, "differing_rows": rows}

    move.counts, move.snapshot = counts, snapshot
    return move


# Bytes of a slot row one program copies (a request's rows times this, held in registers).
_MOVE_TILE = 512


@lru_cache(maxsize=1)
def _move_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def move(
        data_ptrs, data_strides, targets, sources, commit_lens, width,
        WP: tl.constexpr, TILE: tl.constexpr, UNIT: tl.constexpr,
    ):  # fmt: skip
        # TILE and the row stride in UNIT-byte words (8: int64, 1: bytes)
        req = tl.program_id(0)
        buf = tl.program_id(1)
        tile = tl.program_id(2)
        stride = tl.load(data_strides + buf) // UNIT
        if tile * TILE < stride:
            k = tl.arange(0, WP)
            inside = k < width
            n = tl.load(commit_lens + req)
            tgt = tl.load(targets + req * width + k, mask=inside, other=0)
            src = tl.load(sources + req * width + k, mask=inside, other=0)
            rows = inside & (k < n) & (src != tgt)
            off = tile * TILE + tl.arange(0, TILE)
            ok = rows[:, None] & (off < stride)[None, :]
            word = tl.int64 if UNIT == 8 else tl.uint8
            data = tl.load(data_ptrs + buf).to(tl.pointer_type(word))
            vals = tl.load(data + src[:, None] * stride + off[None, :], mask=ok)
            tl.debug_barrier()  # every source read before any target is written
            tl.store(data + tgt[:, None] * stride + off[None, :], vals, mask=ok)

    return move
