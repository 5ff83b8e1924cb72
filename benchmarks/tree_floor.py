"""What the tree kernel's per-depth selection does, by its floor rule, on the CPU.

The tree kernel (``draft_tree.py``) builds depth d only when the depth's best candidate is at
or above a floor under the final tree's lowest score, and sorts it only when the best
parent's second child is too (otherwise the rank-0 shortcut). The floor comes from chains;
with ``tree_rise`` it also rises after each sorted depth to the budget-th best of the paths
seen so far (A_1 and every sorted A_d). With ``tree_narrow`` a sorted depth whose candidates
at or above the floor fit in a rectangle of at most BP (budget rounded up to a power of two)
cells, the parents with a kept rank-0 child by the ranks kept under the best parent, sorts
those BP lanes instead of all CP staircase lanes. This module is that rule written out in
PyTorch (the interpreter test checks the kernel's trees against the PyTorch path under every
rule and uses this model for its exit depths and for the branches it expects), and its
``main`` counts, per kind of draft logits, the depths built, sorted BP wide ("narrow") and
sorted CP wide per request, the candidates at or above the floor per sorted depth, and how
often the final choice is compacted: the work a GPU round does, without a GPU.

Usage: PYTHONPATH=. python benchmarks/tree_floor.py [--batch 64] [--budget 64] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
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


@dataclass
class Depth:
    """One depth the kernel's loop visits (1-based ``depth``, >= 2)."""

    depth: int
    floor: float  # the floor it was built under
    how: str  # "empty" (its best is below the floor), "rank-0", "narrow" or "sorted"
    kept: int = 0  # staircase candidates at or above the floor (sorted depths)
    rect: int = 0  # the rectangle that holds them: parents x ranks (sorted depths)
    lanes: int = 0  # the width of its sort: BP (narrow), CP (sorted), 0 (no sort)


@dataclass
class Trace:
    depths: list[Depth] = field(default_factory=list)
    floor: float = float("-inf")  # the final choice's floor
    exit: int | None = None  # the first empty depth, 1-based (None: no depth is empty)
    final_kept: int = 0  # entries the final choice finds at or above its floor
    final: str = "compacted"  # "compacted" (at most 2 BP of them) or "whole"


def trace(
    row: torch.Tensor,
    depth_scores: torch.Tensor,
    budget: int,
    rise: bool | None = None,
    narrow: bool | None = None,
) -> Trace:
    """The tree kernel's decisions for one request, from its rule (``rise`` / ``narrow``:
    default ``_TUNING``). ``row`` is the request's ``[L, K]`` top-K log-probs,
    ``depth_scores`` its ``A_d`` (``_select_per_depth``). Counting with the exact ``A_d``
    gives the kernel's counts: the entries it holds as -inf instead are below a floor it
    has passed, and the floor never falls."""
    if rise is None:
        rise = bool(dt._TUNING["tree_rise"])
    if narrow is None:
        narrow = bool(dt._TUNING["tree_narrow"])
    n_pos, k = row.shape
    bp = max(2, dt._pow2(budget))
    cand_i, cand_r, real = dt._staircase(budget, k, torch.device("cpu"))
    cand_i, cand_r = cand_i[:real], cand_r[:real]
    cp = max(bp, dt._pow2(cand_i.numel()))
    neg = torch.tensor(float("-inf"))
    bound = chain_bound(row, budget)
    # The loop's end is fixed by the chain floor: the depths whose best is at or above it.
    best = row[0, 0].clone()
    d_end = 1
    for d in range(1, n_pos):
        best = best + row[d, 0]
        if best < bound:
            break
        d_end += 1
    out = Trace()
    run = depth_scores[0].clone()  # the best `budget` of the paths seen so far
    stored = [depth_scores[0]]  # what the kernel stores per depth (shortcut: A_{d-1} + y0)
    s0 = row[0, 0].clone()  # the best score of the depth above (rank-0 chain)
    for d in range(1, d_end):
        y0 = row[d, 0]
        y1 = row[d, 1] if k > 1 else neg
        if s0 + y0 < bound and out.exit is None:
            out.exit = d + 1
        if s0 + y1 < bound:
            how = "empty" if s0 + y0 < bound else "rank-0"
            out.depths.append(Depth(d + 1, float(bound), how))
            stored.append(torch.where(stored[-1] + y0 >= bound, stored[-1] + y0, neg))
        else:
            a = stored[-1]
            score = a[cand_i] + row[d, cand_r]
            keep = score >= bound
            n_par = int((keep & (cand_r == 0)).sum())
            n_rank = int((keep & (cand_i == 0)).sum())
            rect = n_par * n_rank
            how = "narrow" if narrow and rect <= bp else "sorted"
            out.depths.append(
                Depth(
                    d + 1, float(bound), how, int(keep.sum()), rect, bp if how == "narrow" else cp
                )
            )
            stored.append(depth_scores[d])
            if rise:
                run = torch.cat([run, depth_scores[d]]).sort(descending=True).values[:budget]
                bound = torch.maximum(bound, run[budget - 1])
        s0 = s0 + y0
    if out.exit is None and d_end < n_pos:
        out.exit = d_end + 1
    out.floor = float(bound)
    out.final_kept = int((torch.cat(stored) >= bound).sum())
    out.final = "compacted" if out.final_kept <= 2 * bp else "whole"
    return out


def depth_counts(lp: torch.Tensor, budget: int, rise: bool, narrow: bool = False) -> dict:
    """Per request, depths built, sorted narrow (BP wide) and sorted whole (CP wide); per
    sorted depth, the candidates at or above the floor and the sort's lanes; the share of
    final choices that are compacted."""
    lp = lp.float()
    scores, _, _ = dt._select_per_depth(lp, budget)
    traces = [trace(row, scores[r], budget, rise, narrow) for r, row in enumerate(lp)]
    n = len(traces)
    sorts = [x for t in traces for x in t.depths if x.how in ("narrow", "sorted")]
    return {
        "built_mean": sum(x.how != "empty" for t in traces for x in t.depths) / n,
        "sorted_mean": len(sorts) / n,
        "narrow_mean": sum(x.how == "narrow" for x in sorts) / n,
        "whole_mean": sum(x.how == "sorted" for x in sorts) / n,
        "kept_per_sort": sum(x.kept for x in sorts) / max(1, len(sorts)),
        "lanes_per_sort": sum(x.lanes for x in sorts) / max(1, len(sorts)),
        "lanes_mean": sum(x.lanes for x in sorts) / n,
        "final_compacted": sum(t.final == "compacted" for t in traces) / n,
        "final_kept_mean": sum(t.final_kept for t in traces) / n,
    }


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
    print(
        "| logits | floor | selection | depths built | sorted BP wide | sorted CP wide |"
        " kept / sorted depth | lanes sorted / request | final choice compacted |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for kind in args.kinds.split(","):
        gen = torch.Generator().manual_seed(args.seed)
        shape = (args.batch, args.positions, args.vocab)
        x = draft_logits(shape, kind, gen, torch.device("cpu"))
        lp, _ = dt.topk_logprobs(x, args.budget, use_triton=False)
        for rise in (False, True):
            for narrow in (False, True):
                c = depth_counts(lp, args.budget, rise, narrow)
                rows.append({"logits": kind, "rise": rise, "narrow": narrow, **c})
                print(
                    f"| {kind} | {'chains, risen' if rise else 'chains'} |"
                    f" {'narrow' if narrow else 'whole'} | {c['built_mean']:.2f} |"
                    f" {c['narrow_mean']:.2f} | {c['whole_mean']:.2f} |"
                    f" {c['kept_per_sort']:.1f} | {c['lanes_mean']:.0f} |"
                    f" {c['final_compacted']:.2f} |",
                    flush=True,
                )
    if args.json:
        meta = {k: getattr(args, k) for k in ("batch", "budget", "positions", "vocab", "seed")}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
