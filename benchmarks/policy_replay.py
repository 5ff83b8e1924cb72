"""``--budget auto``'s choice against every fixed budget, replayed on real trees' statistics.

Two steps:

``record``: the embedded engine (the trained pair, CPU, greedy, batch 1) decodes built-in
workloads with every round at the largest candidate budget. The best-first tree is a prefix
order, so each such round gives every candidate's tree value and the drafted tokens that
candidate's tree would have accepted (``Engine``'s own prefix statistics). The rounds go to
a JSON file, per workload and prompt.

``replay``: the budget policy runs over those rounds as the patched SGLang worker drives it
(``ddtree_worker.py``): ``plan`` each round, the round's time to ``observe_time`` at once
(a probe below the largest budget reported as ``wide``), the trees' statistics on probe
rounds and one in 32 others, a round late (``observe_stats``). A round at budget ``B``
commits ``1 + accepted(B)`` tokens and costs the GPU's measured round time at width
``B + 1`` (from a map's policy snapshot, below) times a noise factor drawn per round, the
same draws for every arm. Every fixed budget is replayed on the same rounds: the baseline,
in the same run. Each workload's prompts run ``--trials`` times in a row, as a bench's
trials do, so that the policy sees as many rounds as on a server.

Policies replayed (``POLICIES``): the current one; ``per-budget ratios``, the calibration
before the paired added ratios (each budget's accepted / value over the rounds it ran,
shrunk towards the ratio below it), kept here as the comparison; and the current one with
a 2 % hysteresis instead of 5 %. A round at another width than the round before costs
``--switch-ms`` more (on the H200 a re-timing's first round cost 0.5-1.3 ms more than the
width's rounds, docs/performance.md).

A replayed round is one round of the recorded decode: a round at a smaller budget would
have committed fewer tokens and so started the next round elsewhere in the text, which the
replay does not follow. Each round is a sample of what the trees would accept at that point
of a text, which is what the policy estimates.

    PYTHONPATH=. .venv/bin/python benchmarks/policy_replay.py record --out traces.json
    PYTHONPATH=. .venv/bin/python benchmarks/policy_replay.py replay traces.json [--json out]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_cli.bench.workloads import BUILTIN, load_workload  # noqa: E402
from ddtree_cli.budget_policy import (  # noqa: E402
    BudgetPolicy,
    Plan,
    PolicyConfig,
    _Ratio,
    candidate_budgets,
)

BLOCK = 16  # the trained pair's drafter block
OBSERVE_EVERY = 32  # ddtree_worker.py: statistics on one in 32 rounds besides the probes

# Round time in ms per candidate budget (verify width B + 1), from the policies' snapshots
# of patched SGLang 0.5.13 with round graphs on the 8B-cost pair: ``round_ms`` of a batch
# bucket in ``A-c*.auto-graphs-policy.json`` of the results folder named.
COSTS = {
    "H100 bucket 1 (b32_set2)": {15: 11.074, 32: 11.0716, 64: 11.9122},
    "H100 bucket 1 (b32)": {15: 10.7974, 32: 11.0296, 64: 11.9432},
    "H100 bucket 2 (b32)": {15: 13.2212, 32: 13.1662, 64: 13.7198},
    "H100 bucket 4 (b32_set2)": {15: 11.7334, 32: 12.1135, 64: 13.7708},
    "H100 bucket 8 (b32_set2)": {15: 13.0498, 32: 14.4916, 64: 17.8338},
    "H100 bucket 32 (b32_set2)": {15: 22.8585, 32: 35.6766, 64: 56.4599},
}
COST_SOURCE = "benchmarks/results/sglang_h100_2026-12-07_{b32,b32_set2}/"


class PerBudgetRatios(BudgetPolicy):
    """The calibration before the paired added ratios: each budget's own accepted / value
    over the rounds at it or above, shrunk towards the next smaller budget's ratio with
    ``calibration_prior`` request-rounds of its mean value."""

    def __init__(self, budgets, config=None):
        super().__init__(budgets, config)
        self._own = {b: _Ratio() for b in self.budgets}

    def _record_stats(self, batch, values, accepted) -> None:
        for b, count in accepted.items():  # before the choice the statistics end with
            self._own[b].add(count, values[b], self.config.calibration_decay)
        super()._record_stats(batch, values, accepted)

    def calibration(self, budget: int) -> float:
        ratio = 1.0
        for i, b in enumerate(self.budgets):
            own, mean = self._own[b], self._values[b]
            scale = mean.value if mean.n and mean.value > 0 else 1.0
            prior = self.config.calibration_prior * scale if i else 0.0
            if own.predicted + prior > 0:
                ratio = (own.accepted + prior * ratio) / (own.predicted + prior)
            if b == budget:
                return ratio
        raise ValueError(budget)

    def expected_acceptance(self, budget: int) -> float | None:
        value = self._values[budget]
        return self.calibration(budget) * value.value if value.n else None


# Name: (policy class, PolicyConfig fields other than the defaults). The hysteresis rows
# show what the margin towards the smallest candidate costs on these rounds (the GPU runs
# gave it its reason: rounds dearer end to end than the policy's round times say).
POLICIES = {
    "auto": (BudgetPolicy, {}),
    "auto, per-budget ratios": (PerBudgetRatios, {}),
    "auto, hysteresis 2 %": (BudgetPolicy, {"hysteresis": 0.02}),
}


# ---- record ----------------------------------------------------------------------------


class _Recorder:
    """Stands in for the engine's policy: every round at the largest candidate, its prefix
    statistics (every candidate's value and accepted count) kept."""

    def __init__(self, budgets):
        self.budgets = tuple(budgets)
        self.rounds: list[list[list[float]]] = []

    def plan(self, batch: int) -> Plan:
        return Plan(self.budgets[-1], probe=False)

    def observe_prefix(self, batch, budget, *, seconds, values, accepted, probe=None):
        self.rounds.append([[round(v, 5) for v in values], [float(a) for a in accepted]])


def record(args) -> None:
    from ddtree_cli.engine.decoding import Engine, RequestState
    from ddtree_cli.engine.tokenizer import ByteTokenizer
    from ddtree_cli.engine.weights import load_embedded_pair

    torch.set_num_threads(args.threads)
    pair, tok = load_embedded_pair(), ByteTokenizer()
    engine = Engine(pair, "ddtree", budget="auto")
    recorder = _Recorder(engine.policy.budgets)
    engine.policy = recorder
    traces = {}
    for name in args.workloads:
        prompts = []
        for prompt in load_workload(name, args.prompts, seed=0):
            start = len(recorder.rounds)
            engine.add(RequestState(tok.encode(prompt.text), args.max_new))
            while engine.seqs:
                engine.step()
            prompts.append(recorder.rounds[start:])
        traces[name] = prompts
        rounds = sum(map(len, prompts))
        print(f"{name}: {len(prompts)} prompts, {rounds} rounds", file=sys.stderr)
    out = {
        "what": "per round at budget 64: [values, accepted] of candidates "
        f"{list(recorder.budgets)}, batch 1, greedy, trained pair, CPU",
        "candidates": list(recorder.budgets),
        "max_new_tokens": args.max_new,
        "workloads": traces,
    }
    Path(args.out).write_text(json.dumps(out))


# ---- replay ----------------------------------------------------------------------------


def replay_one(policy, rounds, costs, noise, probe_extra_ms, switch_ms):
    """One policy over ``rounds`` ([values, accepted] per round): committed tokens, seconds,
    rounds per budget and width changes."""
    budgets = policy.budgets
    tokens = seconds = 0.0
    used = dict.fromkeys(budgets, 0)
    pending = last = None
    switches = 0
    for i, (values, accepted) in enumerate(rounds):
        plan = policy.plan(1)
        b = plan.budget
        k = budgets.index(b) + 1
        wide = plan.probe and b < budgets[-1]
        t = costs[b] * noise[i] + (probe_extra_ms if wide else 0.0)
        if last is not None and b != last:  # the first round at another width
            t += switch_ms
            switches += 1
        last = b
        policy.observe_time(1, b, t / 1e3, wide=wide)
        if pending is not None:
            policy.observe_stats(1, pending[0], **pending[1])
            pending = None
        if plan.probe or (i + 1) % OBSERVE_EVERY == 0:
            stats = policy.prefix_stats(values[:k], accepted[:k], values if plan.probe else None)
            pending = (b, stats)
        tokens += 1 + accepted[k - 1]
        seconds += t / 1e3
        used[b] += 1
    return tokens, seconds, used, switches


def noise_draws(n: int, seed: int, sigma: float) -> list[float]:
    """A round's time factor, per round: log-normal with ``sigma``, times 3 in 1 % of rounds
    (an outlier: a graph's first replay, another process's burst)."""
    rng = random.Random(seed)
    return [
        math.exp(rng.gauss(0.0, sigma)) * (3.0 if rng.random() < 0.01 else 1.0) for _ in range(n)
    ]


def replay(args) -> None:
    data = json.loads(Path(args.traces).read_text())
    budgets = tuple(data["candidates"])
    if budgets != candidate_budgets(BLOCK):
        sys.exit(f"{args.traces}: candidates {list(budgets)}, not the block-16 drafter's")
    rows = []
    for workload, prompts in data["workloads"].items():
        rounds = [r for _ in range(args.trials) for prompt in prompts for r in prompt]
        for cost_name, costs in COSTS.items():
            for seed in range(args.seeds):
                noise = noise_draws(len(rounds), seed, args.noise)
                fixed = {}
                for b in budgets:
                    k = budgets.index(b) + 1
                    tokens = sum(1 + acc[k - 1] for _, acc in rounds)
                    secs = sum(costs[b] * n for n in noise) / 1e3
                    fixed[b] = tokens / secs
                best = max(fixed, key=fixed.get)
                row = {
                    "workload": workload,
                    "costs": cost_name,
                    "seed": seed,
                    "rounds": len(rounds),
                    "fixed_tok_s": {str(b): round(r, 1) for b, r in fixed.items()},
                    "best_fixed": best,
                }
                for name, (cls, fields) in POLICIES.items():
                    policy = cls(budgets, PolicyConfig(**fields))
                    tokens, secs, used, switches = replay_one(
                        policy, rounds, costs, noise, args.probe_extra_ms, args.switch_ms
                    )
                    row[name] = {
                        "vs_best_fixed": round(tokens / secs / fixed[best], 4),
                        "rounds_at": {str(b): n for b, n in used.items()},
                        "width_changes": switches,
                    }
                rows.append(row)
    summary = {}
    for name in POLICIES:
        ratios = [r[name]["vs_best_fixed"] for r in rows]
        summary[name] = {
            "mean_vs_best_fixed": round(sum(ratios) / len(ratios), 4),
            "worst_vs_best_fixed": min(ratios),
            "cases_within_3pct": sum(x >= 0.97 for x in ratios),
            "cases": len(ratios),
        }
    result = {
        "traces": args.traces,
        "trials": args.trials,
        "seeds": args.seeds,
        "noise_sigma": args.noise,
        "probe_extra_ms": args.probe_extra_ms,
        "switch_ms": args.switch_ms,
        "cost_source": COST_SOURCE,
        "summary": summary,
        "rows": rows,
    }
    print(table(rows))
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def table(rows) -> str:
    """Per workload and cost model: auto / best fixed for each policy, mean over seeds."""
    lines = [
        "| workload | round costs | best fixed | " + " | ".join(POLICIES) + " |",
        "|---|---|---:|" + "---:|" * len(POLICIES),
    ]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["costs"]), []).append(r)
    for (workload, costs), group in groups.items():
        bests = sorted({str(r["best_fixed"]) for r in group})
        cells = []
        for name in POLICIES:
            ratios = [r[name]["vs_best_fixed"] for r in group]
            cells.append(f"{sum(ratios) / len(ratios):.3f} (min {min(ratios):.3f})")
        lines.append(f"| {workload} | {costs} | {'/'.join(bests)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="decode the workloads at budget 64; keep every round")
    rec.add_argument("--out", required=True)
    rec.add_argument("--workloads", nargs="+", default=list(BUILTIN))
    rec.add_argument("--prompts", type=int, default=16)
    rec.add_argument("--max-new", type=int, default=128)
    rec.add_argument("--threads", type=int, default=2)
    rep = sub.add_parser("replay", help="replay the policies and every fixed budget")
    rep.add_argument("traces")
    rep.add_argument("--trials", type=int, default=10)
    rep.add_argument("--seeds", type=int, default=5)
    rep.add_argument("--noise", type=float, default=0.03, help="sigma of a round's log time")
    rep.add_argument("--probe-extra-ms", type=float, default=0.3)
    rep.add_argument(
        "--switch-ms", type=float, default=1.0, help="added to a round at another width"
    )
    rep.add_argument("--json")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args)
    else:
        replay(args)


if __name__ == "__main__":
    main()
