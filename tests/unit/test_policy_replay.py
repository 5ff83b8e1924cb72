"""benchmarks/policy_replay.py: the rounds it records are the embedded engine's rounds, and
its replay's fixed budgets and policies account for every recorded round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.sglang_h200 import BENCHMARKS, load_script

REPO = Path(__file__).resolve().parents[2]
STORED = REPO / "benchmarks" / "results" / "policy_replay_2026-12-07" / "traces.json"


def _replay_module():
    return load_script("policy_replay", BENCHMARKS)


def test_recorded_rounds_are_the_engines_rounds_with_every_candidates_counts(tmp_path):
    pytest.importorskip("torch")
    replay = _replay_module()
    out = tmp_path / "traces.json"
    replay.main(["record", "--out", str(out), "--workloads", "stdlib", "--prompts", "2",
                 "--max-new", "48", "--threads", "1"])  # fmt: skip
    data = json.loads(out.read_text())
    assert data["candidates"] == [15, 32, 64]
    prompts = data["workloads"]["stdlib"]
    assert len(prompts) == 2
    for rounds in prompts:
        committed = [1 + accepted[-1] for _, accepted in rounds]
        # The prefill commits the first token, each round 1 + what budget 64 accepted; the
        # last round may pass the length limit (the engine truncates it).
        assert sum(committed[:-1]) < 48 - 1 <= sum(committed)
        for values, accepted in rounds:
            # Prefix order: a wider tree holds the narrower one, so neither count shrinks,
            # and no path is deeper than the drafter's block - 1.
            assert values == sorted(values) and accepted == sorted(accepted)
            assert accepted[0] >= 0 and accepted[-1] <= 15


def test_replay_accounts_for_every_round_and_computes_the_fixed_budgets_directly(tmp_path):
    replay = _replay_module()
    out = tmp_path / "replay.json"
    replay.main(["replay", str(STORED), "--trials", "1", "--seeds", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    data = json.loads(STORED.read_text())
    assert len(result["rows"]) == len(data["workloads"]) * len(replay.COSTS)
    row = next(r for r in result["rows"] if r["workload"] == "math")
    rounds = [r for prompt in data["workloads"]["math"] for r in prompt]
    assert row["rounds"] == len(rounds)
    for name in replay.POLICIES:
        assert sum(row[name]["rounds_at"].values()) == len(rounds)
        assert 0.5 < row[name]["vs_best_fixed"] <= 1.05
    # A fixed budget's tok/s from the rounds themselves, with the replay's noise draws.
    noise = replay.noise_draws(len(rounds), 0, 0.03)
    costs = replay.COSTS[row["costs"]]
    tokens = sum(1 + accepted[1] for _, accepted in rounds)
    assert row["fixed_tok_s"]["32"] == pytest.approx(
        tokens / (sum(costs[32] * n for n in noise) / 1e3), abs=0.05
    )
    assert set(result["summary"]) == set(replay.POLICIES)
