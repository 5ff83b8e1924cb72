"""The v2 round's verify inputs and accept, eager and replayed from the step graphs.

Around the target's verify the patched v2 worker builds the verify inputs from the tree
(``ddtree_tree.verify_inputs``) and afterwards accepts (``ddtree_tree.verify_walk``,
``ddtree_commit_v2.commit_round`` and the KV pool's move). ``ddtree_step_graphs_v2`` replays
both from CUDA graphs captured on the round graphs' tree buffers. This runs, on one GPU and
without SGLang, the series' own code for it (``ddtree_round_graphs``, ``ddtree_commit_v2``
and ``ddtree_step_graphs_v2`` loaded from the patch series, ``ddtree_tree`` being
``ddtree_cli.draft_tree``) and, per (batch, budget):

- ``verify eager`` / ``verify graph``: the verify inputs as the worker builds them (the mask
  sized from the host's lengths) and from the verify graph (its mask cut from the buffer
  shared by every size);
- ``accept eager`` / ``accept graph``: the walk, the commit and a KV move, launched from
  Python and replayed. The KV pool is a stand-in (one ``[slots, 256]`` tensor, the move one
  indexed copy, in both arms); SGLang's pool moves every layer in one Triton launch.

Before timing, every replayed output is checked against the eager one (tokens, positions,
the mask up to its real size, the accept's outputs and the KV after the move), at batch sizes
that a graph of a larger size serves too. Timing as ``round_graphs_gpu.py``: ``host_us`` is
the Python time to issue the step while the GPU is busy, ``gpu_us`` its device time alone.

With two budgets in one process (one set of round graphs, one memory pool, as a v1 worker
under ``auto`` holds them) the accept's capture hit an illegal memory access in the tree walk
on an H100 (2026-12-06, docs/performance.md). compute-sanitizer put it in the walk reading
parents far out of bounds, and ``--pool-per-budget`` (each budget's round graphs in a pool of
their own) made it go away: the budget-64 graphs, captured after the budget-15 ones, hold
their trees where the budget-15 graphs write their intermediates, and the budget-15 timings
replayed those graphs before the budget-64 step graphs were captured. ``StepGraphs.capture``
now replays each size's round graph first (``DraftRoundGraphs.replay_captured``), which the
shared pool needs.

Usage: python benchmarks/step_graphs_gpu.py [--batches 1,3,8,32] [--budgets 15,64] [--json F]
       [--pool-per-budget]
"""

# The timed closures run within their own loop iteration.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import draft_tree_gpu as gpu_bench  # noqa: E402
import round_graphs_gpu as rgg  # noqa: E402

V2 = ROOT / "ddtree_cli/patching/series/families/v2/sglang/srt/speculative"
SLOT_BYTES = 256  # the KV stand-in's row


def load_v2_modules():
    """The series' ddtree_commit_v2 and ddtree_step_graphs_v2 (after round_graphs_gpu's
    loader has put ``sglang.srt.speculative`` and ``ddtree_round_graphs`` in place)."""
    return rgg.load_series(V2, ("ddtree_commit_v2", "ddtree_step_graphs_v2"))


def accept_fn(commit_mod, kv):
    """The worker's ``_accept`` (``ddtree_commit_v2.accept_round``) with the KV stand-in
    ``kv`` as the pool."""

    def move(targets, sources, commit_lens):
        kv[targets] = kv[sources]

    def accept(tree, target, prefix, locs):
        return commit_mod.accept_round(tree, target, prefix, locs, move)

    return accept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,3,8,32")
    ap.add_argument("--budgets", default="15,64")
    ap.add_argument("--capture-sizes", default="1,2,4,8,16,32")
    ap.add_argument("--prefix", default="100,2000", help="prefix lengths drawn from LO,HI")
    ap.add_argument("--pool", type=int, default=80000, help="KV pool tokens (mask buffer)")
    ap.add_argument("--pool-per-budget", action="store_true",
                    help="capture each budget's round graphs in a memory pool of its own")  # fmt: skip
    rgg.add_head_args(ap)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, rg, head = rgg.patch_head(args)
    dt = sys.modules["sglang.srt.speculative.ddtree_tree"]
    commit_mod, steps = load_v2_modules()
    budgets = [int(x) for x in args.budgets.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x]
    sizes = [int(x) for x in args.capture_sizes.split(",") if x]
    lo, hi = (int(x) for x in args.prefix.split(","))
    rg.warm_rounds(head, None, None, sizes=sizes, budgets=budgets, n_pos=args.positions,
                   device=dev)  # fmt: skip
    # One set of round graphs (one memory pool) for every budget, as a v1 worker under
    # `auto` holds them; --pool-per-budget: one set per budget (a v2 server has one budget).
    groups = [[b] for b in budgets] if args.pool_per_budget else [budgets]
    round_graphs = {}
    for group in groups:
        graphs = rg.capture_round_graphs(
            head, None, sizes=sizes, pairs=[(b, b) for b in group], n_pos=args.positions,
            device=dev,
        )  # fmt: skip
        if graphs is None:
            print("round graphs not captured (see the warning above)", file=sys.stderr)
            return 1
        round_graphs.update(dict.fromkeys(group, graphs))
    slots = 1 + max(batches) * (max(budgets) + 1) + 1024
    gen = torch.Generator().manual_seed(1)
    rows, meta = [], {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for budget in budgets:
        d = budget + 1
        graphs = round_graphs[budget]
        mask = torch.empty((d * args.pool + max(sizes) * d * d,), dtype=torch.bool, device=dev)

        def verify_step(tree, roots, prefix, mask=mask):
            vi = dt.verify_inputs(tree, roots, prefix, mask_out=mask)
            return vi.input_ids, vi.positions

        kv_eager = torch.randn((slots, SLOT_BYTES), device=dev)
        kv_graph = kv_eager.clone()
        accept_eager = accept_fn(commit_mod, kv_eager)
        accept_graph = accept_fn(commit_mod, kv_graph)
        with torch.no_grad():
            t0 = time.perf_counter()
            vg = steps.StepGraphs(verify_step, name="verify inputs", row_widths=(1, 1),
                                  slots=1, device=dev)  # fmt: skip
            vg.capture(graphs, budget, budget)
            ag = steps.StepGraphs(
                lambda tree, target, locs, prefix: accept_graph(
                    tree, target, prefix, locs.reshape(-1)),
                name="accept", row_widths=(d, d, 1), slots=2, device=dev,
            )  # fmt: skip
            ag.capture(graphs, budget, budget)
            torch.cuda.synchronize()
            meta[f"capture_s_budget_{budget}"] = round(time.perf_counter() - t0, 2)
            for b in batches:
                hidden = torch.randn((b, args.positions, args.hidden), device=dev)
                hidden = hidden.to(torch.bfloat16)
                _, _, tree = graphs(hidden, budget, budget)
                size = graphs.last_size
                prefix_cpu = torch.randint(lo, hi, (b,))
                prefix = prefix_cpu.to(dev)
                roots = torch.randint(0, args.vocab, (b,), generator=gen).to(dev)
                numel = d * int(prefix_cpu.sum()) + b * d * d
                locs = (torch.randperm(slots - 1, generator=gen)[: b * d] + 1).to(dev)
                target = gpu_bench.following_targets(tree, args.vocab, gen).to(torch.int64)

                def verify_eager():
                    return dt.verify_inputs(tree, roots, prefix, mask_numel=numel)

                def verify_graph():
                    ids, pos = vg(size, (roots, prefix))
                    return ids, pos, mask[:numel]

                want = verify_eager()
                got = verify_graph()
                wanted = (want.input_ids, want.positions, want.tree_mask)
                for name, a, c in zip(("input_ids", "positions", "mask"), got, wanted, strict=True):
                    if not torch.equal(a, c):
                        raise AssertionError(f"budget {budget} batch {b}: verify {name} differs")
                kv_graph.copy_(kv_eager)  # the timing below moves each pool its own times
                e_out = accept_eager(tree, target, prefix, locs)
                g_out = ag(size, (target, locs.view(b, d), prefix))
                for i, (a, c) in enumerate(zip(g_out, e_out, strict=True)):
                    if not torch.equal(a, c):
                        raise AssertionError(f"budget {budget} batch {b}: accept output {i}")
                if not torch.equal(kv_graph, kv_eager):
                    raise AssertionError(f"budget {budget} batch {b}: KV after the move")
                accept_mean = float(e_out[1].float().mean())
                timed = {
                    "verify_eager": rgg.host_and_gpu_us(verify_eager, args.iters),
                    "verify_graph": rgg.host_and_gpu_us(verify_graph, args.iters),
                    "accept_eager": rgg.host_and_gpu_us(
                        lambda: accept_eager(tree, target, prefix, locs), args.iters),
                    "accept_graph": rgg.host_and_gpu_us(
                        lambda: ag(size, (target, locs.view(b, d), prefix)), args.iters),
                }  # fmt: skip
                row = {"batch": b, "budget": budget, "graph_size": size, "checked": True,
                       "accept_len_mean": round(accept_mean, 2)}  # fmt: skip
                for arm, (host, gpu) in timed.items():
                    row[f"{arm}_host_us"], row[f"{arm}_gpu_us"] = round(host, 1), round(gpu, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'batch':>5} {'budget':>6} | {'verify eager':>14} {'verify graph':>14} "
          f"| {'accept eager':>14} {'accept graph':>14}  (host / gpu µs)")  # fmt: skip
    for r in rows:
        cells = [f"{r[f'{a}_host_us']:>6} {r[f'{a}_gpu_us']:>7}"
                 for a in ("verify_eager", "verify_graph", "accept_eager", "accept_graph")]  # fmt: skip
        print(f"{r['batch']:>5} {r['budget']:>6} | {cells[0]} {cells[1]} | {cells[2]} {cells[3]}")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
