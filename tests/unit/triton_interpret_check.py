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
from tree_floor import floor_trace  # noqa: E402

_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_with_index(tensor, scope):
    # Triton 3.6's interpreter turns a one-element array into a loop bound with int(),
    # which NumPy >= 2.4 refuses; take the element instead.
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_with_index


def exit_depths(lp: torch.Tensor, budget: int) -> list:
    """Per request, the first depth the tree kernel does not build (None: it builds every
    depth; with ``tree_rise`` the depths after it are sorted by no one and come out empty)."""
    scores, _, _ = dt._select_per_depth(lp.float(), budget)
    return [floor_trace(row, sc, budget)[2] for row, sc in zip(lp.float(), scores, strict=True)]


TAKEN: set = set()


def note_regimes(lp: torch.Tensor, budget: int) -> None:
    """Which branches of the tree kernel these inputs take: a depth built by the rank-0
    shortcut (the best parent's second child is below the floor) or by the sort, and the final
    choice over at most 2 BP entries at or above the floor (compacted) or over all of them."""
    bp = max(2, dt._pow2(budget))
    scores, _, _ = dt._select_per_depth(lp.float(), budget)
    for r, row in enumerate(lp.float()):
        built, bound, stop = floor_trace(row, scores[r], budget)
        for d, floor in enumerate(built, start=1):
            second = scores[r, d - 1, 0] + (row[d, 1] if row.shape[1] > 1 else float("-inf"))
            TAKEN.add(("depth", "rank-0" if second < floor else "sorted"))
        end = stop - 1 if stop else row.shape[0]  # depths 1..end are built
        kept = (scores[r, :end] >= bound).sum()
        TAKEN.add(("final", "compacted" if kept <= 2 * bp else "whole"))


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
    note_regimes(lp, budget)
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
               spike: int = 0, want_exit=..., height: float = 14.0) -> None:  # fmt: skip
    """The tree kernel alone (each per-depth selection strategy) at larger budgets."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n_pos, vocab, generator=gen) * 2
    x = gpu_bench.spiked(x, spike, gen, height=height)
    if ties:
        x = x.round()
    lp, ids = dt.topk_logprobs(x.to(torch.bfloat16), budget, use_triton=False)
    exits = exit_depths(lp, budget)
    assert want_exit is ... or exits == want_exit, exits
    note_regimes(lp, budget)
    gpu_bench.check_tree(lp, ids, budget)
    rise = dt._TUNING["tree_rise"]
    print(f"ok tree b={b} L={n_pos} V={vocab} B={budget} ties={ties} rise={rise} exit={exits}")


def check_zipf(b: int, n_pos: int, vocab: int, budget: int, seed: int) -> None:
    """Rows shaped like a language model's (the GPU benchmark's ``zipf``): the tree kernel in
    both floor modes against the PyTorch path, and the risen floor stopping the build
    earlier than the chain floor alone (depths not built, 15 + 1 for a full build)."""
    gen = torch.Generator().manual_seed(seed)
    x = gpu_bench.draft_logits((b, n_pos, vocab), "zipf", gen, torch.device("cpu"))
    lp, ids = dt.topk_logprobs(x, budget, use_triton=False)
    stops = {}
    for rise in (0, 1):
        dt._TUNING["tree_rise"] = rise
        gpu_bench.check_tree(lp, ids, budget)
        stops[rise] = [e or n_pos + 1 for e in exit_depths(lp, budget)]
        note_regimes(lp, budget)
    dt._TUNING["tree_rise"] = 0
    assert all(r <= c for r, c in zip(stops[1], stops[0], strict=True)), stops
    assert sum(stops[1]) < sum(stops[0]), stops
    print(f"ok zipf b={b} L={n_pos} V={vocab} B={budget} stop chain={stops[0]} rise={stops[1]}")


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
    # The exit: sure for 3 positions, then flat -> the kernel stops building depths mid-way
    # (at depth 5 in both requests: `exit` is the first depth not built, 1-based).
    (2, 8, 3000, 16, False, 3, [5, 5]),
]

# The tree kernel alone: the full round's kernels are slow to interpret at these budgets.
TREE_CASES = [
    (1, 15, 1500, 64, False),  # the target shape
    (2, 4, 1500, 64, True),
    (2, 5, 300, 48, True),  # a budget that is not a power of two
    (1, 3, 1500, 128, True),  # 512 candidates per depth
    (1, 15, 1500, 64, False, 15, [None]),  # sure everywhere: every depth sorted, no exit
    (2, 15, 1500, 64, False, 6, ...),  # the exit after a deep start, at the target shape
    # Sure to the last bit after an integer first position: rank-0 log-probs of exactly 0,
    # so every depth repeats A_1's tied scores and 465 of them stand at or above the floor:
    # the final choice over all of them, ties broken by depth.
    (1, 15, 800, 64, True, 14, [None], 200.0),
]

if __name__ == "__main__":
    for i, case in enumerate(CASES):
        check(*case[:5], i, *case[5:])
    check_zipf(4, 15, 1500, 64, 200)
    for rise in (0, 1):  # the floor from chains alone, then raised as depths are built
        dt._TUNING["tree_rise"] = rise
        for i, case in enumerate(TREE_CASES):
            check_tree(*case[:5], 100 + i, *case[5:])
    want = {("depth", "rank-0"), ("depth", "sorted"), ("final", "compacted"), ("final", "whole")}
    assert want == TAKEN, f"branches not taken: {want - TAKEN}"
    print(f"ok every branch of the tree kernel taken: {sorted(TAKEN)}")
    sys.exit(0)
