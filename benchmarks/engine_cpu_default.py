"""The embedded default on the CPU, in process and in CPU time: DFlash vs DDTree.

``ddtree bench --algo ddtree`` with no flags runs one ``ddtree serve`` per arm and measures
wall time, which on a shared machine moves with everyone else's load. This script runs the
same work (the default workload: built-in ``stdlib`` prompts, 128 new tokens, greedy, batch
1, one torch thread) on the same trained pair in one process and counts the thread's CPU
time, which is what the run would take on an idle core. Arms take turns in every repeat:
DFlash, DDTree as the engine runs it on the CPU (``engine/cpu_tree.py``), and DDTree with
``draft_tree``'s batched PyTorch path (what the engine ran on the CPU before). All three must
emit the same tokens.

Two figures per arm: whole requests (prefill included, as the bench counts them) in tokens
per CPU second, and the steady-state round: one verify round repeated on a fixed prefix.

    PYTHONPATH=. python benchmarks/engine_cpu_default.py [--prompts 16 --max-new 128 --repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_cli import draft_tree  # noqa: E402
from ddtree_cli.bench.workloads import load_workload  # noqa: E402
from ddtree_cli.engine.decoding import Engine, RequestState  # noqa: E402
from ddtree_cli.engine.tokenizer import ByteTokenizer  # noqa: E402
from ddtree_cli.engine.weights import load_embedded_pair  # noqa: E402


def engines(pair) -> dict[str, Engine]:
    arms = {"dflash": Engine(pair, "dflash"), "ddtree": Engine(pair, "ddtree")}
    old = Engine(pair, "ddtree")
    old._tree = draft_tree  # the batched PyTorch path, as before cpu_tree
    arms["ddtree (draft_tree path)"] = old
    return arms


def whole_requests(engine: Engine, prompts: list[list[int]], max_new: int) -> dict:
    start = time.thread_time()
    outputs, rounds, tokens = [], 0, 0
    for prompt in prompts:
        seq = RequestState(prompt, max_new)
        engine.add(seq)
        while engine.seqs:
            engine.step()
        outputs.append(seq.output)
        rounds += seq.verify_ct
        tokens += len(seq.output)
    return {"cpu_s": time.thread_time() - start, "rounds": rounds, "tokens": tokens,
            "outputs": outputs}  # fmt: skip


def steady_rounds(arms: dict[str, Engine], prompt: list[int], rounds: int) -> dict[str, list]:
    """CPU seconds of one round on a fixed prefix, arms taking turns."""
    for engine in arms.values():
        engine.add(RequestState(prompt, engine.context_len - len(prompt)))
        for _ in range(4):
            engine.step()
    times: dict[str, list] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, engine in arms.items():
            seq = engine.seqs[0]
            lens, roots, produced = engine.lens.clone(), engine.roots.clone(), len(seq.output)
            start = time.thread_time()
            engine.step()
            times[name].append(time.thread_time() - start)
            # Back to the same prefix: the next round sees the same lengths and spans.
            engine.lens.copy_(lens)
            engine.roots.copy_(roots)
            del seq.output[produced:]
    for engine in arms.values():
        engine.drop(engine.seqs[0])
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dataset", default="stdlib")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steady-rounds", type=int, default=40, help="per prompt, per arm")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    tok = ByteTokenizer()
    prompts = [
        tok.encode(q.text) if q.text is not None else list(q.input_ids)
        for q in load_workload(args.dataset, args.prompts, seed=0)
    ]
    pair = load_embedded_pair()
    arms = engines(pair)
    load_before = os.getloadavg()
    runs: dict[str, list] = {name: [] for name in arms}
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):  # the first is a warm-up
            for name, engine in arms.items():
                r = whole_requests(engine, prompts, args.max_new)
                if r["outputs"] != (runs["dflash"] or [r])[0]["outputs"]:
                    raise SystemExit(f"{name}: output differs from dflash's")
                if repeat:
                    runs[name].append(r)
        steady: dict[str, list] = {name: [] for name in arms}
        for prompt in prompts[:8]:
            for name, t in steady_rounds(arms, prompt, args.steady_rounds).items():
                steady[name] += t
    rows = []
    for name, rs in runs.items():
        cpu = statistics.median(r["cpu_s"] for r in rs)
        rows.append({
            "arm": name, "cpu_s": cpu, "cpu_s_runs": [round(r["cpu_s"], 3) for r in rs],
            "tokens": rs[0]["tokens"], "rounds": rs[0]["rounds"],
            "accept_length": rs[0]["tokens"] / rs[0]["rounds"],
            "tok_per_cpu_s": rs[0]["tokens"] / cpu,
            "steady_round_ms": 1e3 * statistics.median(steady[name]),
        })  # fmt: skip
    base = rows[0]
    for row in rows:
        row["tok_per_cpu_s_vs_dflash"] = row["tok_per_cpu_s"] / base["tok_per_cpu_s"]
        row["steady_round_vs_dflash"] = row["steady_round_ms"] / base["steady_round_ms"]
    report = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "dataset": args.dataset, "prompts": args.prompts, "max_new": args.max_new,
        "repeats": args.repeats, "rows": rows,
    }  # fmt: skip
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)
    print("| arm | accept length | tokens / CPU s | vs DFlash | steady round (ms) | vs DFlash |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['arm']} | {r['accept_length']:.2f} | {r['tok_per_cpu_s']:.0f} | "
              f"{r['tok_per_cpu_s_vs_dflash']:.3f} | {r['steady_round_ms']:.2f} | "
              f"{r['steady_round_vs_dflash']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
