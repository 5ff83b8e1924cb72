"""The confound guard's diff and the lossless comparisons, on data with known answers."""

from __future__ import annotations

import json
from pathlib import Path

from ddtree_cli.bench import fingerprint, lossless

FIXTURES = Path(__file__).parent / "fixtures"


def _info(**over):
    base = {
        "model_path": "Qwen/Qwen3-8B",
        "port": 30000,
        "host": "0.0.0.0",
        "startup_time": 1.0,
        "speculative_algorithm": "DFLASH",
        "disable_overlap_schedule": False,
        "internal_states": [{"avg_spec_accept_length": 3.2}],
        "gpu": {"name": "H200", "driver": "580"},
        "dist_init_port": 5000,
    }
    base.update(over)
    return base


def test_fingerprints_ignore_ports_times_counters_and_the_algorithm():
    a = fingerprint.fingerprint(_info())
    b = fingerprint.fingerprint(
        _info(
            port=30001,
            startup_time=9.0,
            speculative_algorithm="DDTREE",
            speculative_ddtree_budget=15,
            internal_states=[{"avg_spec_accept_length": 5.0}],
            dist_init_port=6000,
            max_total_num_tokens=5188790,
        )
    )
    assert fingerprint.compare({"ddtree": b, "dflash": a}) == []
    # The KV pool's size follows from the algorithm's memory, so it is not a confound ...
    c = fingerprint.fingerprint(_info(max_total_num_tokens=6582151))
    assert fingerprint.compare({"ddtree": b, "dflash": c}) == []
    # ... but a seed is a setting: SGLang draws a new one at every start unless it is given.
    d = fingerprint.fingerprint(_info(random_seed=288422691))
    e = fingerprint.fingerprint(_info(random_seed=54744945, speculative_algorithm="DDTREE"))
    assert [x.key for x in fingerprint.compare({"ddtree": e, "dflash": d})] == ["random_seed"]


def test_fingerprints_show_every_other_difference_nested_or_missing():
    a = fingerprint.fingerprint(_info())
    b = fingerprint.fingerprint(
        _info(
            disable_overlap_schedule=True,
            gpu={"name": "H100", "driver": "580"},
            extra_flag=1,
        )
    )
    diffs = {d.key: d.values for d in fingerprint.compare({"ddtree": b, "dflash": a})}
    assert diffs == {
        "disable_overlap_schedule": {"ddtree": True, "dflash": False},
        "gpu.name": {"ddtree": "H100", "dflash": "H200"},
        "extra_flag": {"ddtree": 1, "dflash": None},
    }


def _rec(arm, pid, ids, trial=1, conc=1, ok=True):
    return {
        "arm": arm,
        "prompt_id": pid,
        "output_ids": ids,
        "trial": trial,
        "concurrency": conc,
        "ok": ok,
    }


def test_first_difference():
    assert lossless.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert lossless.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert lossless.first_difference([1, 2], [1, 2, 3]) == 2


def test_compare_arms_lists_each_mismatch_with_its_position():
    records = [
        _rec("a", "p1", [1, 2, 3]),
        _rec("b", "p1", [1, 2, 3]),
        _rec("a", "p2", [4, 5, 6]),
        _rec("b", "p2", [4, 9, 6]),
        _rec("a", "p3", [7]),
        _rec("b", "p3", None, ok=False),  # failed: not compared
    ]
    res = lossless.compare_arms(records, "a", "b", strict=True)
    assert res.compared == 2
    assert [(m.prompt_id, m.position, m.tokens) for m in res.mismatches] == [
        ("p2", 1, {"a": 5, "b": 9})
    ]
    assert not res.ok
    assert lossless.compare_arms(records, "a", "b", strict=False).ok


def test_reference_flags_the_arm_that_diverges_clearly_more_often():
    ref = {f"p{i}": [i, i] for i in range(8)}
    records = []
    for i in range(8):
        records.append(_rec("good", f"p{i}", [i, i]))
        records.append(_rec("bad", f"p{i}", [i, 99]))
    out = lossless.reference_divergence(records, ref, ["good", "bad"])
    assert out.arms["good"].rate == 0.0
    assert out.arms["bad"].rate == 1.0
    assert out.p_value == 2 / 256
    assert out.flagged == ["bad"]


def test_reference_does_not_flag_equal_rates_of_near_tie_flips():
    ref = {f"p{i}": [i, i] for i in range(8)}
    records = []
    for i in range(8):
        records.append(_rec("x", f"p{i}", [i, 99] if i in (0, 1) else [i, i]))
        records.append(_rec("y", f"p{i}", [i, 99] if i in (2, 3) else [i, i]))
    out = lossless.reference_divergence(records, ref, ["x", "y"])
    assert out.arms["x"].diverged == out.arms["y"].diverged == 2
    assert out.flagged == []


def _from_divergence(arms: dict, prompts: list[str]) -> tuple[dict, list[dict]]:
    """Records and reference outputs with the given prompts diverged per arm."""
    ref = {pid: [1, 2] for pid in prompts}
    records = [_rec(arm, pid, [1, 9] if pid in set(d["diverged_prompts"]) else [1, 2])
               for arm, d in arms.items() for pid in prompts]  # fmt: skip
    return ref, records


def test_several_arms_are_holm_corrected_on_a_real_gpu_runs_divergence():
    data = json.loads((FIXTURES / "reference_divergence_h200_c32.json").read_text())
    ref, records = _from_divergence(data["arms"], data["prompts"])
    arms = list(data["arms"])
    under_test = [a for a in arms if a != "dflash"]
    # Alone, budget 64 against DFLASH is a "clear" difference (17 prompts only DFLASH
    # diverged on, 5 only budget 64): p = 0.017 ...
    pair = lossless.reference_divergence(records, ref, ["ddtree-b64-graphs", "dflash"])
    assert pair.discordant == {"ddtree-b64-graphs": 5, "dflash": 17}
    assert pair.flagged == ["dflash"] and 0.01 < pair.p_value < 0.05
    # ... but one of three tests: above 0.05 / 3, so no arm is flagged.
    out = lossless.against_baseline(records, ref, arms, under_test, "dflash")
    assert out.flagged == []
    assert set(out.p_values) == set(under_test)
    assert out.p_values["ddtree-b64-graphs"] == pair.p_value
    assert [out.arms[a].diverged for a in arms] == [36, 28, 41, 40]


def test_several_arms_still_flag_the_one_that_is_broken():
    prompts = [f"p{i:03d}" for i in range(40)]
    arms = {"b15": {"diverged_prompts": prompts[:4]}, "b64": {"diverged_prompts": prompts[2:6]},
            "bad": {"diverged_prompts": prompts[:20]}, "dflash": {"diverged_prompts": prompts[1:5]}}  # fmt: skip
    ref, records = _from_divergence(arms, prompts)
    out = lossless.against_baseline(records, ref, list(arms), ["b15", "b64", "bad"], "dflash")
    assert out.flagged == ["bad"]
    assert out.p_values["bad"] < 0.05 / 3
    assert lossless.ReferenceDivergence.from_json(out.to_json()).p_values == out.p_values
