"""Per-round cost of the DDTree tree machinery on a GPU, against the reference's way.

One round = build the tree from bf16 draft logits ``[b, 15, vocab]`` + the verify inputs
(input ids, positions, FULL_MASK tree mask, retrieve_* arrays) + the verify walk + the
compaction indices. Measured side by side in one run:

- ``reference``: what liranringel/ddtree does per request (written here from the paper's
  description): top-K and log-sum-exp on the GPU, copy to the host, a Python best-first heap,
  a NumPy visibility mask, a host-to-device copy of the verify arrays, and the walk over
  ``child_maps`` after pulling the target's tokens to the host. Requests run one after another.
- ``torch eager`` / ``torch graph``: ``ddtree_cli.draft_tree`` on its pure-PyTorch path,
  launched eagerly and replayed from a CUDA graph.
- ``triton eager`` / ``triton graph``: the same functions on their fused Triton kernels.

Before timing, every configuration checks the Triton path against the PyTorch path (same
node scores, same tree up to equal-score ties, same verify arrays and walk on the same tree)
and both against the reference heap's tree value; after timing, the Triton graph's last
replay against an eager round (``triton_graph_checked``: a race between the kernels would
show there). Times are medians of CUDA-event timings.

``--baseline FILE`` (a copy of an earlier ``draft_tree.py``, e.g. from ``git show``) runs
that version's Triton round on the same inputs: its outputs must equal this one's
(``baseline_same_outputs``) and the two graphs are timed in turns (``baseline_graph_us``,
``triton_graph_paired_us``), so one call compares them on one GPU.

Usage: python benchmarks/draft_tree_gpu.py [--batches 1,8,32,64] [--budgets 16,...] [--json F]
"""

# The breakdown's stage closures run within their own loop iteration.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import functools
import heapq
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddtree_cli import draft_tree as dt  # noqa: E402

TARGETS_US = {(1, 64): 40.0, (32, 64): 150.0}


# ----------------------------------------------------------------- the reference's round


def reference_tree(lp: np.ndarray, ids: np.ndarray, budget: int):
    """Best-first heap over one request's top-K (paper Algorithm 1) + NumPy visibility."""
    n_pos, k = lp.shape
    k = min(k, budget)
    tokens, depths, parents = [0], [0], [-1]
    child_maps: list[dict[int, int]] = [{}]
    scores = [0.0]
    heap = [(-float(lp[0, 0]), (0,), 0, 1, 0, float(lp[0, 0]))]
    while heap and len(tokens) - 1 < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        index = len(tokens)
        token = int(ids[depth - 1, rank])
        tokens.append(token)
        depths.append(depth)
        parents.append(parent)
        scores.append(logw)
        child_maps.append({})
        child_maps[parent][token] = index
        if rank + 1 < k:
            sib = logw - float(lp[depth - 1, rank]) + float(lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-sib, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sib))
        if depth < n_pos:
            child = logw + float(lp[depth, 0])
            heapq.heappush(heap, (-child, ranks + (0,), index, depth + 1, 0, child))
    n = len(tokens)
    vis = np.zeros((n, n), dtype=bool)
    vis[0, 0] = True
    for i in range(1, n):
        vis[i] = vis[parents[i]]
        vis[i, i] = True
    return tokens, depths, parents, child_maps, vis, scores


def reference_round(logits, budget, roots, prefix, target):
    """One round for a batch, request by request, the way the reference code does it."""
    out = []
    for r in range(logits.shape[0]):
        k = min(budget, logits.shape[-1])
        x = logits[r].float()
        top, ids = torch.topk(x, k, dim=-1)
        lp = (top - torch.logsumexp(x, dim=-1, keepdim=True)).cpu().numpy()
        tokens, depths, parents, child_maps, vis, scores = reference_tree(
            lp, ids.cpu().numpy(), budget
        )
        dev = logits.device
        ids_dev = torch.tensor([int(roots[r])] + tokens[1:], device=dev)
        pos_dev = torch.tensor(depths, device=dev) + int(prefix[r])
        mask_dev = torch.from_numpy(vis).to(dev)
        post = target[r, : len(tokens)].tolist()
        accepted, cur, nxt = [0], 0, post[0]
        while nxt in child_maps[cur]:
            cur = child_maps[cur][nxt]
            accepted.append(cur)
            nxt = post[cur]
        out.append((scores, accepted, nxt, ids_dev, pos_dev, mask_dev))
    return out


# ----------------------------------------------------------------------- the new round


def make_round(logits, budget, roots, prefix, target, mask_numel, use_triton, module=dt):
    """One round of ``module`` (``draft_tree``, or a copy of an earlier one: ``--baseline``)."""

    def run():
        tree = module.build_tree(logits, budget, use_triton=use_triton)
        vi = module.verify_inputs(tree, roots, prefix, mask_numel=mask_numel, use_triton=use_triton)
        walk = module.verify_walk(tree, target, use_triton=use_triton)
        comp = module.compaction_indices(walk, budget + 1)
        return tree, vi, walk, comp

    return run


def load_baseline(path: Path):
    """A copy of an earlier ``draft_tree.py`` as a module of its own (``--baseline``)."""
    spec = importlib.util.spec_from_file_location("draft_tree_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def time_eager(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def capture(fn):
    """A CUDA graph of ``fn`` (after three warm-up calls) and the graph's output tensors,
    which hold the last replay's results."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(3):
        graph.replay()
    return graph, out


# A spin of about 0.1 ms in front of a queued replay (``replay_times(queued=True)``): longer
# than the host takes to enqueue the start event, the graph and the end event.
QUEUE_SPIN_CYCLES = 200_000


def replay_times(graph, iters: int, queued: bool = False) -> list[float]:
    """Each replay's time between CUDA events around it. With an idle GPU (the default) that
    includes the host's launch of the graph: the start event fires as soon as it is enqueued
    and the graph's first kernel waits for the host, as a round after a host synchronisation
    does in a server. ``queued``: a spin kernel first keeps the GPU busy while the host
    enqueues the events and the graph, so the time is the graph's on the device alone, as
    when the round is launched ahead of the GPU."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(QUEUE_SPIN_CYCLES)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return times


def block_us(fn, iters: int) -> float:
    """Device microseconds per call: CUDA events around ``iters`` calls in a row."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def time_graph(fn, iters: int, outputs: list | None = None, queued: bool = False) -> float:
    """Median replay time of a CUDA graph of ``fn`` (``replay_times``); ``outputs`` (a list)
    receives the graph's output tensors."""
    graph, out = capture(fn)
    if outputs is not None:
        outputs.append(out)
    return statistics.median(replay_times(graph, iters, queued))


def time_graph_pair(fn_a, fn_b, iters: int, rounds: int = 4) -> tuple[float, float]:
    """Median replay times of two graphs timed in turns (``rounds`` blocks of each), so
    that drift of the GPU's clocks falls on both alike."""
    (graph_a, _), (graph_b, _) = capture(fn_a), capture(fn_b)
    times_a, times_b = [], []
    for _ in range(rounds):
        times_a += replay_times(graph_a, max(1, iters // rounds))
        times_b += replay_times(graph_b, max(1, iters // rounds))
    return statistics.median(times_a), statistics.median(times_b)


def time_reference(logits, budget, roots, prefix, target, iters: int) -> float:
    reference_round(logits, budget, roots, prefix, target)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reference_round(logits, budget, roots, prefix, target)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


# ------------------------------------------------------------------------------ checks


def check_against_reference(tree: dt.DraftTree, ref) -> None:
    for r, (scores, *_rest) in enumerate(ref):
        n = int(tree.num_nodes[r])
        assert n == len(scores) - 1, (n, len(scores))
        ours = np.sort(tree.scores[r, 1 : n + 1].double().cpu().numpy())
        theirs = np.sort(np.array(scores[1:]))
        assert np.allclose(ours, theirs, atol=1e-3), "tree value differs from the heap's"


def check_topk(logits, budget) -> tuple:
    """The Triton top-K (under the current ``vocab_geom``) against the PyTorch path, on
    ``logits`` and on a heavily tied copy. Returns the PyTorch path's ``(lp, ids)`` of both
    and the Triton path's ids of both, which no block geometry may change (among equal logits
    the lowest vocabulary id comes first)."""
    lp_t, ids_t = dt._triton_topk_logprobs(logits, budget)
    lp_p, ids_p = dt.topk_logprobs(logits, budget, use_triton=False)
    assert torch.allclose(lp_t, lp_p, atol=1e-5), "top-K log-probs"
    # Equal bf16 logits may come in another order; the values at the ids must agree.
    assert torch.equal(logits.gather(-1, ids_t), logits.gather(-1, ids_p)), "top-K ids"
    # Heavy ties (integer logits: thousands of equal values per row) and a constant row.
    tied = logits.float().round()
    tied[0, 0] = 0.0
    tied = tied.to(logits.dtype)
    lp_tt, ids_tt = dt._triton_topk_logprobs(tied, budget)
    lp_tp, ids_tp = dt.topk_logprobs(tied, budget, use_triton=False)
    assert torch.allclose(lp_tt, lp_tp, atol=1e-5), "tied top-K log-probs"
    assert torch.equal(tied.gather(-1, ids_tt), tied.gather(-1, ids_tp)), "tied top-K ids"
    assert all(len(set(r)) == len(r) for r in ids_tt.reshape(-1, ids_tt.shape[-1]).tolist())
    return (lp_p, ids_p), (lp_tp, ids_tp), (ids_t, ids_tt)


def check_triton_against_torch(logits, budget, roots, prefix, target, mask_numel) -> None:
    """Each Triton kernel against the PyTorch path on the same inputs."""
    (lp_p, ids_p), (lp_tp, ids_tp), _ = check_topk(logits, budget)
    for lp, ids in ((lp_p, ids_p), (lp_tp, ids_tp)):
        check_tree(lp, ids, budget)
    tp = dt.build_tree_from_topk(lp_p, ids_p, budget, use_triton=False)
    for numel in (mask_numel, mask_numel + 4099):  # exact, and a larger static buffer
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
    wt = dt.verify_walk(tp, target, use_triton=True)
    wp = dt.verify_walk(tp, target, use_triton=False)
    for name in ("accepted", "accept_len", "bonus"):
        assert torch.equal(getattr(wt, name), getattr(wp, name)), name
    ct = dt.compaction_indices(wt, budget + 1)
    cp = dt.compaction_indices(wp, budget + 1)
    for name in ("src_slots", "src_rows", "keep"):
        assert torch.equal(getattr(ct, name), getattr(cp, name)), name


def round_differences(got, want) -> list[str]:
    """The fields in which two rounds' outputs (``make_round``) differ."""
    names = {
        "tree": ("tokens", "parents", "depths", "visibility", "num_nodes", "scores"),
        "verify": ("input_ids", "positions", "tree_mask", "mask_indptr", "retrieve_index",
                   "retrieve_next_token", "retrieve_next_sibling"),
        "walk": ("accepted", "accept_len", "bonus"),
        "compaction": ("src_slots", "src_rows", "keep"),
    }  # fmt: skip
    return [
        f"{part}.{name}"
        for (part, fields), x, y in zip(names.items(), got, want, strict=True)
        for name in fields
        if not torch.equal(getattr(x, name), getattr(y, name))
    ]


def check_tree(lp, ids, budget, floors=(1, 0)) -> None:
    """The tree kernel against the PyTorch path, with its floor from chains and without (the
    settings of ``tree_exit`` in ``floors``)."""
    tp = dt.build_tree_from_topk(lp, ids, budget, use_triton=False)
    chosen = dt._TUNING["tree_exit"]
    try:
        for exit_on in floors:
            dt._TUNING["tree_exit"] = exit_on
            tt = dt.build_tree_from_topk(lp, ids, budget, use_triton=True)
            for name in ("tokens", "parents", "depths", "visibility", "num_nodes", "scores"):
                assert torch.equal(getattr(tt, name), getattr(tp, name)), f"exit {exit_on}: {name}"
    finally:
        dt._TUNING["tree_exit"] = chosen


def following_targets(tree: dt.DraftTree, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Targets that agree with the best child of each node (long accepted paths)."""
    b, n = tree.parents.shape
    target = torch.randint(0, vocab, (b, n), generator=gen, device="cpu").to(tree.tokens.device)
    first_child = dt.verify_inputs(
        tree,
        torch.zeros(b, dtype=torch.int64, device=tree.tokens.device),
        torch.zeros(b, dtype=torch.int64, device=tree.tokens.device),
    ).retrieve_next_token
    drafted = torch.cat([torch.zeros_like(tree.tokens[:, :1]), tree.tokens], 1)
    follow = drafted.gather(1, first_child.clamp_min(0))
    return torch.where(first_child >= 0, follow, target)


def spiked(x: torch.Tensor, spike: int, gen: torch.Generator, height: float = 14.0) -> torch.Tensor:
    """A drafter unsure at the first position, sure at the next ``spike`` ones (one token
    ``height`` above the rest), unsure again after them: the tree follows the sure positions
    deep, then the flat ones end it."""
    vocab = x.shape[-1]
    for p in range(1, min(spike + 1, x.shape[1])):
        x[:, p, torch.randint(0, vocab, (1,), generator=gen)] += height
    return x


def zipf_logits(shape: tuple, gen: torch.Generator, dev, lo: float = 1.0, hi: float = 6.0):
    """float32 logits -s * log(rank + 1) per row, the rank a random permutation of the
    vocabulary (drawn on the host, sorted on ``dev``) and s log-uniform in [lo, hi] per row
    (see ``draft_logits``)."""
    b, n_pos, vocab = shape
    s = torch.empty((b, n_pos, 1)).uniform_(math.log(lo), math.log(hi), generator=gen).exp()
    u = torch.empty((b, n_pos, vocab)).uniform_(generator=gen).to(dev)
    rank = u.argsort(-1).argsort(-1)
    del u
    return -s.to(dev) * torch.log1p(rank.float())


def draft_logits(shape: tuple, kind: str, gen: torch.Generator, dev) -> torch.Tensor:
    """bf16 draft logits. ``random``: N(0, 2^2), a drafter unsure everywhere, whose best-first
    trees are one or two levels deep (the tree kernel stops after them). ``deep``: sure at
    every position after the first (one token 25 above the rest: on a 152k vocabulary its
    log-prob is about -0.003), so the tree is a few chains 15 levels deep and only rank-0
    children can enter it (the tree kernel's rank-0 shortcut, no sort). ``branchy``: after the
    first position, two likely tokens per position (25 and 24 added to two of the N(0, 2^2)
    logits), so the tree is about ten levels deep and branches on the way (levels sorted).
    ``zipf``: shaped like a language model's rows: every (request, position) row follows a
    Zipf law over a random order of the vocabulary, p(rank r) ~ (r + 1)^-s, with its own
    sharpness s, log-uniform in [1, 6] (top-1 probability from about 0.08 to 0.98), so
    sure and unsure positions alternate at random; at budget 64 the tree is 5-12 levels
    deep and nearly every depth needs a sort (the rank-0 shortcut rarely applies)."""
    if kind == "zipf":
        return zipf_logits(shape, gen, dev).to(torch.bfloat16)
    x = torch.randn(shape, generator=gen) * 2.0
    if kind == "deep":
        x = spiked(x, shape[1], gen, height=25.0)
    elif kind == "branchy":
        x = spiked(x, shape[1], gen, height=25.0)
        x = spiked(x, shape[1], gen, height=24.0)
    return x.to(dev, torch.bfloat16)


# -------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--budgets", default="16,32,64,128,256")
    ap.add_argument("--positions", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prefix", type=int, default=1024, help="tokens already in the KV cache")
    ap.add_argument(
        "--logits",
        choices=("random", "deep", "branchy", "zipf"),
        default="random",
        help="random: shallow trees; deep: sure chains; branchy: deep and branching;"
        " zipf: rows shaped like a language model's, sharpness varying by row"
        " (see draft_logits)",
    )
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--ref-iters", type=int, default=5)
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--baseline",
        type=Path,
        help="a copy of an earlier draft_tree.py: its Triton round runs on the same inputs,"
        " its outputs are compared with this one's and both graphs are timed in turns"
        " (baseline_graph_us, triton_graph_paired_us)",
    )
    ap.add_argument("--breakdown", action="store_true", help="then time each stage alone (graph)")
    ap.add_argument("--breakdown-batches", default="1,32")
    ap.add_argument("--breakdown-budgets", default="16,64,256")
    ap.add_argument("--breakdown-paths", default="torch,triton")
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="then profile the Triton round's graph at the breakdown's batches and budgets:"
        " each kernel's GPU time and the idle gap before it, per replay (torch.profiler)",
    )
    ap.add_argument(
        "--tune",
        action="store_true",
        help="first pick the kernels' warp divisors and switches (tree_rise, tree_narrow,"
        " the tree stage; pdl: the whole round) and the vocabulary pass's block sizes"
        " (vocab_geom, the top-K stage) at batch 1 and 32, budget 64 (graph), on the"
        " --logits kind",
    )
    ap.add_argument(
        "--tune-keys",
        default="",
        help="with --tune, only these settings (comma-separated _TUNING keys; default: all)",
    )
    for key, default in dt._TUNING.items():
        if isinstance(default, tuple):  # vocab_geom: CH,CPG,GPP
            ap.add_argument(
                "--" + key.replace("_", "-"),
                type=ints_arg,
                default=default,
                help=f"comma-separated (default {','.join(map(str, default))})",
            )
        else:
            ap.add_argument("--" + key.replace("_", "-"), type=type(default), default=default)
    args = ap.parse_args()
    for key in dt._TUNING:
        dt._TUNING[key] = getattr(args, key)
    try:
        dt._vocab_geom()
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    baseline = load_baseline(args.baseline) if args.baseline else None
    triton_ok = not args.no_triton and dt._triton_importable()
    rows = []
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton={triton_ok}")
    tuned = tune(args, dev, gen) if args.tune and triton_ok else None
    print(f"# tuning {json.dumps(dt._TUNING)}", flush=True)
    for b in [int(x) for x in args.batches.split(",") if x]:
        for budget in [int(x) for x in args.budgets.split(",")]:
            print(f"# batch {b}, budget {budget}: checking, then timing", flush=True)
            cell = stage_inputs(args, dev, gen, b, budget)
            logits, _, _, _, tree, roots, prefix, mask_numel, target = cell
            ref = reference_round(logits, budget, roots, prefix, target)
            check_against_reference(tree, ref)
            torch_round = make_round(logits, budget, roots, prefix, target, mask_numel, False)
            depth = tree.depths.max(1).values.float()
            row = {"batch": b, "budget": budget, "logits": args.logits,
                   "tree_depth_mean": round(float(depth.mean()), 2)}  # fmt: skip
            if triton_ok:
                triton_round = make_round(logits, budget, roots, prefix, target, mask_numel, True)
                try:
                    check_triton_against_torch(logits, budget, roots, prefix, target, mask_numel)
                    check_against_reference(triton_round()[0], ref)
                    row["triton_checked"] = True
                except AssertionError as exc:
                    row["triton_checked"] = f"MISMATCH: {exc}"
                except Exception as exc:  # e.g. a kernel that does not compile: keep going
                    row["triton_checked"] = f"ERROR: {exc!r}"[:2000]
            row["reference_us"] = time_reference(
                logits, budget, roots, prefix, target, args.ref_iters
            )
            replayed: list = []  # the timed Triton graph's outputs
            timings = [("torch_eager_us", time_eager, torch_round, args.iters // 2)]
            timings.append(("torch_graph_us", time_graph, torch_round, args.iters))
            if triton_ok:
                timings.append(("triton_eager_us", time_eager, triton_round, args.iters // 2))
                keep = functools.partial(time_graph, outputs=replayed)
                timings.append(("triton_graph_us", keep, triton_round, args.iters))
                queued = functools.partial(time_graph, queued=True)
                timings.append(("triton_graph_queued_us", queued, triton_round, args.iters))
            for key, timer, fn, iters in timings:
                try:
                    row[key] = timer(fn, iters)
                except Exception as exc:  # one failing mode must not lose the others
                    row[key.replace("_us", "_error")] = repr(exc)[:300]
            if replayed:
                # What the timed graph computed in its last replay, against an eager round:
                # the kernels are deterministic, so any difference is a race between them.
                torch.cuda.synchronize()
                diff = round_differences(replayed[0], triton_round())
                row["triton_graph_checked"] = True if not diff else f"MISMATCH: {diff}"
            if triton_ok and baseline is not None:
                base_round = make_round(
                    logits, budget, roots, prefix, target, mask_numel, True, baseline
                )
                try:
                    diff = round_differences(base_round(), triton_round())
                    row["baseline_same_outputs"] = True if not diff else f"DIFFERENT: {diff}"
                    pair = time_graph_pair(triton_round, base_round, args.iters)
                    row["triton_graph_paired_us"], row["baseline_graph_us"] = pair
                except Exception as exc:
                    row["baseline_error"] = repr(exc)[:300]
            target_us = TARGETS_US.get((b, budget))
            best = row.get("triton_graph_us", row.get("torch_graph_us", float("inf")))
            row["target_us"] = target_us
            row["target_met"] = None if target_us is None else best <= target_us
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:  # after every row: a run cut short keeps what it measured
                meta = {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "triton": triton_ok,
                    "tuning": dict(dt._TUNING),
                    "positions": args.positions,
                    "vocab": args.vocab,
                    "prefix": args.prefix,
                    "logits": args.logits,
                }
                if tuned:
                    meta["tune"] = tuned
                args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if rows:
        print_table(rows)
    if args.breakdown:
        breakdown(args, dev, gen, triton_ok)
    if args.kernels and triton_ok:
        kernel_profile(args, dev, gen)
    return 0


def ints_arg(text: str) -> tuple:
    """A comma-separated tuple of ints (``--vocab-geom 16,32,8``)."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated ints: {text!r}") from None


def stage_inputs(args, dev, gen, b: int, budget: int) -> tuple:
    """One cell's inputs for timing each stage alone: logits, budget, top-K log-probs and
    ids, a tree (PyTorch path), roots, prefix lengths, the exact mask size, targets."""
    shape = (b, args.positions, args.vocab)
    logits = draft_logits(shape, args.logits, gen, dev)
    roots = torch.randint(0, args.vocab, (b,), generator=gen).to(dev)
    prefix = torch.full((b,), args.prefix, dtype=torch.int64, device=dev)
    n = budget + 1
    numel = b * n * (args.prefix + n)
    lp, ids = dt.topk_logprobs(logits, budget, use_triton=False)
    tree = dt.build_tree_from_topk(lp, ids, budget, use_triton=False)
    target = following_targets(tree, args.vocab, gen)
    return logits, budget, lp, ids, tree, roots, prefix, numel, target


def tune(args, dev, gen) -> dict:
    """Pick each warp divisor, one after another, and the tree kernel's two switches
    together (every combination), by the summed graph time of its stage at the target
    cells. A tree setting whose trees differ from the PyTorch path's is skipped, and so is a
    block geometry of the vocabulary pass whose top-K differs from it or whose ids differ
    from those of the geometry set before tuning. Returns each setting's times per cell and
    the pick, by key (the JSON's ``meta.tune``)."""
    choices = {
        ("select_div",): (512, 256, 1024),
        ("tree_div",): (128, 256, 512, 1024),
        ("row_div",): (64, 32, 128),
        ("tree_rise", "tree_narrow"): ((0, 0), (1, 0), (0, 1), (1, 1)),
        ("pdl",): (0, 1),  # timed on the whole round: it acts between the kernels
        # (CH, CPG, GPP): the vocabulary pass's chunk width, chunks per group, groups per
        # program of its full read; each checked against the PyTorch path and against the
        # top-K ids of the geometry set before tuning, before it is timed.
        ("vocab_geom",): (
            (32, 16, 8), (16, 16, 8), (16, 32, 8), (64, 8, 8), (32, 8, 16), (64, 16, 4),
            (16, 16, 16),
        ),
    }  # fmt: skip
    cells = []
    for b in (1, 32):
        cells.append(stage_inputs(args, dev, gen, b, 64))

    def stage_fns(key, cell):
        logits, budget, lp, ids, tree, roots, prefix, numel, target = cell
        if key in ("select_div", "vocab_geom"):
            return [lambda: dt._triton_topk_logprobs(logits, budget)]
        if key == "pdl":
            return [make_round(logits, budget, roots, prefix, target, numel, True)]
        if key.startswith("tree_"):
            return [lambda: dt.build_tree_from_topk(lp, ids, budget, use_triton=True)]
        return [
            lambda: dt.verify_inputs(tree, roots, prefix, mask_numel=numel, use_triton=True),
            lambda: dt.verify_walk(tree, target, use_triton=True),
        ]

    wanted = {k for k in args.tune_keys.split(",") if k}
    unknown = wanted - {k for keys in choices for k in keys}
    if unknown:
        raise SystemExit(f"--tune-keys: not tunable: {sorted(unknown)}")
    # The top-K ids before any geometry is tried: every geometry must give these exactly.
    ids_before = []
    if not wanted or "vocab_geom" in wanted:
        ids_before = [check_topk(cell[0], cell[1])[2] for cell in cells]
    report = {}
    for keys, options in choices.items():
        if wanted and not wanted & set(keys):
            continue
        print(f"# tune {'+'.join(keys)}: checking and timing {list(options)}", flush=True)

        def use(opt, keys=keys):
            dt._TUNING.update(zip(keys, opt if len(keys) > 1 else (opt,), strict=True))

        results, per_cell = {}, {}
        for opt in options:
            use(opt)
            try:
                if keys[0].startswith("tree_"):
                    for cell in cells:
                        check_tree(cell[2], cell[3], cell[1], floors=(dt._TUNING["tree_exit"],))
                if keys[0] == "vocab_geom":
                    for cell, want in zip(cells, ids_before, strict=True):
                        got = check_topk(cell[0], cell[1])[2]
                        for g, w in zip(got, want, strict=True):
                            assert torch.equal(g, w), "top-K ids differ from the untuned geometry's"
                per_cell[opt] = [
                    sum(time_graph(fn, args.iters) for fn in stage_fns(keys[0], cell))
                    for cell in cells
                ]
                results[opt] = sum(per_cell[opt])
                # As each setting is timed: a run cut off later keeps what it measured.
                shown = [round(v, 1) for v in per_cell[opt]]
                print(f"# tune {'+'.join(keys)}={opt}: µs at batch 1, 32 -> {shown}", flush=True)
            except Exception as exc:  # a configuration that fails is skipped
                print(f"# tune {'+'.join(keys)}={opt}: {exc!r}"[:300], flush=True)
        best = min(results, key=results.get) if results else options[0]
        use(best)
        if results:
            summary = {str(k): round(v, 1) for k, v in results.items()}
            print(
                f"# tune {'+'.join(keys)}: µs summed over batch 1 and 32 -> {summary}; best {best}",
                flush=True,
            )
            cells_us = {str(k): [round(v, 1) for v in vs] for k, vs in per_cell.items()}
            print(f"# tune {'+'.join(keys)}: µs at batch 1, 32 -> {cells_us}", flush=True)
            report["+".join(keys)] = {"us_batch_1_32": cells_us, "best": str(best)}
    return report


def breakdown(args, dev, gen, triton_ok: bool) -> int:
    """Graph-replay time of each stage of the round on its own."""
    modes = [p == "triton" for p in args.breakdown_paths.split(",")]
    modes = [m for m in modes if triton_ok or not m]
    for b in [int(x) for x in args.breakdown_batches.split(",")]:
        for budget in [int(x) for x in args.breakdown_budgets.split(",")]:
            cell = stage_inputs(args, dev, gen, b, budget)
            logits, budget, lp, ids, tree, roots, prefix, numel, target = cell
            for tri in modes:
                if tri:
                    topk = lambda: dt._triton_topk_logprobs(logits, budget)  # noqa: E731
                else:
                    topk = lambda: dt.topk_logprobs(logits, budget, use_triton=False)  # noqa: E731
                stages = {
                    "topk_lse": topk,
                    "tree": lambda tri=tri: dt.build_tree_from_topk(
                        lp, ids, budget, use_triton=tri
                    ),
                    "verify_inputs": lambda tri=tri: dt.verify_inputs(
                        tree, roots, prefix, mask_numel=numel, use_triton=tri
                    ),
                    "walk": lambda tri=tri: dt.verify_walk(tree, target, use_triton=tri),
                }
                out = {k: round(time_graph(fn, args.iters), 1) for k, fn in stages.items()}
                name = "triton" if tri else "torch"
                print(json.dumps({"batch": b, "budget": budget, "path": name, **out}), flush=True)


def kernel_profile(args, dev, gen) -> None:
    """Where a replay of the Triton round's graph goes: per kernel, in launch order, its
    median GPU time and the median idle time between the previous kernel's end and its
    start; and the span from the first kernel's start to the last one's end (the replay's
    launch overhead before the first kernel is not in it). One JSON line per cell."""
    from torch.profiler import ProfilerActivity, profile

    for b in [int(x) for x in args.breakdown_batches.split(",")]:
        for budget in [int(x) for x in args.breakdown_budgets.split(",")]:
            logits, budget, _, _, _, roots, prefix, numel, target = stage_inputs(
                args, dev, gen, b, budget
            )
            fn = make_round(logits, budget, roots, prefix, target, numel, True)
            graph, _ = capture(fn)
            torch.cuda.synchronize()
            iters = max(10, args.iters)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    graph.replay()
                    torch.cuda.synchronize()
            kernels = sorted(
                (e for e in prof.events() if e.device_type.name == "CUDA"),
                key=lambda e: e.time_range.start,
            )
            per = len(kernels) // iters
            if per == 0 or per * iters != len(kernels):
                error = f"{len(kernels)} kernels in {iters} replays"
                print(json.dumps({"batch": b, "budget": budget, "kernels_error": error}))
                continue
            rows, spans = [], []
            for i in range(per):
                mine = kernels[i::per]
                gaps = [
                    k.time_range.start - kernels[j * per + i - 1].time_range.end
                    for j, k in enumerate(mine)
                ] if i else []  # fmt: skip
                rows.append({
                    "name": mine[0].name[:60],
                    "us": round(statistics.median(k.time_range.elapsed_us() for k in mine), 2),
                    "gap_before_us": round(statistics.median(gaps), 2) if gaps else None,
                })  # fmt: skip
            for j in range(iters):
                first, last = kernels[j * per], kernels[j * per + per - 1]
                spans.append(last.time_range.end - first.time_range.start)
            out = {"batch": b, "budget": budget, "logits": args.logits,
                   "span_us": round(statistics.median(spans), 2),
                   "kernel_us": round(sum(r["us"] for r in rows), 2), "kernels": rows}  # fmt: skip
            print(json.dumps(out), flush=True)


def print_table(rows) -> None:
    cols = [
        "reference_us",
        "torch_eager_us",
        "torch_graph_us",
        "triton_eager_us",
        "triton_graph_us",
        "triton_graph_queued_us",
        "triton_graph_paired_us",
        "baseline_graph_us",
    ]
    cols = [c for c in cols if any(c in r for r in rows)]
    print("| batch | budget | " + " | ".join(c.removesuffix("_us") + " (µs)" for c in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{r[c]:.1f}" if c in r else "-" for c in cols]
        print(f"| {r['batch']} | {r['budget']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
