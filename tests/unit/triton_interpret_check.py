"""draft_tree.py's Triton kernels against its PyTorch path, on the CPU (run by a test).

Run with ``TRITON_INTERPRET=1``: Triton's interpreter executes the kernels with NumPy, so the
kernels' arithmetic, tie-breaks and indexing are checked without a GPU. Scheduling, barriers
and speed are not; the GPU benchmark checks the compiled kernels the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton.runtime.interpreter as interpreter

from ddtree_cli import draft_tree as dt

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import draft_tree_gpu as gpu_bench  # noqa: E402

_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_with_index(tensor, scope):
    # Triton 3.6's interpreter turns a one-element array into a loop bound with int(),
    # which NumPy >= 2.4 refuses; take the element instead.
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_with_index


def exit_depths(lp: torch.Tensor, budget: int) -> list:
    """Per request, the depth at which the tree kernel's early exit stops sorting (None: it
    sorts every depth), computed from the rule itself: the best candidate at depth d is the
    best at depth d - 1 plus position d's rank-0 log-prob; the exit bound is the root's
    budget-th child."""
    out = []
    for row in lp:
        t1 = float(row[0, budget - 1]) if row.shape[1] >= budget else float("-inf")
        best, stop = float(row[0, 0]), None
        for d in range(1, row.shape[0]):
            best += float(row[d, 0])
            if best < t1:
                stop = d + 1  # depths are 1-based: the root's children are depth 1
                break
        out.append(stop)
    return out


def check(b: int, n_pos: int, vocab: int, budget: int, ties: bool, seed: int,
          spike: int = 0, want_exit=...) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    x = gpu_bench.spiked(torch.randn(b, n_pos, vocab, generator=gen) * 2, spike, gen)
    if ties:
        x = x.round()  # hundreds of equal logits per row
        x[0, 0] = 0.0  # and one constant row
    x = x.to(torch.bfloat16)
    lp, ids = dt.topk_logprobs(x, budget, use_triton=False)
    exits = exit_depths(lp, budget)
    assert want_exit is ... or exits == want_exit, exits
    tree = dt.build_tree_from_topk(lp, ids, budget, use_triton=False)
    roots = torch.randint(0, vocab, (b,), generator=gen)
    prefix = torch.randint(0, 9, (b,), generator=gen)
    target = gpu_bench.following_targets(tree, vocab, gen)  # long accepted paths
    exact = int(dt.full_mask_numel(budget + 1, prefix))
    # The same comparison the GPU benchmark makes of the compiled kernels.
    gpu_bench.check_triton_against_torch(x, budget, roots, prefix, target, exact)
    # The public entry point takes the fused kernels when asked (on a GPU: by default).
    fused = dt.topk_logprobs(x, budget, use_triton=True)
    for got, want in zip(fused, dt._triton_topk_logprobs(x, budget), strict=True):
        assert torch.equal(got, want)
    accept = dt.verify_walk(tree, target, use_triton=False).accept_len.tolist()
    print(f"ok b={b} L={n_pos} V={vocab} B={budget} ties={ties} exit={exits} accept_len={accept}")


def check_tree(b: int, n_pos: int, vocab: int, budget: int, ties: bool, seed: int,
               spike: int = 0, want_exit=...) -> None:  # fmt: skip
    """The tree kernel alone (each per-depth selection strategy) at larger budgets."""
    gen = torch.Generator().manual_seed(seed)
    x = gpu_bench.spiked(torch.randn(b, n_pos, vocab, generator=gen) * 2, spike, gen)
    if ties:
        x = x.round()
    lp, ids = dt.topk_logprobs(x.to(torch.bfloat16), budget, use_triton=False)
    exits = exit_depths(lp, budget)
    assert want_exit is ... or exits == want_exit, exits
    gpu_bench.check_tree_selects(lp, ids, budget)
    print(f"ok tree b={b} L={n_pos} V={vocab} B={budget} ties={ties} exit={exits} "
          f"{dt._TREE_SELECTS}")  # fmt: skip


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
    # The early exit: sure for 3 positions, then flat -> the kernel stops sorting mid-way
    # (at depth 5 and 6: `exit` is the first depth left unsorted, 1-based).
    (2, 8, 3000, 16, False, 3, [5, 6]),
]

# The tree kernel alone: the full round's kernels are slow to interpret at these budgets.
TREE_CASES = [
    (1, 15, 1500, 64, False),  # the target shape: the most candidates "rank" handles (256)
    (2, 4, 1500, 64, True),
    (2, 5, 300, 48, True),  # a budget that is not a power of two
    (1, 3, 1500, 128, True),  # above the "rank" limit: the sort runs
    (1, 15, 1500, 64, False, 15, [None]),  # sure everywhere: every depth sorted, no exit
    (2, 15, 1500, 64, False, 6, ...),  # the exit after a deep start, at the target shape
]

if __name__ == "__main__":
    for i, case in enumerate(CASES):
        check(*case[:5], i, *case[5:])
    for i, case in enumerate(TREE_CASES):
        check_tree(*case[:5], 100 + i, *case[5:])
    sys.exit(0)
