"""What ``--budget auto`` costs per round on the CPU, in process, against ``--budget 15``.

Three engines on the trained pair decode the default workload (built-in ``stdlib`` prompts,
128 new tokens, greedy, batch 1, one torch thread), taking turns request by request so that
a change of load hits them alike: DDTree at budget 15; ``auto`` as served; and ``auto`` with
its exploration switched off after the first exploration (no re-timings, no value probes),
which leaves the per-round bookkeeping alone. Wall time of the rounds (``Engine.step``), per round and in tokens per second;
the first pass is a warm-up. All three must emit the same tokens.

    PYTHONPATH=. python benchmarks/budget_auto_cpu.py [--prompts 16 --max-new 128 --passes 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_cli.bench.workloads import load_workload  # noqa: E402
from ddtree_cli.budget_policy import BudgetPolicy, PolicyConfig, candidate_budgets  # noqa: E402
from ddtree_cli.engine.decoding import Engine, RequestState  # noqa: E402
from ddtree_cli.engine.tokenizer import ByteTokenizer  # noqa: E402
from ddtree_cli.engine.weights import load_embedded_pair  # noqa: E402

NEVER = 10**9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pair = load_embedded_pair()
    tok = ByteTokenizer()
    prompts = [tok.encode(p.text) for p in load_workload("stdlib", args.prompts, seed=0)]
    arms = {
        "budget 15": Engine(pair, "ddtree", budget=15),
        "auto": Engine(pair, "ddtree", budget="auto"),
        "auto, no exploration": Engine(pair, "ddtree", budget="auto"),
    }
    quiet = PolicyConfig(probe_every=NEVER, first_reexplore=NEVER, reexplore_every=NEVER)
    arms["auto, no exploration"].policy = BudgetPolicy(candidate_budgets(16), quiet)
    seconds = dict.fromkeys(arms, 0.0)
    rounds = dict.fromkeys(arms, 0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in arms}
    for pass_ in range(args.passes + 1):  # pass 0 warms up (and explores)
        for prompt in prompts:
            for name, engine in arms.items():
                seq = RequestState(prompt, args.max_new)
                engine.add(seq)
                while engine.seqs:
                    t = time.perf_counter()
                    engine.step()
                    if pass_:
                        seconds[name] += time.perf_counter() - t
                        rounds[name] += 1
                if pass_:
                    outputs[name].append(seq.output)
    same = all(out == outputs["budget 15"] for out in outputs.values())
    base = seconds["budget 15"] / rounds["budget 15"]
    result = {
        "prompts": args.prompts,
        "max_new_tokens": args.max_new,
        "passes": args.passes,
        "identical_outputs": same,
        "arms": {
            name: {
                "rounds": rounds[name],
                "ms_per_round": round(seconds[name] / rounds[name] * 1e3, 4),
                "round_vs_budget_15": round(seconds[name] / rounds[name] / base, 4),
                "tok_s": round(sum(map(len, outputs[name])) / seconds[name], 1),
            }
            for name in arms
        },
        "auto_policy": arms["auto"].policy.snapshot(),
    }
    print(json.dumps(result, indent=2))
    if not same:
        sys.exit("the arms emitted different tokens")


if __name__ == "__main__":
    main()
