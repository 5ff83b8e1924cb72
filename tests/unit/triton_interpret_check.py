"""draft_tree.py's Triton kernels against its PyTorch path, on the CPU (run by a test).

Run with ``TRITON_INTERPRET=1``: Triton's interpreter executes the kernels with NumPy, so the
kernels' arithmetic, tie-breaks and indexing are checked without a GPU. Scheduling, barriers
and speed are not; the GPU benchmark checks the compiled kernels the same way.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import triton.runtime.interpreter as interpreter

from ddtree_cli import draft_tree as dt

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import draft_tree_gpu as gpu_bench  # noqa: E402
from tree_floor import trace  # noqa: E402

_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_with_index(tensor, scope):
    # Triton 3.6's interpreter turns a one-element array into a loop bound with int(),
    # which NumPy >= 2.4 refuses; take the element instead.
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_with_index


def traces(lp: torch.Tensor, budget: int) -> tuple:
    """Per request, the tree kernel's decisions under the current ``_TUNING`` (the model of
    ``benchmarks/tree_floor.py``), and the requests' ``A_d`` from the PyTorch path."""
    lp = lp.float()
    scores, ranks, parent_pos = dt._select_per_depth(lp, budget)
    ts = [trace(row, sc, budget) for row, sc in zip(lp, scores, strict=True)]
    return ts, scores, (parent_pos << 16) | ranks


def exit_depths(lp: torch.Tensor, budget: int) -> list:
    """Per request, the first depth the tree kernel leaves empty (None: it builds every
    depth; past the chain floor's last depth nothing is built, past a risen floor's the
    depths come out empty)."""
    return [t.exit for t in traces(lp, budget)[0]]


TAKEN: set = set()


def regime(how: str) -> str:
    if how == "sorted" and dt._TUNING["tree_narrow"]:
        return "whole"  # the narrow selection's fallback: the rectangle is too large
    return how


def note_regimes(lp: torch.Tensor, budget: int, buffers: tuple | None = None) -> None:
    """Which branches of the tree kernel these inputs take: per depth the rank-0 shortcut,
    the sort of all CP candidate lanes ("sorted", or "whole" as the narrow selection's
    fallback) or of the BP-lane rectangle ("narrow"); the final choice over at most 2 BP
    entries at or above the floor ("compacted") or over all of them ("whole").

    With ``buffers``, the kernel's own per-depth scores and candidates (``s_buf``, ``c_buf``)
    show what it did: a shortcut depth holds its parents' positions in order, every sorted
    depth the PyTorch path's A_d at and above the modelled floor; a narrow one -inf below it
    (where the sort of all lanes keeps real scores, which a whole one shows)."""
    ts, scores, cands = traces(lp, budget)
    for r, t in enumerate(ts):
        chain_floor = t.depths[0].floor if t.depths else float("inf")
        for x in t.depths:
            if x.how != "empty":
                TAKEN.add(("depth", regime(x.how)))
            if buffers is None or budget < 2:
                continue
            d = x.depth - 1
            s, c = buffers[0][r, d], buffers[1][r, d]
            shortcut = int(c[budget - 1]) == (budget - 1) << 16  # never a staircase candidate
            assert shortcut == (x.how in ("empty", "rank-0")), (r, x, c.tolist())
            if shortcut:
                continue
            exact = scores[r, d]
            above = exact >= x.floor
            assert torch.equal(s[above], exact[above]), (r, x)
            assert torch.equal(c[above], cands[r, d][above].to(c.dtype)), (r, x)
            below = s[~above]
            if x.how == "narrow":
                assert bool((below == float("-inf")).all()), (r, x, below.tolist())
                if bool((exact[~above] > float("-inf")).any()):
                    TAKEN.add(("seen", "narrow"))
                if bool((exact[~above] >= chain_floor).any()):
                    TAKEN.add(("seen", "narrow under a risen floor"))
                if int((exact == x.floor).sum()) > 1:
                    TAKEN.add(("seen", "narrow with ties at the floor"))
            elif bool((below > float("-inf")).any()):
                TAKEN.add(("seen", regime(x.how)))
        TAKEN.add(("final", t.final))


@contextmanager
def allocations():
    """The tensors ``torch.empty`` makes meanwhile (the tree kernel's buffers among them)."""
    made: list = []
    empty = torch.empty

    def recording(*args, **kwargs):
        made.append(empty(*args, **kwargs))
        return made[-1]

    torch.empty = recording
    try:
        yield made
    finally:
        torch.empty = empty


def check_tree_kernel(lp: torch.Tensor, ids: torch.Tensor, budget: int, floors=(1, 0)) -> None:
    """The tree kernel against the PyTorch path (``tree_exit`` in ``floors``), then which
    branches it took, from the buffers of its first run (``s_buf``, ``c_buf``: the first
    float32 and int32 tensors of their shape; the PyTorch path makes none)."""
    with allocations() as made:
        gpu_bench.check_tree(lp, ids, budget, floors)
    shape = (lp.shape[0], lp.shape[1], budget)
    s_buf = next(t for t in made if t.shape == shape and t.dtype == torch.float32)
    c_buf = next(t for t in made if t.shape == shape and t.dtype == torch.int32)
    note_regimes(lp, budget, (s_buf, c_buf) if floors[0] else None)


def mode() -> str:
    return f"rise={dt._TUNING['tree_rise']} narrow={dt._TUNING['tree_narrow']}"


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
               spike: int = 0, want_exit=..., height: float = 14.0,
               floors=(1, 0)) -> None:  # fmt: skip
    """The tree kernel alone (each per-depth selection strategy) at larger budgets."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n_pos, vocab, generator=gen) * 2
    x = gpu_bench.spiked(x, spike, gen, height=height)
    if ties:
        x = x.round()
    lp, ids = dt.topk_logprobs(x.to(torch.bfloat16), budget, use_triton=False)
    exits = exit_depths(lp, budget)
    assert want_exit is ... or exits == want_exit, exits
    check_tree_kernel(lp, ids, budget, floors)
    print(f"ok tree b={b} L={n_pos} V={vocab} B={budget} ties={ties} {mode()} exit={exits}")


def check_zipf(b: int, n_pos: int, vocab: int, budget: int, seed: int, ties: bool = False,
               modes=None, floors=(1, 0)) -> None:  # fmt: skip
    """Rows shaped like a language model's (the GPU benchmark's ``zipf``; ``ties``: logits
    rounded to halves, so equal scores at the floor): the tree kernel under each floor and
    selection rule in ``modes`` (default: all) against the PyTorch path (``floors`` for the
    first), and without ties the risen floor stopping the build earlier than the chain
    floor alone (the first empty depth, 15 + 1 for a full build)."""
    gen = torch.Generator().manual_seed(seed)
    x = gpu_bench.draft_logits((b, n_pos, vocab), "zipf", gen, torch.device("cpu"))
    if ties:
        x = (x.float() * 2).round().to(torch.bfloat16)
    lp, ids = dt.topk_logprobs(x, budget, use_triton=False)
    stops = {}
    for i, (rise, narrow) in enumerate(MODES if modes is None else modes):
        dt._TUNING.update(tree_rise=rise, tree_narrow=narrow)
        check_tree_kernel(lp, ids, budget, floors if i == 0 else (1,))
        stops[rise] = [e or n_pos + 1 for e in exit_depths(lp, budget)]
    dt._TUNING.update(DEFAULTS)
    if len(stops) == 2:
        assert all(r <= c for r, c in zip(stops[1], stops[0], strict=True)), stops
    if len(stops) == 2 and not ties:
        assert sum(stops[1]) < sum(stops[0]), stops
    stops.setdefault(0, "-")
    print(
        f"ok zipf b={b} L={n_pos} V={vocab} B={budget} ties={ties}"
        f" stop chain={stops[0]} rise={stops.get(1, '-')}"
    )


# (tree_rise, tree_narrow): the floor from chains alone or raised after each sorted depth;
# each sorted depth over all CP staircase lanes or, when they fit, over a BP-lane rectangle.
MODES = [(0, 0), (1, 1), (0, 1), (1, 0)]
DEFAULTS = dict(dt._TUNING)  # restored after each check that changes it

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
    # The narrow selection with equal scores at the floor, and at a budget that is not a
    # power of two (the rectangle BP = 64 lanes wide, A_d 48).
    check_zipf(2, 15, 1500, 64, 201, ties=True, modes=MODES[1:3], floors=(1,))
    check_zipf(2, 15, 1500, 48, 200, modes=MODES[1:3], floors=(1,))
    for i, (rise, narrow) in enumerate(MODES[:2]):
        dt._TUNING.update(tree_rise=rise, tree_narrow=narrow)
        for j, case in enumerate(TREE_CASES):
            check_tree(*case[:5], 100 + j, *case[5:], floors=(1, 0) if i == 0 else (1,))
    dt._TUNING.update(DEFAULTS)
    want = {
        ("depth", "rank-0"),
        ("depth", "sorted"),
        ("depth", "narrow"),
        ("depth", "whole"),
        ("final", "compacted"),
        ("final", "whole"),
        # what the kernel's own buffers showed
        ("seen", "sorted"),
        ("seen", "narrow"),
        ("seen", "whole"),
        ("seen", "narrow under a risen floor"),
        ("seen", "narrow with ties at the floor"),
    }
    assert want == TAKEN, f"branches not taken: {want - TAKEN}, unknown: {TAKEN - want}"
    print(f"ok every branch of the tree kernel taken: {sorted(TAKEN)}")
    sys.exit(0)
