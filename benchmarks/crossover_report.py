"""The crossover map from the bench folders of a crossover run: a Markdown table and a heat map.

    .venv/bin/python benchmarks/crossover_report.py RESULTS [--png map.png] [--json cells.json]

RESULTS holds one ``ddtree bench`` folder per phase and concurrency (``A-c1``, ``B-c32``, ...,
as ``benchmarks/sglang_h200/crossover.py`` writes them); every arm under test (``ddtree-bN``,
and ``ddtree-auto`` from ``crossover.py --auto``, a row after the numbers) of every folder
becomes one cell: its output tok/s over the DFLASH arm of the same bench (the ratio and
95 % CI ``ddtree bench`` computed, paired by trial), over plain decoding when the bench timed
the reference, acceptance and inter-token latency (one streamed chunk per verify round) p50
of both. Nothing in that table is recomputed: the figures are the benches' own.

A second table puts every ``auto`` arm against the fixed budgets beside it in the same bench
(same round machinery: ``auto graphs`` against ``N graphs``): output tok/s over the best of
them (the one with the highest tok/s in that bench) and over each other one, paired by trial.
The benches compared arms under test with DFLASH only, so these ratios are computed here, from
the per-trial tok/s summary.json keeps, with the bench's own pairing, bootstrap and seed
(``ddtree_cli.bench.analysis.compare_trials``); "within 3 %" is the point estimate's
``>= 0.97`` of the best fixed budget, the issue's goal for ``auto``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

from ddtree_cli.bench.analysis import compare_trials
from ddtree_cli.budget_policy import batch_bucket

# Arms under test: ``ddtree-bN`` (a fixed budget) and ``ddtree-auto`` (the budget chosen per
# round, ``crossover.py --auto``), which sorts after every number; either with ``-graphs``
# (``crossover.py --graphs``: the round replayed from CUDA graphs) or with one of the
# switches ``crossover.py`` names in its ``SWITCHES`` (``--graphs``'s help says what each is
# for). The report names each suffix below and sorts the arms in this order. (The report reads
# finished results here, without importing the GPU-side script.)
SUFFIXES = {
    None: "", "-graphs": " graphs", "-graphs-verify": " graphs+verify",
    "-graphs-move": " graphs+move", "-graphs-pdl": " graphs+pdl",
    "-graphs-control": " graphs (control)", "-graphs-movecheck": " graphs+move check",
    "-graphs-poolmove": " graphs+pool move", "-graphs-h2": " graphs+hysteresis 0.02",
}  # fmt: skip
# Suffixes of ``auto`` arms whose switch sets the budget policy (no fixed budget has them):
# such an arm is put against the fixed budgets of the suffix it is a variant of.
AUTO_ONLY = {"-graphs-h2": "-graphs"}
ARM = re.compile(
    r"^ddtree-(?:b(\d+)|(auto))("
    + "|".join(re.escape(suffix) for suffix in SUFFIXES if suffix)
    + r")?$"
)


def arm_budget(arm: str) -> int | str:
    """``ddtree-b64`` -> 64, ``ddtree-auto`` -> ``"auto"``, ``ddtree-b15-graphs`` ->
    ``"15 graphs"``, ``ddtree-auto-graphs`` -> ``"auto graphs"``, ``ddtree-b15-graphs-verify``
    -> ``"15 graphs+verify"``."""
    number, auto, graphs = ARM.match(arm).groups()
    budget = int(number) if number is not None else auto
    return f"{budget}{SUFFIXES[graphs]}" if graphs else budget


def budget_order(budget: int | str) -> tuple:
    text = str(budget)
    kind = next(i for i, suffix in reversed(list(enumerate(SUFFIXES.values())))
                if text.endswith(suffix))  # fmt: skip
    base = text.removesuffix(list(SUFFIXES.values())[kind]) if kind else text
    return (kind, 1, 0) if base == "auto" else (kind, 0, int(base))


def cells(results: Path) -> list[dict]:
    out = []
    for summary_file in sorted(results.glob("*/summary.json")):
        summary = json.loads(summary_file.read_text())
        for point in summary["sweep"]:
            arms = point["arms"]
            by_arm = point.get("comparisons") or {
                a: point["comparison"] for a in arms if ARM.match(a)
            }  # one arm under test: the two-arm form
            for arm, comparison in by_arm.items():
                budget = arm_budget(arm)
                tok = comparison["output_tok_s"]
                plain = (point.get("over_reference") or {}).get(arm, {}).get("output_tok_s")
                dflash_plain = (point.get("over_reference") or {}).get("dflash", {})
                out.append({
                    "bench": summary_file.parent.name, "budget": budget,
                    "concurrency": point["concurrency"],
                    "ratio": tok["ratio"], "ci95": tok["ci95"], "verdict": tok["verdict"],
                    "tok_s": arms[arm]["output_tok_s"], "dflash_tok_s": arms["dflash"]["output_tok_s"],
                    "plain_tok_s": arms.get("reference", {}).get("output_tok_s"),
                    "over_plain": plain and plain["ratio"],
                    "over_plain_ci95": plain and plain["ci95"],
                    "dflash_over_plain": dflash_plain.get("output_tok_s", {}).get("ratio"),
                    "accept": arms[arm]["accept_length"],
                    "dflash_accept": arms["dflash"]["accept_length"],
                    "itl_p50": arms[arm]["itl_ms"]["p50"],
                    "dflash_itl_p50": arms["dflash"]["itl_ms"]["p50"],
                    "noisy": sorted(a for a in (arm, "dflash") if arms[a].get("noisy")),
                    "confounds": summary["confounds"]["differences"],
                })  # fmt: skip
    return sorted(out, key=lambda c: (budget_order(c["budget"]), c["concurrency"]))


WITHIN = 0.97  # the issue's goal: auto within 3 % of the best fixed budget beside it


def fixed_beside(parsed: dict, suffix: str | None) -> list[str]:
    """The fixed-budget arms an ``auto`` arm with ``suffix`` is put against: those with its
    suffix, or for a policy switch (``AUTO_ONLY``) those of the suffix it varies. ``parsed``:
    arm -> ``ARM``'s groups."""
    beside = AUTO_ONLY.get(suffix, suffix)
    return [a for a, (n, _, s) in parsed.items() if n is not None and s == beside]


def _trials(arm: dict) -> dict[int, float | None]:
    """An arm's tok/s per trial, as summary.json keeps them."""
    return {t["trial"]: t["output_tok_s"] for t in arm["trials"]}


def against_fixed(results: Path) -> list[dict]:
    """Every ``auto`` arm of every bench against the fixed budgets with its suffix in the same
    bench, paired by trial: the best of them (highest tok/s in that bench) and the others."""
    out = []
    for summary_file in sorted(results.glob("*/summary.json")):
        summary = json.loads(summary_file.read_text())
        seed = summary.get("config", {}).get("seed", 0)
        for point in summary["sweep"]:
            arms = point["arms"]
            parsed = {a: match.groups() for a in arms if (match := ARM.match(a))}
            autos = [(a, suffix) for a, (_, auto, suffix) in parsed.items() if auto]
            for auto, suffix in autos:
                fixed = fixed_beside(parsed, suffix)
                if not fixed:
                    continue
                fixed.sort(key=lambda a: -(arms[a]["output_tok_s"] or 0))  # none: measured none
                against = [compare_trials(_trials(arms[auto]), _trials(arms[f]),
                                          name_a=arm_budget(auto), seed=seed)
                           for f in fixed]  # fmt: skip
                best = against[0]
                policy = policy_at(results, summary_file.parent.name, suffix, point["concurrency"])
                out.append({
                    "bench": summary_file.parent.name, "concurrency": point["concurrency"],
                    "auto": arm_budget(auto), "best": arm_budget(fixed[0]),
                    "ratio": best.ratio, "ci95": best.ci95 and list(best.ci95), "n": best.n,
                    "verdict": best.verdict,
                    "within": best.ratio is not None and best.ratio >= WITHIN,
                    "others": [{"budget": arm_budget(f), "ratio": e.ratio,
                                "ci95": e.ci95 and list(e.ci95)}
                               for f, e in zip(fixed[1:], against[1:], strict=True)],
                    "policy": policy,
                })  # fmt: skip
    return sorted(out, key=lambda r: (budget_order(r["auto"]), r["concurrency"], r["bench"]))


def policy_at(results: Path, bench: str, suffix: str | None, concurrency: int) -> dict | None:
    """The ``auto`` server's policy at the end of ``bench`` (``BENCH.auto[-graphs]-policy.json``
    beside the bench folders), at the bench's batch bucket: the budget in use there and the
    changes that bucket made after its first choice over the server's life so far (the state
    keeps the last 32 changes of all buckets: ``partial`` when it has dropped some). None
    without the file or the bucket."""
    # crossover.py names it by the arm: ``A-c1.auto-graphs-policy.json`` for auto-graphs.
    if not (path := results / f"{bench}.auto{suffix or ''}-policy.json").is_file():
        return None
    state = json.loads(path.read_text())
    bucket = batch_bucket(concurrency)
    if str(bucket) not in state.get("buckets", {}):
        return None
    kept = state.get("recent_changes", [])
    return {
        "bucket": bucket,
        "budget": state["buckets"][str(bucket)]["budget"],
        "changes": sum(c["batch_bucket"] == bucket and c["from"] is not None for c in kept),
        "partial": state.get("budget_changes", 0) > len(kept),
    }


def _policy_cell(policy: dict | None) -> str:
    if policy is None:
        return "–"
    n = policy["changes"]
    more = "≥ " if policy["partial"] else ""
    return f"{policy['budget']} ({more}{n} change{'' if n == 1 else 's'})"


def against_fixed_table(rows: list[dict]) -> str:
    lines = [
        "| arm | bench | conc. | best fixed budget beside it | auto / best fixed (paired, 95 % CI) "
        "| within 3 % | auto / the other fixed budgets | auto's budget at the bench's batch "
        "bucket at its end (changes there after the first choice) |",
        "|---|---|---:|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = ("not measured" if r["ratio"] is None
                 else _ratio(r["ratio"], r["ci95"], f", {r['n']} trials"))  # fmt: skip
        others = "; ".join(
            f"{o['ratio']:.3f} ({_ci(o['ci95'])}) of {o['budget']}" if o["ratio"] is not None
            else f"not measured against {o['budget']}"
            for o in r["others"]
        ) or "–"  # fmt: skip
        within = "–" if r["ratio"] is None else ("yes" if r["within"] else "no")
        lines.append(f"| {r['auto']} | {r['bench']} | {r['concurrency']} | {r['best']} | {ratio} | {within} "
                     f"| {others} | {_policy_cell(r['policy'])} |")  # fmt: skip
    return "\n".join(lines)


def _requests(results: Path) -> dict[str, list[dict]]:
    """Per bench folder, its answered requests with outputs (``requests.jsonl``, or
    ``requests.jsonl.gz`` as the stored results keep it)."""
    found = {f.parent: f for f in results.glob("*/requests.jsonl.gz")}
    found.update({f.parent: f for f in results.glob("*/requests.jsonl")})
    out = {}
    for requests in sorted(found.values()):
        text = (gzip.decompress(requests.read_bytes()).decode() if requests.suffix == ".gz"
                else requests.read_text())  # fmt: skip
        rows = [json.loads(line) for line in text.splitlines()]
        out[requests.parent.name] = [
            r for r in rows if r.get("ok") and r.get("output_ids") is not None
        ]
    return out


def agreement(results: Path, requests: dict[str, list[dict]] | None = None) -> list[dict]:
    """Output agreement per bench folder, greedy outputs compared token
    for token: for every two arms, the requests of one prompt and trial whose outputs are
    equal; for every arm, the prompts whose output was the same in all its trials (two
    servers can differ where one server's own trials do: at high concurrency a batch's
    makeup follows timing, and a bf16 near-tie follows the batch)."""
    out = []
    for bench, rows in (_requests(results) if requests is None else requests).items():
        outputs: dict[str, dict] = {}
        for r in rows:
            outputs.setdefault(r["arm"], {})[(r["prompt_id"], r["trial"])] = r["output_ids"]
        arms = sorted(outputs, key=lambda a: (a != "dflash", a))
        for i, a in enumerate(arms):
            prompts: dict[str, set] = {}
            for (prompt, _), ids in outputs[a].items():
                prompts.setdefault(prompt, set()).add(tuple(ids))
            out.append(
                {
                    "bench": bench,
                    "arms": [a],
                    "same": sum(len(v) == 1 for v in prompts.values()),
                    "of": len(prompts),
                    "unit": "prompts",
                }
            )
            for b in arms[i + 1 :]:
                both = outputs[a].keys() & outputs[b].keys()
                same = sum(outputs[a][k] == outputs[b][k] for k in both)
                out.append({"bench": bench, "arms": [a, b], "same": same,
                            "of": len(both), "unit": "requests"})  # fmt: skip
    return out


def same_text(results: Path, requests: dict[str, list[dict]] | None = None) -> list[dict]:
    """At concurrency 1, where a request's time is its own: every ``auto`` arm against each
    fixed budget with its suffix, output tok/s (tokens over end-to-end time, summed) on the
    prompts for which both arms wrote one and the same text in every trial, and where they
    did not, each arm's verify rounds per request. Two greedy servers can write different
    texts from a bf16 near-tie, from the first token on (the prefill's) where the budget
    plays no part; a degenerate text (a prompt that repeats itself) takes half the rounds of
    another, so one prompt can move a bench's ratio by several per cent."""
    out = []
    for bench, rows in (_requests(results) if requests is None else requests).items():
        by: dict[str, dict[str, list[dict]]] = {}
        for r in rows:
            if r.get("concurrency") == 1:
                by.setdefault(r["arm"], {}).setdefault(r["prompt_id"], []).append(r)
        parsed = {a: match.groups() for a in by if (match := ARM.match(a))}
        for auto, (_, is_auto, suffix) in sorted(parsed.items()):
            if not is_auto:
                continue
            for fixed in sorted(fixed_beside(parsed, suffix)):
                a, f = by[auto], by[fixed]
                common = sorted(a.keys() & f.keys())
                same = [p for p in common
                        if len({tuple(r["output_ids"]) for r in a[p] + f[p]}) == 1]  # fmt: skip
                mine, theirs = _tok_s(a, same), _tok_s(f, same)
                out.append({
                    "bench": bench, "auto": arm_budget(auto), "fixed": arm_budget(fixed),
                    "ratio": mine / theirs if mine and theirs else None,
                    "same": len(same), "of": len(common),
                    "differ": [{"prompt": p,
                                "rounds": [sum(r["spec_verify_ct"] for r in arm[p]) / len(arm[p])
                                           for arm in (a, f)]}
                               for p in common if p not in same],
                })  # fmt: skip
    return out


def _tok_s(arm: dict[str, list[dict]], prompts: list[str]) -> float | None:
    """Tokens over end-to-end time, summed over an arm's requests of ``prompts``."""
    reqs = [r for p in prompts for r in arm[p]]
    ms = sum(r["e2e_ms"] for r in reqs)
    return sum(r["completion_tokens"] for r in reqs) / ms if ms else None


def same_text_table(rows: list[dict]) -> str:
    lines = [
        "| arm | bench | fixed budget | auto / fixed on the same texts (tok/s) | prompts with "
        "the same text | where the texts differ: verify rounds per request, auto / fixed |",
        "|---|---|---|---|---:|---|",
    ]
    for r in rows:
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.3f}"
        differ = "; ".join(f"{d['prompt']}: {d['rounds'][0]:.1f} / {d['rounds'][1]:.1f}"
                           for d in r["differ"]) or "–"  # fmt: skip
        lines.append(f"| {r['auto']} | {r['bench']} | {r['fixed']} | {ratio} "
                     f"| {r['same']} of {r['of']} | {differ} |")  # fmt: skip
    return "\n".join(lines)


def agreement_table(rows: list[dict]) -> str:
    lines = ["| bench | arms | same output | of |", "|---|---|---:|---:|"]
    for r in rows:
        what = (f"{r['arms'][0]} (its own trials)" if len(r["arms"]) == 1
                else " = ".join(r["arms"]))  # fmt: skip
        lines.append(f"| {r['bench']} | {what} | {r['same']} | {r['of']} {r['unit']} |")
    return "\n".join(lines)


def _ci(ci: list[float] | None) -> str:
    return f"{ci[0]:.2f}–{ci[1]:.2f}" if ci else "–"


def _ratio(ratio: float, ci: list[float], tail: str = "") -> str:
    """A ratio with its 95 % CI, bold where the CI leaves 1."""
    text = f"{ratio:.3f} ({_ci(ci)}){tail}"
    return f"**{text}**" if ci[0] > 1 or ci[1] < 1 else text


def table(rows: list[dict]) -> str:
    lines = [
        "| budget | conc. | DDTREE / DFLASH (95 % CI) | verdict | DDTREE / plain | DFLASH / plain "
        "| tok/s DDTREE / DFLASH / plain | accept DDTREE / DFLASH | ITL p50 DDTREE / DFLASH |",
        "|---:|---:|---|---|---|---|---|---|---|",
    ]
    for c in rows:
        plain = f"{c['over_plain']:.2f} ({_ci(c['over_plain_ci95'])})" if c["over_plain"] else "–"
        dfp = f"{c['dflash_over_plain']:.2f}" if c["dflash_over_plain"] else "–"
        ref = f"{c['plain_tok_s']:,.0f}" if c["plain_tok_s"] else "–"
        ratio = _ratio(c["ratio"], c["ci95"])
        lines.append(
            f"| {c['budget']} | {c['concurrency']} | {ratio} | {c['verdict']} | {plain} | {dfp} "
            f"| {c['tok_s']:,.0f} / {c['dflash_tok_s']:,.0f} / {ref} "
            f"| {c['accept']:.2f} / {c['dflash_accept']:.2f} "
            f"| {c['itl_p50']:.1f} / {c['dflash_itl_p50']:.1f} ms |"
        )
    return "\n".join(lines)


def heat_map(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    budgets = sorted({c["budget"] for c in rows}, key=budget_order)
    concs = sorted({c["concurrency"] for c in rows})
    grid = [[None] * len(concs) for _ in budgets]
    for c in rows:
        grid[budgets.index(c["budget"])][concs.index(c["concurrency"])] = c
    values = [[(g["ratio"] if g else float("nan")) for g in r] for r in grid]
    fig, ax = plt.subplots(figsize=(1.6 * len(concs) + 1.5, 0.9 * len(budgets) + 1.4))
    norm = TwoSlopeNorm(vmin=min(0.5, *[v for r in values for v in r if v == v]), vcenter=1.0,
                        vmax=max(1.5, *[v for r in values for v in r if v == v]))  # fmt: skip
    ax.imshow(values, cmap="RdYlGn", norm=norm, aspect="auto")
    for i, r in enumerate(grid):
        for j, g in enumerate(r):
            if g is None:
                ax.text(j, i, "not run", ha="center", va="center", fontsize=8, color="grey")
                continue
            lo, hi = g["ci95"]
            mark = "" if lo <= 1 <= hi else (" ▲" if lo > 1 else " ▼")
            ax.text(j, i, f"{g['ratio']:.2f}{mark}\n{lo:.2f}–{hi:.2f}", ha="center",
                    va="center", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(concs)), [str(c) for c in concs])
    ax.set_yticks(range(len(budgets)), [f"budget {b}" for b in budgets])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--png", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--title", default="DDTREE / DFLASH output tok/s (95 % CI; ▲▼ CI excludes 1)")
    args = p.parse_args(argv)
    rows = cells(args.results)
    if not rows:
        print(f"no bench folder with ddtree-bN arms under {args.results}", file=sys.stderr)
        return 1
    print(table(rows))
    auto = against_fixed(args.results)
    if auto:
        print(
            "\n`auto` against the fixed budgets beside it in the same bench (output tok/s, "
            "paired by trial; computed here from the trials' tok/s):\n"
        )
        print(against_fixed_table(auto))
    requests = _requests(args.results)
    same = agreement(args.results, requests)
    if same:
        print("\nOutputs compared token for token (greedy):\n")
        print(agreement_table(same))
    texts = same_text(args.results, requests)
    if texts:
        print(
            "\n`auto` against each fixed budget at concurrency 1 on the prompts both wrote "
            "the same text for (a different text, such as one that repeats itself, takes "
            "another number of rounds):\n"
        )
        print(same_text_table(texts))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.png:
        heat_map(rows, args.png, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
