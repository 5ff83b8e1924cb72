"""The confound guard on real /server_info answers of patched SGLang 0.5.13 (one H200).

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
