"""draft_tree.py's Triton kernels against its PyTorch path, on the CPU (run by a test).

Run with ``TRITON_INTERPRET=1``: Triton's interpreter executes the kernels with NumPy, so the
kernels' arithmetic, tie-breaks and indexing are checked without a GPU. Scheduling, barriers
and speed are not; the GPU benchmark checks the compiled kernels the same way.
"""

from __future__ import annotations

import sys

import torch
import triton.runtime.interpreter as interpreter

from ddtree_cli import draft_tree as dt

_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_with_index(tensor, scope):
    # Triton 3.6's interpreter turns a one-element array into a loop bound with int(),
    # which NumPy >= 2.4 refuses; take the element instead.
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_with_index


def check(b: int, n_pos: int, vocab: int, budget: int, ties: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n_pos, vocab, generator=gen) * 2
    if ties:
        x = x.round()  # hundreds of equal logits per row
        x[0, 0] = 0.0  # and one constant row
    x = x.to(torch.bfloat16)
    lp_t, ids_t = dt._triton_topk_logprobs(x, budget)
    lp_p, ids_p = dt.topk_logprobs(x, budget)
    assert torch.allclose(lp_t, lp_p, atol=1e-5), "top-K log-probs"
    assert torch.equal(x.gather(-1, ids_t), x.gather(-1, ids_p)), "top-K ids"
    for row in ids_t.reshape(-1, ids_t.shape[-1]).tolist():
        assert len(set(row)) == len(row), "duplicate ids"
    tt = dt.build_tree_from_topk(lp_p, ids_p, budget, use_triton=True)
    tp = dt.build_tree_from_topk(lp_p, ids_p, budget, use_triton=False)
    for name in ("tokens", "parents", "depths", "visibility", "num_nodes", "scores"):
        assert torch.equal(getattr(tt, name), getattr(tp, name)), name
    roots = torch.randint(0, vocab, (b,), generator=gen)
    prefix = torch.randint(0, 9, (b,), generator=gen)
    exact = int(dt.full_mask_numel(budget + 1, prefix))
    for numel in (exact, exact + 37):
        vt = dt.verify_inputs(tp, roots, prefix, mask_numel=numel, use_triton=True)
        vp = dt.verify_inputs(tp, roots, prefix, mask_numel=numel, use_triton=False)
        for name in (
            "input_ids",
            "positions",
            "tree_mask",
            "mask_indptr",
            "retrieve_index",
            "retrieve_next_token",
            "retrieve_next_sibling",
        ):
            assert torch.equal(getattr(vt, name), getattr(vp, name)), name
    # Targets that mostly follow each node's first child: long accepted paths.
    follow = vp.input_ids.gather(1, vp.retrieve_next_token.clamp_min(0))
    target = torch.where(torch.rand(b, budget + 1, generator=gen) < 0.8, follow, 5)
    wt = dt.verify_walk(tp, target, use_triton=True)
    wp = dt.verify_walk(tp, target, use_triton=False)
    for name in ("accepted", "accept_len", "bonus"):
        assert torch.equal(getattr(wt, name), getattr(wp, name)), name
    ct, cp = dt.compaction_indices(wt, budget + 1), dt.compaction_indices(wp, budget + 1)
    for name in ("src_slots", "src_rows", "keep"):
        assert torch.equal(getattr(ct, name), getattr(cp, name)), name
    print(
        f"ok b={b} L={n_pos} V={vocab} B={budget} ties={ties} accept_len={wp.accept_len.tolist()}"
    )


CASES = [
    # (batch, positions, vocab, budget, ties)
    (2, 4, 3000, 16, False),  # fewer groups than K: every chunk is a candidate
    (1, 2, 40000, 8, False),  # the compacted candidate lists
    (1, 2, 40000, 8, True),  # ties overflow them: the full sort
    (3, 6, 5000, 32, True),
    (2, 5, 700, 8, True),
    (1, 3, 20, 16, False),  # vocab barely above the budget
    (2, 3, 10, 16, False),  # vocab below the budget: K = V, padding slots
    (1, 1, 100, 5, False),  # one position
    (1, 4, 64, 1, False),  # budget 1
]

if __name__ == "__main__":
    for i, case in enumerate(CASES):
        check(*case, seed=i)
    sys.exit(0)
