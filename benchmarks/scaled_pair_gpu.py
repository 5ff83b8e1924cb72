"""The scaled pair on a GPU: exact in float32, costs what Qwen3-8B costs, agrees in SGLang.

Three steps, each one call (docs/scaled-pair.md has the commands and what each shows):

- ``exact``: the shipped pair and its Qwen3-8B-shaped scaling, both in float32 on the GPU in
  the engine's own model code (33 GB of target): logits at every real token of held-out
  prompts (max |diff|, argmax agreement, the extra vocabulary's lowest margin below the
  winner), then greedy AR, DFLASH and DDTREE outputs and accepted tokens per round, small
  against scaled;
- ``cost``: the verify forward (a block of ``width`` tokens per request against a context of
  ``--context`` tokens, as the target's verify pass is) of the scaled targets (``dense``, the
  default construction, and ``sparse``, the first one: ``--constructions``) and of a
  random-weight Qwen3-8B-shaped target, all bf16 and replayed from CUDA graphs, interleaved
  in the same run, batch 1/8/32 x width 16/64: median ms and each ratio to random;
- ``agree``: two sets of SGLang servers started by ``run.py serve`` (plain, dflash, ddtree),
  the scaled pair's on one port base and the small pair's on another: greedy outputs of each
  arm, scaled against small, with the first divergence and both plain servers' top-2 margins
  there, and each speculative arm's acceptance (tokens per verify round) for both pairs.

Usage (repository root, torch on the machine; ``agree`` needs only the standard library):

    python3 benchmarks/scaled_pair_gpu.py exact --out exact.json [--construction sparse]
    python3 benchmarks/scaled_pair_gpu.py cost --out cost.json [--constructions dense]
    python3 benchmarks/scaled_pair_gpu.py agree --prompt-file heldout --out agree.json \
        [--scaled-base 30000 --small-base 31000 --prompts 100 --max-new 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ARMS = ("plain", "dflash", "ddtree")
CONSTRUCTIONS = ("dense", "sparse")  # ddtree_cli.engine.scaled's (torch-free import here)


def constructions(value: str) -> list[str]:
    names = [v for v in value.split(",") if v]
    if not names or set(names) - set(CONSTRUCTIONS):
        raise argparse.ArgumentTypeError(f"{value!r}: a comma list of {', '.join(CONSTRUCTIONS)}")
    return names


# ------------------------------------------------------------------------ prompts


def heldout_prompts(count: int, length: int) -> list[list[int]]:
    """Byte-token windows of the stdlib files the trained pair never saw (its held-out
    split): the bundle's rule (``prepare.heldout_prompts``) with 8 windows per file, so the
    first prompts come from as many files as possible."""
    sys.path.insert(0, str(REPO / "benchmarks" / "sglang_h200"))
    from prepare import heldout_prompts as bundle_heldout_prompts

    return bundle_heldout_prompts(count, length, per_file=8)


def read_prompts(path: str | None, count: int, length: int) -> list[list[int]]:
    """``path``: JSONL of ``{"input_ids": [...]}``, or a bare name for the bundle's
    ``prompts/<name>.jsonl`` under run.py's state folder; none: :func:`heldout_prompts`."""
    if not path:
        return heldout_prompts(count, length)
    file = Path(path)
    if not file.is_file():
        state = Path(os.environ.get("DDTREE_H200_STATE", "/tmp/ddtree-h200"))
        file = state / "bundle" / "prompts" / f"{path}.jsonl"
    rows = [json.loads(line)["input_ids"] for line in file.read_text().splitlines() if line]
    if len(rows) < count:
        raise SystemExit(f"{path}: {len(rows)} prompts, {count} asked for")
    return rows[:count]


# ------------------------------------------------------------------------ exact


def logits(pair, ids: list[int], device):
    import torch

    n = len(ids)
    cache = pair.target.new_cache(1, n, device, next(pair.target.parameters()).dtype)
    pos = torch.arange(n, device=device).unsqueeze(0)
    mask = (pos.unsqueeze(-1) >= pos.unsqueeze(-2)).unsqueeze(1)
    with torch.no_grad():
        hidden, _ = pair.target(torch.tensor([ids], device=device), pos, cache, pos, mask)
        return pair.target.logits(hidden)[0].float()


def get_scale(name: str):
    """A named scale; ``reduced``: the CPU tests' shape (to try the steps without a GPU)."""
    from ddtree_cli.engine.scaled import SCALES, reduced_scale

    return reduced_scale() if name == "reduced" else SCALES[name]


def cmd_exact(args) -> dict:
    import torch

    from ddtree_cli.engine.decoding import Engine, generate
    from ddtree_cli.engine.scaled import scale_pair
    from ddtree_cli.engine.weights import load_embedded_pair

    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(args.device)
    small = load_embedded_pair()
    t0 = time.perf_counter()
    scaled = scale_pair(small, get_scale(args.scale), device=device, seed=args.seed,
                        construction=args.construction)  # fmt: skip
    big = scaled.model_pair(device, torch.float32)
    build_s = time.perf_counter() - t0
    small.target.to(device)
    small.drafter.to(device)
    real = small.target.config.vocab_size
    prompts = read_prompts(args.prompt_file, args.prompts, args.prompt_len)
    worst, margin, argmax_equal = 0.0, float("inf"), 0
    for ids in prompts:
        want, got = logits(small, ids, device), logits(big, ids, device)
        worst = max(worst, float((got[:, :real] - want).abs().max()))
        argmax_equal += bool(torch.equal(got.argmax(-1), want.argmax(-1)))
        gap = want.max(-1).values - got[:, real:].max(-1).values
        margin = min(margin, float(gap.min()))
    report = {
        "scale": args.scale,
        "construction": args.construction,
        "build_and_load_s": round(build_s, 1),
        "prompts": len(prompts),
        "prompt_len": args.prompt_len,
        "logits_max_abs_diff_real_tokens": worst,
        "argmax_equal_prompts": argmax_equal,
        "extra_vocab_min_margin_below_winner": margin,
        "decode": {},
    }
    few = prompts[: args.decode_prompts]
    for algo in ("ar", "dflash", "ddtree"):
        runs = {}
        for name, pair in (("small", small), ("scaled", big)):
            engine = Engine(pair, algo, budget=64 if algo == "ddtree" else None, max_batch=8,
                            context_len=args.prompt_len + args.max_new + 8,
                            device=device, cuda_graphs=False)  # fmt: skip
            seqs = generate(engine, few, args.max_new)
            runs[name] = (
                [s.output for s in seqs],
                [(s.verify_ct, s.accepted_tokens) for s in seqs],
            )
            del engine
        same = sum(a == b for a, b in zip(runs["small"][0], runs["scaled"][0], strict=True))
        entry = {"prompts": len(few), "max_new": args.max_new, "identical_outputs": same}
        if algo != "ar":
            for name in runs:
                rounds, accepted = map(sum, zip(*runs[name][1], strict=True))
                entry[f"accept_length_{name}"] = round(accepted / max(rounds, 1), 4)
            entry["identical_rounds"] = runs["small"][1] == runs["scaled"][1]
        report["decode"][algo] = entry
    return report


# ------------------------------------------------------------------------ cost


def random_target(cfg, device, dtype):
    """A Qwen3-8B-shaped target with random weights (std 0.02 matrices, unit norms)."""
    import torch

    from ddtree_cli.engine.target import Qwen3Target

    with torch.device(device):
        target = Qwen3Target(cfg).to(dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    return target.eval()


def graph_forward(target, batch: int, width: int, context: int, device):
    """A CUDA graph of one verify forward: ``width`` new tokens per request after
    ``context`` cached ones (all visible; the mask's pattern does not change the work)."""
    import torch

    dtype = next(target.parameters()).dtype
    span = context + width
    cache = target.new_cache(batch, span, device, dtype)
    ids = torch.randint(0, 260, (batch, width), device=device)
    pos = (context + torch.arange(width, device=device)).expand(batch, width).contiguous()
    mask = torch.ones(batch, 1, width, span, dtype=torch.bool, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):
            hidden, _ = target(ids, pos, cache, pos, mask)
            target.logits(hidden)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        hidden, _ = target(ids, pos, cache, pos, mask)
        target.logits(hidden)
    return graph, cache


def time_graph(graph, reps: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def cmd_cost(args) -> dict:
    import torch

    from ddtree_cli.engine.scaled import scale_pair
    from ddtree_cli.engine.weights import load_embedded_pair

    device = torch.device("cuda")
    t0 = time.perf_counter()
    small = load_embedded_pair()
    models = {}
    for construction in args.constructions:
        scaled = scale_pair(small, get_scale(args.scale), device=device, seed=args.seed,
                            construction=construction)  # fmt: skip
        models[construction] = scaled.model_pair(device, torch.bfloat16).target
        torch.cuda.empty_cache()
    models["random"] = random_target(scaled.target_config, device, torch.bfloat16)
    report = {"scale": args.scale, "context": args.context, "constructions": args.constructions,
              "build_s": round(time.perf_counter() - t0, 1), "cells": []}  # fmt: skip
    for batch in args.batches:
        for width in args.widths:
            # (graph, cache): the cache must live as long as the graph that writes into it.
            graphs = {n: graph_forward(m, batch, width, args.context, device)
                      for n, m in models.items()}  # fmt: skip
            times: dict[str, list[float]] = {n: [] for n in models}
            for g, _ in graphs.values():
                time_graph(g, 3)  # warm
            names = list(graphs)
            for r in range(args.rounds):  # interleaved, the order rotating every round
                for n in names[r % len(names) :] + names[: r % len(names)]:
                    times[n].append(time_graph(graphs[n][0], args.reps))
            med = {n: statistics.median(v) for n, v in times.items()}
            report["cells"].append({
                "batch": batch, "width": width,
                **{f"{n}_ms": round(m, 3) for n, m in med.items()},
                **{f"ratio_{n}": round(med[n] / med["random"], 4) for n in args.constructions},
                "spread_ms": {n: [round(min(v), 3), round(max(v), 3)] for n, v in times.items()},
            })  # fmt: skip
            print(json.dumps(report["cells"][-1]), flush=True)
            del graphs
            torch.cuda.empty_cache()
    for n in args.constructions:
        report[f"max_ratio_deviation_{n}"] = max(
            abs(c[f"ratio_{n}"] - 1.0) for c in report["cells"]
        )
    return report


# ------------------------------------------------------------------------ agree (SGLang)


def http(port: int, body: dict, timeout: float = 600) -> dict | list:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read().decode())
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"port {port}: HTTP {exc.code}: {exc.read().decode()[:300]}") from None


def generate(port: int, rows, max_new: int, **extra):
    body = {"input_ids": rows, "sampling_params":
            {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}, **extra}  # fmt: skip
    return http(port, body)


def top2_margin(port: int, ids: list[int]) -> float:
    out = generate(port, ids, 1, return_logprob=True, top_logprobs_num=2)
    top = out["meta_info"]["output_top_logprobs"][0]
    return top[0][0] - top[1][0]


def acceptance(rows: list[dict]) -> float | None:
    verify = sum(r["meta_info"].get("spec_verify_ct", 0) for r in rows)
    tokens = sum(r["meta_info"].get("completion_tokens", len(r["output_ids"])) for r in rows)
    return round(tokens / verify, 4) if verify else None


def cmd_agree(args) -> dict:
    prompts = read_prompts(args.prompt_file, args.prompts, args.prompt_len)
    bases = {"scaled": args.scaled_base, "small": args.small_base}
    report = {"prompts": len(prompts), "max_new_tokens": args.max_new, "arms": {}}
    for i, arm in enumerate(ARMS):
        rows = {pair: generate(base + i, prompts, args.max_new) for pair, base in bases.items()}
        diverged = []
        for p, (a, b) in enumerate(zip(rows["small"], rows["scaled"], strict=True)):
            ref, got = a["output_ids"], b["output_ids"]
            at = next((j for j, (x, y) in enumerate(zip(ref, got, strict=False)) if x != y), None)
            if at is None:
                continue
            prefix = prompts[p] + ref[:at]
            diverged.append({
                "prompt": p, "position": at, "small": ref[at], "scaled": got[at],
                "small_plain_top2_margin": top2_margin(bases["small"], prefix),
                "scaled_plain_top2_margin": top2_margin(bases["scaled"], prefix),
            })  # fmt: skip
        entry = {"identical": len(prompts) - len(diverged), "diverged": diverged}
        if arm != "plain":
            entry["accept_length"] = {pair: acceptance(r) for pair, r in rows.items()}
        report["arms"][arm] = entry
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("exact", "cost", "agree"):
        s = sub.add_parser(name)
        s.add_argument("--out", required=True)
        s.add_argument("--scale", default="qwen3-8b")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--prompt-file", help="JSONL of input_ids (default: held-out stdlib)")
        s.add_argument("--prompt-len", type=int, default=64)
    sub.choices["exact"].add_argument("--prompts", type=int, default=32)
    sub.choices["exact"].add_argument("--device", default="cuda")
    sub.choices["exact"].add_argument("--decode-prompts", type=int, default=8)
    sub.choices["exact"].add_argument("--max-new", type=int, default=64)
    sub.choices["exact"].add_argument("--construction", choices=CONSTRUCTIONS, default="dense")
    cost = sub.choices["cost"]
    cost.add_argument(
        "--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8, 32]
    )
    cost.add_argument("--widths", type=lambda v: [int(x) for x in v.split(",")], default=[16, 64])
    cost.add_argument("--context", type=int, default=1024)
    cost.add_argument("--rounds", type=int, default=7)
    cost.add_argument("--reps", type=int, default=10)
    cost.add_argument(
        "--constructions", type=constructions, default=list(CONSTRUCTIONS),
        help="scaled targets timed against the random one (default: dense,sparse)",
    )  # fmt: skip
    agree = sub.choices["agree"]
    agree.add_argument("--prompts", type=int, default=100)
    agree.add_argument("--max-new", type=int, default=64)
    agree.add_argument("--scaled-base", type=int, default=30000)
    agree.add_argument("--small-base", type=int, default=31000)
    args = p.parse_args(argv)
    report = globals()[f"cmd_{args.command}"](args)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    summary = {k: v for k, v in report.items() if k not in ("cells", "arms")}
    for arm, entry in report.get("arms", {}).items():
        margins = [d["small_plain_top2_margin"] for d in entry["diverged"]]
        summary[arm] = {"identical": entry["identical"], "max_margin": max(margins, default=None),
                        "accept_length": entry.get("accept_length")}  # fmt: skip
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
