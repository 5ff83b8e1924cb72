"""The confound guard on real /server_info answers of patched SGLang 0.5.13 (one H200) and
0.5.17 (the v2 layout, one H100).

The answers are copied verbatim from bench summaries of GPU runs (see the fixture's
``_provenance``). Where a test changes one field, it is the field a server started with the
named flag changed would report, everything else staying the real answer.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from ddtree_cli.bench import fingerprint

ANSWERS = json.loads(
    (Path(__file__).parent / "fixtures" / "sglang_0513_h200_server_info.json").read_text()
)


def pair(name: str) -> tuple[dict, dict]:
    entry = copy.deepcopy(ANSWERS[name])
    return entry["ddtree"], entry["dflash"]


def differences(ddtree: dict, dflash: dict) -> dict:
    fps = {"ddtree": fingerprint.fingerprint(ddtree), "dflash": fingerprint.fingerprint(dflash)}
    return {d.key: d.values for d in fingerprint.compare(fps)}


@pytest.mark.parametrize("name", ["budget64", "budget15"])
def test_identical_flags_but_the_algorithm_differ_in_nothing(name):
    ddtree, dflash = pair(name)
    # What the answers really say: DDTREE verifies budget + 1, DFLASH one block of 16.
    assert ddtree["speculative_num_draft_tokens"] == ddtree["speculative_ddtree_budget"] + 1
    assert ddtree["speculative_dflash_block_size"] == 16
    assert (dflash["speculative_num_draft_tokens"], dflash["speculative_dflash_block_size"]) == (
        16,
        None,
    )
    assert differences(ddtree, dflash) == {}


def test_drafter_block_is_what_each_algorithm_drafts_with():
    ddtree, dflash = pair("budget64")
    assert fingerprint.drafter_block(ddtree) == 16
    assert fingerprint.drafter_block(dflash) == 16
    assert fingerprint.drafter_block({"speculative_algorithm": None}) is None


def test_a_dflash_arm_drafting_another_block_is_refused():
    ddtree, dflash = pair("budget64")
    dflash["speculative_num_draft_tokens"] = 8  # --speculative-num-draft-tokens 8
    assert differences(ddtree, dflash) == {
        fingerprint.DRAFTER_BLOCK_KEY: {"ddtree": 16, "dflash": 8}
    }


def test_a_ddtree_arm_on_another_drafter_block_is_refused():
    ddtree, dflash = pair("budget15")
    ddtree["speculative_dflash_block_size"] = 8  # --speculative-dflash-block-size 8
    assert differences(ddtree, dflash) == {
        fingerprint.DRAFTER_BLOCK_KEY: {"ddtree": 8, "dflash": 16}
    }


@pytest.mark.parametrize(
    "key, value",
    [
        ("speculative_draft_model_path", "z-lab/Qwen3-8B-DFlash-b16"),
        ("mem_fraction_static", 0.3),
        ("attention_backend", "flashinfer"),
        ("cuda_graph_max_bs", 16),
        ("speculative_draft_attention_backend", "flashinfer"),
    ],
)
def test_a_real_confound_is_still_refused(key, value):
    ddtree, dflash = pair("budget64")
    assert key in dflash
    real = dflash[key]
    dflash[key] = value
    assert differences(ddtree, dflash) == {key: {"ddtree": real, "dflash": value}}


def test_ddtree_settings_are_the_algorithms():
    ddtree, dflash = pair("budget64")
    ddtree["speculative_ddtree_allow_hybrid"] = True
    assert differences(ddtree, dflash) == {}


def test_a_ddtree_server_that_does_not_report_its_block_is_not_waved_through():
    # The older patch left speculative_dflash_block_size null for DDTREE, so the drafter's
    # block is unknown there; those servers were also started without --random-seed.
    ddtree, dflash = pair("older_patch_budget15")
    assert ddtree["speculative_dflash_block_size"] is None
    diffs = differences(ddtree, dflash)
    assert diffs[fingerprint.DRAFTER_BLOCK_KEY] == {"ddtree": None, "dflash": 16}
    assert set(diffs) == {fingerprint.DRAFTER_BLOCK_KEY, "random_seed"}


def replica(answer: dict, gpu: int, port: int) -> dict:
    """The same server started on another GPU and port (--base-gpu-id, --port)."""
    out = copy.deepcopy(answer)
    out["base_gpu_id"], out["port"] = gpu, port
    return out


def test_replicas_of_one_arm_may_differ_only_in_where_they_run():
    ddtree, _ = pair("budget64")
    replicas = {
        "http://a:30000": replica(ddtree, 0, 30000),
        "http://b:30001": replica(ddtree, 1, 30001),
    }
    fps = {url: fingerprint.fingerprint(info) for url, info in replicas.items()}
    assert fingerprint.compare_replicas(fps) == []
    # An algorithm setting is a difference within one arm: it is no longer one configuration.
    replicas["http://b:30001"]["speculative_ddtree_budget"] = 32  # --speculative-ddtree-budget
    replicas["http://b:30001"]["speculative_num_draft_tokens"] = 33
    fps = {url: fingerprint.fingerprint(info) for url, info in replicas.items()}
    assert {d.key: d.values for d in fingerprint.compare_replicas(fps)} == {
        "speculative_ddtree_budget": {"http://a:30000": 64, "http://b:30001": 32}
    }


def test_arms_of_replicas_are_compared_pair_by_pair_in_gpu_order():
    ddtree, dflash = pair("budget64")
    arms = {
        "ddtree": [fingerprint.fingerprint(replica(ddtree, g, 30000 + g)) for g in (0, 1)],
        # The router lists them in its own order: pairs follow the GPUs, not the list.
        "dflash": [fingerprint.fingerprint(replica(dflash, g, 31000 + g)) for g in (1, 0)],
    }
    assert fingerprint.compare_arms(arms) == []
    # One DFLASH replica on a GPU no DDTREE replica uses: named with its pair.
    arms["dflash"][0]["base_gpu_id"] = 2
    assert [(d.key, d.values) for d in fingerprint.compare_arms(arms)] == [
        ("base_gpu_id (replica 2)", {"ddtree": 1, "dflash": 2})
    ]


def test_arms_with_other_numbers_of_replicas_differ_in_capacity():
    ddtree, dflash = pair("budget64")
    arms = {
        "ddtree": [fingerprint.fingerprint(replica(ddtree, g, 30000 + g)) for g in (0, 1)],
        "dflash": [fingerprint.fingerprint(replica(dflash, 0, 31000))],
    }
    assert [(d.key, d.values) for d in fingerprint.compare_arms(arms)] == [
        ("replicas", {"ddtree": 2, "dflash": 1})
    ]


def test_a_difference_on_every_replica_pair_is_listed_once():
    ddtree, dflash = pair("budget64")
    dflash["speculative_num_draft_tokens"] = 8  # --speculative-num-draft-tokens 8
    arms = {
        "ddtree": [fingerprint.fingerprint(replica(ddtree, g, 30000 + g)) for g in (0, 1)],
        "dflash": [fingerprint.fingerprint(replica(dflash, g, 31000 + g)) for g in (0, 1)],
    }
    assert [(d.key, d.values) for d in fingerprint.compare_arms(arms)] == [
        (fingerprint.DRAFTER_BLOCK_KEY, {"ddtree": 16, "dflash": 8})
    ]


# A plain server next to the arms: the real answers of one GPU run, all three started with the
# same flags but for speculation (benchmarks/results/README.md names the run).
PLAIN_RUN = (
    Path(__file__).resolve().parents[2]
    / "benchmarks/results/sglang_h200_2026-12-01_trained-budgets/after/bench-b64-c1/summary.json"
)


def test_a_plain_reference_differs_from_the_arms_only_in_speculation():
    info = json.loads(PLAIN_RUN.read_text())["server_info"]
    fps = {name: fingerprint.fingerprint(answer) for name, answer in info.items()}
    assert set(fps) == {"ddtree", "dflash", "reference"}
    assert fingerprint.compare(fps)  # the plain rules alone would refuse it
    assert fingerprint.compare_with_plain(fps) == []
    plain = copy.deepcopy(info["reference"])
    plain["model_path"] = plain["model_path"] + "-other"
    fps["reference"] = fingerprint.fingerprint(plain)
    assert [d.key for d in fingerprint.compare_with_plain(fps)] == ["model_path"]


V2_ANSWERS = json.loads(
    (Path(__file__).parent / "fixtures" / "sglang_0517_h100_server_info.json").read_text()
)


def with_plain(reference: dict, **arms: dict) -> dict:
    fps = {name: fingerprint.fingerprint(info) for name, info in arms.items()}
    fps["reference"] = fingerprint.fingerprint(reference)
    return {d.key: d.values for d in fingerprint.compare_with_plain(fps)}


def test_v2_plain_reference_differs_only_in_what_speculation_derives():
    answers = copy.deepcopy(V2_ANSWERS)
    reference, dflash, ddtree = answers["reference"], answers["dflash"], answers["ddtree"]
    # What the answers really say: SGLang derived other decode graph sizes for the plain
    # server (nobody set them), and the arms agree with each other.
    derived = "cuda_graph_config"
    assert reference[derived]["decode"]["bs"] != dflash[derived]["decode"]["bs"]
    assert reference["cuda_graph_bs_decode"] is dflash["cuda_graph_bs_decode"] is None
    assert differences(ddtree, dflash) == {}
    assert with_plain(reference, dflash=dflash, ddtree=ddtree) == {}


def test_v2_plain_reference_with_its_own_graph_sizes_is_refused():
    answers = copy.deepcopy(V2_ANSWERS)
    reference, dflash = answers["reference"], answers["dflash"]
    # --cuda-graph-bs-decode 1 2 4 on the plain server only
    reference["cuda_graph_bs_decode"] = [1, 2, 4]
    reference["cuda_graph_config"]["decode"]["bs"] = [1, 2, 4]
    assert with_plain(reference, dflash=dflash) == {
        "cuda_graph_bs_decode": {"dflash": None, "reference": [1, 2, 4]}
    }
