"""How many depths the tree kernel builds and sorts, by its floor rule, on the CPU.

The tree kernel (``draft_tree.py``) builds depth d only when the depth's best candidate is at
or above a floor under the final tree's lowest score, and sorts it only when the best
parent's second child is too (otherwise the rank-0 shortcut). The floor comes from chains;
with ``tree_rise`` it also rises after each depth to the budget-th best of A_1 and A_d, and
of A_{d-1} and A_d. This module is that rule written out in PyTorch (the interpreter test
checks the kernel's trees against the PyTorch path under both rules and uses this model for
its exit depths), and its ``main`` counts, per kind of draft logits, the depths built and
sorted per request under each rule: the work a GPU round does, without a GPU.

Usage: PYTHONPATH=. python benchmarks/tree_floor.py [--batch 64] [--budget 64] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddtree_cli import draft_tree as dt  # noqa: E402


def chain_bound(row: torch.Tensor, budget: int) -> torch.Tensor:
    """The tree kernel's floor, from its rule: the best over root children j of the chain
    "j, then rank 0 at each later position" at depth ceil(budget / (j + 1)), summed in
    float32 in the kernel's order."""
    n_pos, k = row.shape
    bound = torch.tensor(float("-inf"))
    for j in range(min(k, budget)):
        h = -(-budget // (j + 1))
        if h <= n_pos:
            chain = row[0, j].clone()
            for d in range(1, h):
                chain = chain + row[d, 0]
            bound = torch.maximum(bound, chain)
    return bound


def kth_of_union(x: torch.Tensor, y: torch.Tensor, budget: int) -> torch.Tensor:
    """The budget-th best of two descending lists' union, the kernel's way."""
    return torch.maximum(x[:budget], y[:budget].flip(0)).min()


def floor_trace(
    row: torch.Tensor, depth_scores: torch.Tensor, budget: int, rise: bool | None = None
) -> tuple:
    """The tree kernel's floor, depth by depth, from its rule: the chain bound; with
    ``rise`` (default: ``tree_rise``), after building depth d, the budget-th best of A_1 and A_d, and of A_{d-1}
    and A_d, when higher. Depth d is built when its best (the best of depth d - 1 plus
    position d's rank-0 log-prob) is at or above the floor then. Returns the floor each built
    depth was built under, the final floor and the first depth not built (1-based, None:
    every depth is built). ``depth_scores`` are the request's ``A_d`` (``_select_per_depth``).
    """
    if rise is None:
        rise = bool(dt._TUNING["tree_rise"])
    bound = chain_bound(row, budget)
    best = row[0, 0].clone()
    built = []
    for d in range(1, row.shape[0]):
        best = best + row[d, 0]
        if best < bound:
            return built, bound, d + 1  # depths are 1-based: the root's children are depth 1
        built.append(bound)
        if rise:
            a = depth_scores[d]
            first = kth_of_union(depth_scores[0], a, budget)
            prev = kth_of_union(depth_scores[d - 1], a, budget)
            bound = torch.maximum(bound, torch.maximum(first, prev))
    return built, bound, None


def depth_counts(lp: torch.Tensor, budget: int, rise: bool) -> dict:
    """Per request, depths built and depths sorted (built, not by the rank-0 shortcut)."""
    lp = lp.float()
    scores, _, _ = dt._select_per_depth(lp, budget)
    built_n, sorted_n = [], []
    for r, row in enumerate(lp):
        built, _, _ = floor_trace(row, scores[r], budget, rise)
        second = [
            scores[r, d - 1, 0] + (row[d, 1] if row.shape[1] > 1 else float("-inf"))
            for d in range(1, len(built) + 1)
        ]
        built_n.append(len(built))
        sorted_n.append(sum(int(s >= f) for s, f in zip(second, built, strict=True)))
    n = len(built_n)
    return {"built_mean": sum(built_n) / n, "sorted_mean": sum(sorted_n) / n}


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from draft_tree_gpu import draft_logits

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64, help="requests (rows) per kind")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--positions", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--kinds", default="random,deep,branchy,zipf")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    print("| logits | floor | depths built / request | depths sorted / request |")
    print("|---|---|---:|---:|")
    for kind in args.kinds.split(","):
        gen = torch.Generator().manual_seed(args.seed)
        shape = (args.batch, args.positions, args.vocab)
        x = draft_logits(shape, kind, gen, torch.device("cpu"))
        lp, _ = dt.topk_logprobs(x, args.budget, use_triton=False)
        for rise in (False, True):
            row = {"logits": kind, "rise": rise, **depth_counts(lp, args.budget, rise)}
            rows.append(row)
            name = "chains, risen" if rise else "chains"
            print(f"| {kind} | {name} | {row['built_mean']:.2f} | {row['sorted_mean']:.2f} |")
    if args.json:
        meta = {k: getattr(args, k) for k in ("batch", "budget", "positions", "vocab", "seed")}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
