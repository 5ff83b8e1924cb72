"""Embedded engine throughput: AR vs DFlash vs DDTree at batch 1 and 8, in one run.

Acceptance is controlled by the test drafter (``PeakedDraftHook``): the real drafter runs
every round (its cost is real), then its logits are peaked on the target's own greedy
continuation, recorded by the AR arm of the same run. With the true token always at rank 0
("peaked"), DFlash and DDTree (budget = block size - 1, so both verify 16 tokens) accept the
same full blocks, so the difference in their round time is the tree's own overhead: build,
mask, walk, KV compaction. "noisy" puts the true token at rank 0/1/2 with probability
0.6/0.3/0.1, where DDTree's siblings pay off.

On CUDA every arm replays its verify phase from CUDA graphs (the engine's default; --eager
turns them off for all arms alike). Every arm decodes the whole run once before timing, so
the graphs of the shapes it meets are captured then; captures that still happen inside the
timed runs are counted in the report. With graphs, the AR reference is also checked against
an eager AR run.

    PYTHONPATH=. python benchmarks/engine.py --config small            # CPU
    PYTHONPATH=. python benchmarks/engine.py --config trained          # CPU, the served pair
    PYTHONPATH=. python benchmarks/engine.py --config bench --device cuda  # ~100M target
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_cli.engine.decoding import Engine, RequestState  # noqa: E402
from ddtree_cli.engine.model_config import BENCH_DRAFT, BENCH_TARGET  # noqa: E402
from ddtree_cli.engine.oracle import PeakedDraftHook  # noqa: E402
from ddtree_cli.engine.weights import load_embedded_pair, random_pair  # noqa: E402

SCENARIOS = {"peaked": (1.0, 0.0, 0.0), "noisy": (0.6, 0.3, 0.1)}
# ~805M parameters: how the tree's fixed overhead compares next to a heavier verify pass.
LARGE_TARGET = replace(
    BENCH_TARGET, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, head_dim=128
)
LARGE_DRAFT = replace(
    BENCH_DRAFT, hidden_size=2048, intermediate_size=6144, head_dim=128, target_layer_ids=(1, 8, 14)
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(engine: Engine, prompts: list[list[int]], max_new: int) -> dict:
    """Prefill all prompts, then time the decode rounds only."""
    seqs = [RequestState(p, max_new) for p in prompts]
    engine.add_many(seqs)
    sync(engine.device)
    rounds = 0
    start = time.perf_counter()
    while engine.seqs:
        engine.step()
        rounds += 1
    sync(engine.device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(s.output) - 1 for s in seqs)  # the first token came from prefill
    return {
        "outputs": [s.output for s in seqs],
        "seconds": elapsed,
        "rounds": rounds,
        "tokens": tokens,
        "tok_s": tokens / elapsed,
        "round_ms": 1e3 * elapsed / rounds,
        "accept_len": tokens / max(1, sum(s.verify_ct for s in seqs)) if seqs[0].verify_ct else 1.0,
    }


def run(args) -> dict:
    device = torch.device(args.device)
    graphs = device.type == "cuda" and not args.eager
    mismatches = []
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # keep AR's reference exact for the oracle
        torch.backends.cudnn.allow_tf32 = False
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.config == "bench":
        pair = random_pair(BENCH_TARGET, BENCH_DRAFT, seed=0)
    elif args.config == "large":
        pair = random_pair(LARGE_TARGET, LARGE_DRAFT, seed=0)
    elif args.config == "trained":
        pair = load_embedded_pair()
    else:
        pair = random_pair(seed=0)
    gen = torch.Generator().manual_seed(0)
    vocab = pair.target.config.vocab_size
    context = args.prompt_len + args.max_new + 8
    results = []
    for batch in args.batches:
        prompts = [
            torch.randint(0, 256, (args.prompt_len,), generator=gen).tolist() for _ in range(batch)
        ]
        opts = {"max_batch": batch, "context_len": context, "device": device}
        opts["cuda_graphs"] = graphs
        ar = Engine(pair, "ar", **opts)
        decode(ar, prompts, 8)  # warm-up
        reference = decode(ar, prompts, args.max_new)["outputs"]
        if graphs:
            eager = Engine(pair, "ar", **{**opts, "cuda_graphs": False})
            if decode(eager, prompts, args.max_new)["outputs"] != reference:
                mismatches.append(f"ar (CUDA graphs) batch {batch}: differs from eager AR")
            del eager
        refs = {tuple(p): out for p, out in zip(prompts, reference, strict=True)}
        arms = {("ar", None): ar}
        for scenario in args.scenarios:
            for algo in ("dflash", "ddtree"):
                engine = Engine(
                    pair,
                    algo,
                    block_size=args.block_size,
                    budget=args.block_size - 1 if algo == "ddtree" else None,
                    **opts,
                )
                engine.draft_hook = PeakedDraftHook(refs, SCENARIOS[scenario], seed=1)
                decode(engine, prompts, args.max_new)  # warm-up; captures the graphs
                arms[(algo, scenario)] = engine
        captured = {key: len(engine._graphs) for key, engine in arms.items()}
        # Arms take turns within each repeat, so drift in the machine's load hits all alike.
        runs = {key: [] for key in arms}
        for _ in range(args.repeats):
            for key, engine in arms.items():
                r = decode(engine, prompts, args.max_new)
                if r["outputs"] != reference:
                    mismatches.append(f"{key} batch {batch}: output differs from AR")
                runs[key].append(r)
        replay = replay_ms(arms, batch, args.prompt_len) if graphs else {}
        for key, rs in runs.items():
            row = summary(key[0], batch, key[1], rs)
            if key in replay:
                row["verify_graph_ms"] = replay[key]
            row["timed_captures"] = len(arms[key]._graphs) - captured[key]
            if arms[key].graph_error:
                mismatches.append(f"{key} batch {batch}: graphs off: {arms[key].graph_error}")
            results.append(row)
    from ddtree_cli import draft_tree

    probe = torch.zeros(1, device=device)
    return {
        "mismatches": mismatches,
        "cuda_graphs": graphs,
        "draft_tree_path": "triton" if draft_tree._want_triton(probe, None) else "torch",
        "tree_ops_ms": tree_ops(device, vocab, args.block_size - 1, args.block_size - 1),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "config": args.config,
        "target_params": sum(p.numel() for p in pair.target.parameters()),
        "vocab": vocab,
        "block_size": args.block_size,
        "prompt_len": args.prompt_len,
        "max_new": args.max_new,
        "repeats": args.repeats,
        "results": results,
    }


def replay_ms(arms: dict, batch: int, prompt_len: int) -> dict:
    """GPU time of one replay of each arm's first verify graph (CUDA events, median of 30).

    Run between decodes: the replays advance the rows' lengths and write past them, which
    the next prefill overwrites; the lengths are reset before every replay.
    """
    out = {}
    for key, engine in arms.items():
        shapes = sorted(k for k in engine._graphs if k[0] == batch)
        if not shapes:
            continue
        graph = engine._graphs[shapes[0]].graph
        times = []
        for _ in range(30):
            engine.lens[:batch] = prompt_len
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        out[key] = statistics.median(times)
    return out


def profile_rounds(pair, device: torch.device, block_size: int, out: Path, graphs: bool) -> None:
    """torch.profiler tables of one batch-1 round of each speculative arm (for --profile)."""
    from torch.profiler import ProfilerActivity, profile

    prompt = list(range(64))
    graphs = graphs and device.type == "cuda"
    ar = Engine(pair, "ar", max_batch=1, context_len=512, device=device, cuda_graphs=graphs)
    refs = {tuple(prompt): decode(ar, [prompt], 200)["outputs"][0]}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    lines = []
    for algo in ("dflash", "ddtree"):
        engine = Engine(
            pair,
            algo,
            block_size=block_size,
            budget=block_size - 1,
            max_batch=1,
            context_len=512,
            device=device,
            cuda_graphs=graphs,
        )
        engine.draft_hook = PeakedDraftHook(refs, SCENARIOS["peaked"], seed=1)
        engine.add(RequestState(prompt, 200))
        for _ in range(3):
            engine.step()
        sync(device)
        with profile(activities=activities) as prof:
            for _ in range(5):
                engine.step()
            sync(device)
        lines.append(f"== {algo}: 5 rounds, batch 1 ==")
        lines.append(prof.key_averages().table(sort_by=sort_by, row_limit=30))
    out.write_text("\n".join(lines))


def tree_ops(device: torch.device, vocab: int, positions: int, budget: int) -> dict:
    """Time of the tree's own operations at batch 1 (mean over 200 calls, synchronised)."""
    from ddtree_cli import draft_tree

    logits = torch.randn(1, positions, vocab, device=device)
    tree = draft_tree.build_tree(logits, budget)
    target = torch.randint(0, vocab, (1, budget + 1), device=device)
    ops = {
        "build_tree": lambda: draft_tree.build_tree(logits, budget),
        "verify_walk": lambda: draft_tree.verify_walk(tree, target),
        "argmax_chain (DFlash's equivalent)": lambda: logits.argmax(-1),
    }
    if device.type == "cpu":
        from ddtree_cli.engine import cpu_tree  # what the engine runs on the CPU

        ops["cpu_tree.build_tree"] = lambda: cpu_tree.build_tree(logits, budget)
        ops["cpu_tree.verify_walk"] = lambda: cpu_tree.verify_walk(tree, target)
    out = {}
    for name, fn in ops.items():
        for _ in range(10):
            fn()
        sync(device)
        start = time.perf_counter()
        for _ in range(200):
            fn()
        sync(device)
        out[name] = 1e3 * (time.perf_counter() - start) / 200
    return out


def summary(algo, batch, scenario, runs) -> dict:
    med = statistics.median
    return {
        "algo": algo,
        "batch": batch,
        "drafter": scenario or "-",
        "tok_s": med(r["tok_s"] for r in runs),
        "round_ms": med(r["round_ms"] for r in runs),
        "accept_len": med(r["accept_len"] for r in runs),
        "rounds": runs[0]["rounds"],
    }


def table(report: dict) -> str:
    rows = [
        "| batch | drafter | algo | tokens/s | round (ms) | accept length "
        "| DDTree round / DFlash round | verify graph (ms) |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    by_key = {(r["batch"], r["drafter"], r["algo"]): r for r in report["results"]}
    for r in report["results"]:
        ratio = ""
        if r["algo"] == "ddtree":
            chain = by_key[(r["batch"], r["drafter"], "dflash")]
            ratio = f"{r['round_ms'] / chain['round_ms']:.3f}"
        replay = f"{r['verify_graph_ms']:.3f}" if "verify_graph_ms" in r else ""
        rows.append(
            f"| {r['batch']} | {r['drafter']} | {r['algo']} | {r['tok_s']:.0f} | "
            f"{r['round_ms']:.2f} | {r['accept_len']:.2f} | {ratio} | {replay} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", choices=["small", "bench", "large", "trained"], default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--scenarios", nargs="+", default=["peaked", "noisy"], choices=list(SCENARIOS))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (0: torch default)")
    p.add_argument("--out", type=Path)
    p.add_argument("--profile", type=Path, help="also write per-op profiles of one round here")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (all arms alike)")
    args = p.parse_args()
    report = run(args)
    if args.profile:
        pair = {"bench": (BENCH_TARGET, BENCH_DRAFT), "large": (LARGE_TARGET, LARGE_DRAFT)}.get(
            args.config
        )
        profile_rounds(
            random_pair(*pair) if pair else random_pair(),
            torch.device(args.device),
            args.block_size,
            args.profile,
            not args.eager,
        )
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)
    print(table(report))
    if report["mismatches"]:
        raise SystemExit("outputs differ from AR: " + "; ".join(report["mismatches"]))


if __name__ == "__main__":
    main()
