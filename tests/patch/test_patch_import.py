"""Import tier: the patched SGLang modules imported on CPU in their own venv.

The venv (SGLang's Python dependencies, CPU only) is built from nothing by the fixture and
cached; see ``sglang_venv.py``. ``probe_sglang.py`` runs inside it against a freshly patched
snapshot and reports what it observed. What needs a GPU and a model is documented in
docs/patch.md instead.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ddtree_cli.patching import engine, snapshot
from ddtree_cli.patching.series import version_key
from tests.patch.conftest import IMPORT_VERSIONS, RELEASES
from tests.patch.sglang_venv import venv_python, venv_release

pytestmark = [pytest.mark.sglang_import, pytest.mark.slow]
PROBE = Path(__file__).with_name("probe_sglang.py")


def _model_configs(root: Path) -> Path:
    """Two local model folders: a dense Qwen3 and a hybrid Qwen3-Next (config only)."""
    configs = {
        "dense": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
        "hybrid": {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]},
        # A DFlash drafter's config as the exporter writes it: the block size is its own.
        "draft16": {
            "model_type": "qwen3", "architectures": ["DFlashDraftModel"],
            "num_hidden_layers": 1, "num_target_layers": 4,
            "dflash_config": {"block_size": 16, "mask_token_id": 257,
                              "target_layer_ids": [1, 2], "num_target_layers": 4},
        },
    }  # fmt: skip
    for name, config in configs.items():
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module", params=IMPORT_VERSIONS)
def probe(request, pristine_root, tmp_path_factory):
    version = request.param
    python = venv_python(venv_release(version))
    work = tmp_path_factory.mktemp(f"import-{version}")
    root = work / "snapshot"
    import shutil

    shutil.copytree(pristine_root(version), root)
    snap = snapshot.detect(root)
    engine.apply(snap)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        "TRITON_INTERPRET": "1",  # SGLang's Triton tree-verify kernel, on CPU
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    proc = subprocess.run(
        [str(python), str(PROBE), str(root), snap.layout.value, str(_model_configs(work / "m"))],
        capture_output=True, text=True, env=env, timeout=900, cwd=work,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return version, json.loads(proc.stdout.strip().splitlines()[-1])


def is_v1(version: str) -> bool:
    return RELEASES[version]["layout"] == "v1"


def at_least(version: str, release: str) -> bool:
    return version_key(version) >= version_key(release)


def test_algorithm_lookup_and_plugin_registry(probe):
    _, facts = probe
    assert facts["algorithm"] == {
        "name": "DDTREE", "is_ddtree": True, "is_dflash": True, "dflash_is_ddtree": False,
    }  # fmt: skip
    assert facts["plugin_register_error"] is None  # CustomSpecAlgo mirrors is_ddtree
    assert facts["plugin_is_ddtree"] is False


def test_cli_parser_accepts_the_new_flags(probe):
    _, facts = probe
    assert facts["cli"] == {"algorithm": "DDTREE", "budget": 15, "allow_hybrid": True}


def test_server_argument_validation(probe):
    version, facts = probe
    handle = facts["handle"]
    for ok in ("ok_triton", "ok_flashinfer", "hybrid_override"):
        assert handle[ok] == {"error": None, "budget": 15, "disable_overlap_schedule": True}
    assert "requires --page-size 1, got 4" in handle["page_size_4"]["error"]
    assert "triton or flashinfer" in handle["fa3"]["error"] and "'fa3'" in handle["fa3"]["error"]
    if is_v1(version):  # the budget is apart from the block size
        assert handle["budget_7"] == {"error": None, "budget": 7, "disable_overlap_schedule": True}
    else:  # v2: apart from it too, but the verify width may not be below the block
        assert "--speculative-ddtree-budget >= block size - 1 (15)" in handle["budget_7"]["error"]
    hybrid = handle["hybrid"]["error"]
    assert "refuses hybrid target models" in hybrid and "qwen3_next" in hybrid
    assert "--speculative-ddtree-allow-hybrid" in hybrid


def test_workers_refuse_algorithms_they_cannot_run(probe):
    version, facts = probe
    assert facts["tree_worker_with_dflash"].startswith(
        "ValueError: Unsupported speculative algorithm: DFLASH"
    )
    assert (
        facts["chain_worker_with_eagle"] == "ValueError: Unsupported speculative algorithm: EAGLE"
    )
    worker = "DDTreeWorker" if is_v1(version) else "DDTreeWorkerV2"
    assert facts["create_worker"]["True"] == worker
    assert "does not support overlap scheduling" in facts["create_worker"]["False"]


def test_verify_input_matches_sglang_tree_verify(probe):
    version, facts = probe
    vi = facts["verify_input"]
    assert vi["trials"] == 36 and vi["draft_token_num"] == 16
    assert vi["mask_errors"] == [] and vi["position_errors"] == 0
    assert vi["deepest_accept_len"] >= 4  # the walks went below the first level
    if is_v1(version):  # the v1 worker's accept is SGLang's kernel over the retrieve arrays
        assert vi["kernel_walk_mismatches"] == 0
        assert vi["retrieve_dtype"] == "torch.int64"
    else:  # the v2 worker walks the tree itself: its verify input has no retrieve arrays
        assert vi["kernel_walk_mismatches"] is None and vi["retrieve_dtype"] is None
    assert facts["capture_dummy"] == {
        "target_has_mask": True, "draft_has_mask": False,
        "target_capture_hidden": "FULL", "draft_capture_hidden": "NULL",
    }  # fmt: skip
    if is_v1(version):
        assert (
            facts["prepare_page_size_4"] == "RuntimeError: DDTREE requires page_size == 1, got 4."
        )
    # Both workers size the tree mask from the batch's host lengths (no GPU read-back): the
    # same mask and tokens as sizing it from the device lengths, every trial.
    host = vi["host_sized_mask"]
    assert host["checked"] == 12 + 4 + 4 and host["mismatches"] == 0


def test_draft_head_is_the_exact_top_k(probe):
    _, facts = probe
    head = facts["draft_head"]
    # one rank, one vocabulary part: chunks of the direct path; an added vocabulary: merged
    for case in ("one_part", "added_vocab"):
        assert head[case]["shape"] == [3, 15, 8], case
        assert head[case]["ids_equal"], case
        assert head[case]["max_logprob_error"] < 1e-5, case


def test_round_graphs_replay_the_round_of_the_next_captured_size(probe):
    """ddtree_round_graphs.py (every layout ships it): a round replays the graph of the
    smallest captured batch size at or above its own, and gets exactly the eager round's
    log-probs, ids and tree, cut to its rows; without a graph for its size or (K, budget)
    it runs eagerly. Captured by a stand-in that keeps real capture's static buffers."""
    version, facts = probe
    graphs = facts["round_graphs"]
    assert graphs["captured"] == [2, 0, 2]  # sizes 2 and 4 per (K, budget), once
    assert [r["bs"] for r in graphs["rounds"]] == [4, 3, 1, 5, 2]
    for r in graphs["rounds"]:
        assert r["equal"], r
        assert r["rows"] == [r["bs"]] * 8, r
    assert graphs["snapshot"] == {
        "graphs": 4,
        "sizes": [2, 4],
        "replayed_rounds": 3,
        "eager_rounds": 2,
    }
    # A capture that fails drops every graph: the rounds run eagerly, and the worker
    # serves without them (it logs the error).
    failed = graphs["failed"]
    assert failed["error"] == (
        "capturing batch size 4, K 8, budget 8: "
        "RuntimeError: operation not permitted when stream is capturing"
    )
    assert failed["snapshot"]["graphs"] == 0 and failed["snapshot"]["eager_rounds"] == 1
    assert failed["equal"]
    # A captured graph is replayed once: its outputs hold a real round before any round runs.
    assert graphs["valid_after_capture"] is True
    # SGLANG_DDTREE_ROUND_GRAPHS: on or off in any case and spacing, else the default
    # (with a warning); the v1 worker's default is on, the v2 workers' off.
    switch = graphs["switch"]
    assert switch["requested"] == {
        "None": [False, True], "''": [False, True], "'1'": [True, True],
        "'ON'": [True, True], "' yes '": [True, True], "'0'": [False, False],
        "'off'": [False, False], "'False'": [False, False], "'maybe'": [False, True],
    }  # fmt: skip
    assert len(switch["warned"]) == 2 and all("'maybe'" in w for w in switch["warned"])
    assert switch["warned"][1].endswith("round graphs on (the default)")
    if is_v1(version):
        assert graphs["worker_default"] is True
        assert graphs["worker_on_cpu"] is True
        assert graphs["worker_capture_fails"] is True
    else:
        v2 = graphs["v2"]
        assert v2["worker_default"] is True
        assert v2["capture_on_cpu"] is True and v2["capture_fails"] is True
        # The v2 draft head: rounds of 3 and 4 replay the size-4 graph, a round handed
        # another head object runs eagerly; every one gets the eager round's tree.
        assert [(r["bs"], r["tokens"]) for r in v2["replay"]] == [
            (3, [3, 15]),
            (4, [4, 15]),
            (3, [3, 15]),
        ]
        assert all(r["equal"] for r in v2["replay"]), v2["replay"]
        assert v2["snapshot"] == {
            "graphs": 2,
            "sizes": [2, 4],
            "replayed_rounds": 2,
            "eager_rounds": 0,
        }


def test_request_validation_and_hidden_state_relay(probe):
    version, facts = probe
    validate = facts["validate"]
    assert validate["plain"] is None
    assert "return_logprob" in validate["logprob"]
    assert "grammar-constrained" in validate["regex"]
    assert "grammar-constrained" in validate["json_schema"]
    if not is_v1(version):
        assert facts["spec_need_hidden_states"] is False


def assert_window_fronts(r: dict) -> None:
    """A v2 round's KV commit: one move (the KV pool's), after which each request's verify
    window starts with its accepted nodes' KV, in path order, and no other slot changed
    (the commit kernel, run in Triton's interpreter, equal to its PyTorch path; the
    accepted-rows-only move, ``SGLANG_DDTREE_WINDOW_KV_MOVE``, equal to SGLang's own pool
    move on SGLang's ``MHATokenToKVPool``; ``checked_kv_move`` keeps the pool's result and counts
    a move that differs from it)."""
    assert r["moves"] == 1
    assert r["window_fronts"] == r["expected_fronts"]
    assert set(r["changed_slots"]) <= set(r["front_slots"])
    assert r["commit_kernel"] is None
    assert r["window_move"] is None


def test_the_window_kv_move_is_the_default_with_a_switch_to_turn_it_off(probe):
    """v2: the accept moves KV through ``window_kv_move`` where the pool is SGLang's plain
    ``MHATokenToKVPool`` (built from the release's own class), by default and with
    ``SGLANG_DDTREE_WINDOW_KV_MOVE`` on, and through the pool's own ``move_kv_cache`` with it
    off, for any other pool, a quantised one (whose scales move too) and one under SGLang's
    own native-move switch. ``check``: both every round (``checked_kv_move``), where there is
    a window move to check; the pool's own elsewhere."""
    version, facts = probe
    if is_v1(version):
        pytest.skip("the v1 worker verifies with SGLang's own tree kernels")
    assert facts["kv_move_choice"] == {
        "default": "window_kv_move",
        "on": "window_kv_move",
        "off": "pool_move",
        "default_other_pool": "pool_move",
        "on_other_pool": "pool_move",
        "on_quantised_pool": "pool_move",
        "on_native_move": "pool_move",
        "check": "checked_kv_move",
        "check_other_pool": "pool_move",
    }


def test_verify_round_commits_the_accepted_path(probe):
    """One verify round through the patched glue, checked against ddtree_tree's walk.

    GPU-only pieces are stand-ins (the CUDA verify op, the KV allocator, the requests);
    SGLang's Triton bookkeeping kernels run for real in the Triton interpreter.
    """
    version, facts = probe
    r = facts["verify_round"]
    assert max(r["walk_accept_len"]) > 2  # the target followed a path below the root
    if is_v1(version):
        # The third request finishes after 2 tokens: its commit stops there.
        assert r["commit_lens"] == [*r["walk_accept_len"][:2], 2]
        assert r["appended"] == r["expected_appended"]
        assert r["num_correct"] == [n - 1 for n in r["commit_lens"]] == r["correct_drafts"]
        assert r["bonus"] == [tokens[-1] for tokens in r["appended"]]
        assert r["kv_rows"] == r["expected_kv"]  # req_to_token points at the accepted slots
        assert r["freed"] == r["expected_freed"]  # and every other slot is freed
        prefix = [4, 9, 0]
        assert (
            r["seq_lens"]
            == r["seq_lens_cpu"]
            == [p + n for p, n in zip(prefix, r["commit_lens"], strict=True)]
        )
        assert r["seq_lens_sum"] == sum(r["seq_lens"])
        assert r["verify_ct"] == [1, 1, 1]
    else:
        assert r["commit_lens"] == r["walk_accept_len"]
        assert r["out_tokens_shape"] == [3, 16]  # stride: the drafter's block
        assert r["hidden_shape"] == [3 * 16, 8]  # [bs, block] rows for the draft KV
        assert r["accept_len"] == [n - 1 for n in r["commit_lens"]]
        assert r["bonus"] == r["walk_bonus"] and r["tokens_ok"]
        assert r["new_seq_lens"] == [
            p + n for p, n in zip([4, 9, 0], r["commit_lens"], strict=True)
        ]
        assert_window_fronts(r)
    assert r["hidden_ok"]  # the draft KV is materialised from the accepted rows


def test_budgets_apart_from_the_drafter_block(probe):
    """A block-16 drafter (block size from its dflash_config) with budgets 8 to 64. The v2
    layout takes budgets >= block - 1 (a verify width of at least the block) and refuses
    less; 0.5.13 (v1) takes any budget from 1."""
    version, facts = probe
    budgets = facts["budgets"]
    if not is_v1(version):
        for name, budget in (("default", 15), ("budget_15", 15), ("budget_32", 32),
                             ("budget_64", 64), ("explicit_block", 64),
                             ("num_draft_tokens_block", 64)):  # fmt: skip
            entry = budgets[name]
            width = budget + 1
            assert entry["error"] is None, (name, entry)
            assert (entry["budget"], entry["verify_width"], entry["block"]) == (budget, width, 16)
            # what allocation and logits sizing read: the larger of block and verify width
            assert entry["max_draft_tokens"] == width
            assert entry["rerun"] == [None, width, 16]  # resolving twice changes nothing
        for bad in ("budget_8", "budget_0"):
            assert "--speculative-ddtree-budget >= block size - 1 (15)" in budgets[bad]["error"]
        assert "must be between 15 and 1024" in budgets["budget_huge"]["error"]
        return
    for name, budget in (("default", 15), ("budget_8", 8), ("budget_15", 15),
                         ("budget_32", 32), ("budget_64", 64), ("explicit_block", 64)):  # fmt: skip
        entry = budgets[name]
        width = budget + 1
        assert entry["error"] is None, (name, entry)
        assert (entry["budget"], entry["verify_width"], entry["block"]) == (budget, width, 16)
        # per-decode KV reservation covers the draft block and the verify tree
        assert entry["alloc_len_per_decode"] == max(width, 16)
        assert entry["rerun"] == [None, width, 16]  # resolving twice changes nothing
    for bad in ("budget_0", "budget_huge"):
        assert "--speculative-ddtree-budget must be between 1 and" in budgets[bad]["error"]


def test_budget_auto_on_0_5_13_and_refused_on_v2(probe):
    """``--speculative-ddtree-budget auto``: 0.5.13 (v1) resolves the candidates' widest
    verify and keeps "auto" visible; the v2 releases refuse it in one line."""
    version, facts = probe
    cli, auto = facts["auto_cli"], facts["budget_auto"]
    if not is_v1(version):  # v2's flag is a number; _handle_ddtree and the worker refuse too
        # argparse refuses auto (any case) in one line that says what to give instead,
        # and anything else that is not a number as such
        for value in ("auto", "AUTO"):
            assert cli[value] == (
                "ArgumentError: argument --speculative-ddtree-budget: "
                "--speculative-ddtree-budget auto runs on SGLang 0.5.13 only for now: give "
                "a number of tree nodes (block size - 1, the default, or more)"
            )
        assert cli["64"] == 64
        assert cli["autox"] == (
            "ArgumentError: argument --speculative-ddtree-budget: "
            "--speculative-ddtree-budget must be a number of tree nodes, got 'autox'"
        )
        # --help says what the flag takes there, not that block - 1 is the only value
        help_text = " ".join(facts["budget_help"].split())
        assert "block size - 1 (the default) or more, up to 1024" in help_text
        assert "'auto' runs on SGLang 0.5.13 only" in help_text
        assert auto["auto"]["error"] is not None
        assert facts["tree_worker_auto"] == (
            "ValueError: --speculative-ddtree-budget auto is not supported on SGLang 0.5.14 "
            "and later yet (0.5.13 only)."
        )
        return
    assert (cli["auto"], cli["AUTO"], cli["64"]) == ("auto", "auto", 64)
    assert "'auto': chosen every round for the running batch" in facts["budget_help"]
    assert cli["autox"] == (
        "ArgumentError: argument --speculative-ddtree-budget: --speculative-ddtree-budget "
        "must be a number of tree nodes or 'auto', got 'autox'"
    )
    for name, top in (("auto", 64), ("auto_max_48", 48)):  # candidates 15, 32, (48,) 64
        entry = auto[name]
        assert entry["error"] is None, (name, entry)
        assert (entry["budget"], entry["max_budget"]) == ("auto", top)
        assert (entry["verify_width"], entry["block"]) == (top + 1, 16)
        assert entry["alloc_len_per_decode"] == top + 1  # reserved for the widest
        assert entry["rerun"] == [None, top + 1, 16]  # resolving twice changes nothing
    assert "max budget 8 is below the drafter's block - 1 (15)" in auto["auto_max_8"]["error"]
    assert "--speculative-ddtree-max-budget must be at most 1024" in auto["auto_max_huge"]["error"]
    assert (
        "applies to --speculative-ddtree-budget auto only, got budget 15"
        in (auto["max_without_auto"]["error"])
    )
    assert "--tp-size 1 only for now" in auto["auto_tp2"]["error"]
    assert "auto needs --attention-backend triton" in auto["auto_flashinfer"]["error"]
    assert "must be a number of tree nodes or 'auto', got 'autox'" in auto["autox"]["error"]


@pytest.mark.parametrize("probe", [v for v in IMPORT_VERSIONS if is_v1(v)], indirect=True)
def test_budget_auto_policy_settings_from_the_environment(probe):
    """``SGLANG_DDTREE_BUDGET_POLICY`` sets a budget-auto server's policy (for trying a
    setting beside the default); a bad setting, or the variable on a fixed-budget server,
    is refused in one line as the worker starts (``check_ddtree_worker_args``)."""
    _, facts = probe
    cases = facts["budget_policy_env"]
    assert cases["unset"] == {"changed": {}}
    assert cases["set"] == {"changed": {"hysteresis": 0.02, "min_dwell": 64}}
    assert cases["unknown"]["error"].startswith(
        "ValueError: SGLANG_DDTREE_BUDGET_POLICY: unknown budget policy setting "
        "'hysterisis=0.02' (known: min_samples, warmup_samples, hysteresis,"
    )
    assert cases["not_an_int"] == {
        "error": "ValueError: SGLANG_DDTREE_BUDGET_POLICY: budget policy setting min_dwell "
        "takes a whole number, got '0.5'"
    }
    assert cases["out_of_range"] == {
        "error": "ValueError: SGLANG_DDTREE_BUDGET_POLICY: hysteresis must be >= 0"
    }
    assert cases["fixed_budget"] == {
        "error": "ValueError: SGLANG_DDTREE_BUDGET_POLICY applies to "
        "--speculative-ddtree-budget auto only"
    }
    assert cases["fixed_budget_unset"] == {"changed": None}


@pytest.mark.parametrize("probe", [v for v in IMPORT_VERSIONS if is_v1(v)], indirect=True)
def test_budget_auto_statistics_match_each_candidates_own_tree(probe):
    """One round's tree at the largest candidate (64) gives every candidate's value and
    what it would have accepted: each equals that candidate's own tree, built and walked
    on its own (values to float rounding, accepted counts exactly)."""
    _, facts = probe
    for case in facts["tree_stats"]:
        (got_values, got_accepted), (want_values, want_accepted) = case["got"], case["want"]
        assert got_values == pytest.approx(want_values, rel=1e-5)
        assert got_accepted == want_accepted
        assert got_values[0] < got_values[1] < got_values[2]  # a larger tree holds more
        assert case["no_walk"] == [got_values, [0.0, 0.0, 0.0]]
    assert any(c["want"][1][0] < c["want"][1][2] for c in facts["tree_stats"])  # not vacuous


@pytest.mark.parametrize("probe", [v for v in IMPORT_VERSIONS if is_v1(v)], indirect=True)
def test_budget_auto_times_the_round_not_the_policy(probe):
    """Under auto the policy gets every round's host time as the round ends, DFlash's
    forward from draft to commit (a stand-in that sleeps 12 ms, calls the worker's own
    _build_verify_input, sleeps 8 ms), without the policy's own work (a plan made 200 ms
    slow), reported beside it in the round timing, split into the draft, the build and the
    verify; the tree statistics of the rounds that read them (here the first
    probe, the exploration's round at the largest budget: below it a probe waits) come a
    round later. A prefill between two rounds (30 ms) is timed as a part of the next
    round's gap, not as a round. Bounds from the sleeps, not performance figures: a time
    taken from before the plan is over 220 ms."""
    _, facts = probe
    t = facts["auto_round_time"]
    assert t["results"] == ["round result", "prefill result"] + ["round result"] * 3
    # exploring, the least run width first: each time at once, the stats a round late
    assert [budget for budget, _ in t["observed"]] == [15, 32, 64, 15]
    for _, seconds in t["observed"]:
        assert t["round_s"] <= seconds < t["round_s"] + t["plan_s"]
    assert t["stats"] == [64]
    # each round at its own width (the worker's _build_verify_input sets it); the prefill
    # is not a round
    cells = t["timing"]["buckets"]["2"]
    assert {w: c["rounds"] for w, c in cells.items()} == {"16": 2, "33": 1, "65": 1}
    for cell in cells.values():
        assert cell["policy_ms"]["p50"] >= t["plan_s"] * 1e3
        # DFlash's round split around the worker's build: the drafter's pass before it,
        # the verify and commit after it, neither holding the plan; with the build and the
        # policy's work they are the whole forward
        draft, verify, build = cell["draft_ms"], cell["verify_ms"], cell["build_ms"]
        assert t["draft_s"] * 1e3 <= draft["p50"] < (t["draft_s"] + t["plan_s"] / 2) * 1e3
        assert t["verify_s"] * 1e3 <= verify["p50"] < (t["verify_s"] + t["plan_s"] / 2) * 1e3
        parts = draft["mean"] + build["mean"] + verify["mean"] + cell["policy_ms"]["mean"]
        assert parts == pytest.approx(cell["forward_ms"]["mean"], abs=0.5)
    # three gaps: the one with the prefill in it (before the round at 33), then two without
    assert cells["33"]["prefill_ms"]["max"] >= t["prefill_s"] * 1e3
    assert cells["33"]["gap_ms"]["max"] >= cells["33"]["prefill_ms"]["max"]
    assert cells["65"]["prefill_ms"]["max"] == 0.0
    assert cells["65"]["gap_ms"]["max"] < t["prefill_s"] * 1e3
    # and, per gap, how many prefill rounds it held and the tokens they prefilled
    one = {"p50": 1, "p90": 1, "mean": 1.0, "max": 1}
    assert cells["33"]["prefills"] == one
    assert cells["33"]["prefill_tokens"] == {k: v * t["prefill_tokens"] for k, v in one.items()}
    none = {"p50": 0, "p90": 0, "mean": 0.0, "max": 0}
    assert cells["65"]["prefills"] == cells["65"]["prefill_tokens"] == none


@pytest.mark.parametrize("probe", [v for v in IMPORT_VERSIONS if is_v1(v)], indirect=True)
def test_round_timing_in_server_info(probe):
    """Every DDTREE server's /server_info has its round timing (per batch bucket and
    width: the scheduler's gap, the forward, the tree build, the policy's work), under
    auto next to the policy's state; a gap over a second is idle time, not a round's."""
    _, facts = probe
    rt = facts["round_timing"]
    assert rt["scheduler_reads_it"]
    # the patched get_internal_state's DDTREE statement, run on a stand-in scheduler
    assert rt["scheduler_where"] == "Scheduler.get_internal_state (1 DDTREE statement)"
    assert rt["scheduler_state"] == ["speculative_ddtree_round_timing"]
    assert rt["scheduler_snapshot_equal"]
    assert rt["fixed_state"] == ["speculative_ddtree_round_timing"]
    assert rt["auto_state"] == [
        "speculative_ddtree_budget_policy",
        "speculative_ddtree_round_timing",
    ]
    snap = rt["snapshot"]
    assert snap["window"] == 2 and sorted(snap["buckets"]) == ["1", "16"]
    one = snap["buckets"]["1"]["65"]
    assert one["rounds"] == 4
    # window 2: the last two rounds of (1, 65), the third (build 3 ms) and the one after idle
    assert one["forward_ms"]["p50"] == pytest.approx(10.0)
    assert one["build_ms"] == {"p50": 1.0, "p90": 3.0, "mean": 2.0, "max": 3.0}
    assert one["policy_ms"]["max"] == pytest.approx(0.5)
    assert one["gap_ms"]["max"] == pytest.approx(2.0)  # the 10 s idle gap was not kept
    wide = snap["buckets"]["16"]["16"]
    assert wide["rounds"] == 1 and wide["gap_ms"]["p50"] == pytest.approx(2.0)


@pytest.mark.parametrize("probe", [v for v in IMPORT_VERSIONS if not is_v1(v)], indirect=True)
def test_v2_round_timing_in_server_info(probe):
    """The v2 worker times every decode round (not idle rounds; a prefill, or a batch
    another DP rank extends, as a part of the next round's gap) per batch bucket and its
    verify width, the build being its draft head, tree and verify input; the scheduler's
    get_internal_state (from 0.5.22 its internal-state controller) adds the worker's state,
    round graphs only when captured. DFlash's own GPU round is stood in for by one that
    calls the worker's build seams on CPU tensors."""
    version, facts = probe
    for name, rounds in facts["round_timing_v2"].items():
        # Every round reaches DFlash's with its batch and keyword arguments, its result back.
        # (the fifth, a decode batch while another DP rank extends, goes DFlash's prefill way)
        assert rounds["results"] == [
            "extend round", "decode round of 3", "decode round of 4", "idle round",
            "decode round", "decode round of 1", "decode round of 5",
        ], name  # fmt: skip
        assert rounds["passed"] == [
            ["EXTEND", [], []], ["DECODE", [], ["on_publish"]], ["DECODE", [], []],
            ["IDLE", [], []], ["DECODE", [], []], ["DECODE", [], []],
            ["DECODE", [], ["grammar_barrier"]],
        ], name  # fmt: skip
        timing = rounds["timing"]
        assert timing["window"] == 512
        rounds_per_cell = {
            (bucket, width): cell["rounds"]
            for bucket, widths in timing["buckets"].items()
            for width, cell in widths.items()
        }
        # batches 3 and 4 share bucket 4; 1 and 5 are buckets 1 and 8; all at width 16
        assert rounds_per_cell == {("1", "16"): 1, ("4", "16"): 2, ("8", "16"): 1}, name
        cell = timing["buckets"]["4"]["16"]
        assert cell["policy_ms"] == {"p50": 0.0, "p90": 0.0, "mean": 0.0, "max": 0.0}
        assert cell["gap_ms"] is not None  # the second round of the bucket had one before it
        # the first prefill came before any decode round (no gap to be a part of); the
        # extend on another DP rank is a part of the gap before the round of 1
        assert cell["prefill_ms"] == {"p50": 0.0, "p90": 0.0, "mean": 0.0, "max": 0.0}
        assert cell["prefills"] == cell["prefill_tokens"] == {
            "p50": 0, "p90": 0, "mean": 0.0, "max": 0}, name  # fmt: skip
        after = timing["buckets"]["1"]["16"]
        assert 0 < after["prefill_ms"]["max"] <= after["gap_ms"]["max"], name
        # one prefill round in that gap, with no tokens of this rank's
        assert after["prefills"]["max"] == 1 and after["prefill_tokens"]["max"] == 0, name
        assert rounds["build_within_forward"], name
        # The tree mask is sized from the batch's host lengths, not by reading the device's
        # back (on a GPU that read waits for the draft before the verify can be queued).
        assert len(rounds["mask_sizes"]) == 4, name
        assert all(size == host_sized for size, host_sized in rounds["mask_sizes"]), name
        assert rounds["scheduler_timing_equal"], name
        assert rounds["dflash_scheduler"] == {} and rounds["no_draft_worker"] == {}
        if at_least(version, "0.5.22"):
            assert rounds["scheduler_where"] == "SchedulerInternalStateController._add_speculative"
        else:
            assert rounds["scheduler_where"] == "Scheduler.get_internal_state (1 DDTREE statement)"
    eager, graphs = facts["round_timing_v2"]["eager"], facts["round_timing_v2"]["graphs"]
    assert (
        eager["state_keys"] == eager["scheduler_state_keys"] == ["speculative_ddtree_round_timing"]
    )
    assert eager["round_graphs"] is None
    assert (
        graphs["state_keys"]
        == graphs["scheduler_state_keys"]
        == [
            "speculative_ddtree_round_graphs",
            "speculative_ddtree_round_timing",
        ]
    )
    # batches 3, 4 and 1 replayed (sizes 4, 4, 2); 5 is above every captured size
    assert graphs["round_graphs"] == {
        "graphs": 2, "sizes": [2, 4], "replayed_rounds": 3, "eager_rounds": 1,
    }  # fmt: skip


@pytest.mark.parametrize("probe", [v for v in IMPORT_VERSIONS if is_v1(v)], indirect=True)
def test_start_up_warms_every_budget_at_every_graph_batch_size(probe):
    """The v1 worker runs the round's eager part once per budget it verifies at and per
    batch size its CUDA graphs cover (1, 2 and 16 without graphs), before serving: a fixed
    budget its own, auto every candidate."""
    _, facts = probe
    assert facts["warm"]["fixed"] == [[1, 15], [2, 15], [16, 15]]
    assert facts["warm"]["auto"] == [[bs, b] for bs in (1, 2, 4) for b in (15, 32, 64)]


@pytest.mark.parametrize("probe", [v for v in IMPORT_VERSIONS if not is_v1(v)], indirect=True)
def test_v2_step_graphs_replay_what_the_eager_steps_do(probe):
    """ddtree_step_graphs_v2.py: a round that replayed a round graph replays the verify-input
    graph (when switched on) and the accept graph (walk, commit, KV move; two per size) of
    the same batch size, and gets exactly the eager steps' verify input (tokens, positions,
    the mask cut from the shared buffer) and accept outputs, cut to its rows, and leaves the
    KV exactly as the eager accept does and moves onto the same slots, also for a round of 3
    on the graph a round of 4 replayed (the fourth row's inputs cleared by the graph: it
    moves slot 0 only); the outputs a round returns stay as they were through the next
    round. A mask larger than the shared buffer, or a round with no round graph, is built
    eagerly; a capture that fails leaves that step eager; both are on unless switched off.
    Round graphs whose tree buffers were written over (another graph's replay in the shared
    pool) are replayed before the step graphs capture on them."""
    _, facts = probe
    graphs = facts["step_graphs"]
    assert [(r["bs"], r["size"]) for r in graphs["rounds"]] == [
        (4, 4), (4, 4), (3, 4), (1, 2), (2, 2), (5, None),
    ]  # fmt: skip
    for r in graphs["rounds"]:
        assert r["verify_equal"] and r["equal"] and r["kv_equal"] and r["targets_equal"], r
        assert r["size_after"] is None  # a round's end forgets its round graph's size
        assert r["rows"] == [r["bs"]] * 5 + [r["bs"] * 16], r
    assert all(r["moved"] > 0 for r in graphs["rounds"])  # the walks accepted some paths
    assert [r.get("kept") for r in graphs["rounds"]] == [True] * 5 + [None]
    assert graphs["accept"] == {
        "graphs": 4, "sizes": [2, 4], "replayed_rounds": 5, "eager_rounds": 1,
    }  # fmt: skip
    # the round of 2 with prefixes near 300: its mask (16 * ~600 + 2 * 256) is past the
    # buffer's 16 * 400 + 4 * 256 entries (the pool's 400 tokens, the largest size's rows)
    assert graphs["verify"] == {
        "graphs": 2, "sizes": [2, 4], "replayed_rounds": 4, "eager_rounds": 2,
    }  # fmt: skip
    assert graphs["mask_numel"] == 16 * 400 + 4 * 16 * 16
    # with the model's context length known: 4 requests (the largest size) of 30 tokens,
    # or the pool's 400 tokens when that is fewer than 4 of 4,000
    assert graphs["mask_numel_context"] == 16 * 4 * 30 + 4 * 16 * 16
    assert graphs["mask_numel_long_context"] == 16 * 400 + 4 * 16 * 16
    assert {"speculative_ddtree_accept_graphs", "speculative_ddtree_verify_graphs"} <= set(
        graphs["state_keys"]
    )
    # the third capture (the accept at size 4) fails: the accept stays eager, the verify
    # inputs' graphs are captured after it
    assert graphs["failed"]["accept"] is True
    assert graphs["failed"]["verify"]["graphs"] == 2
    assert graphs["default"] == [True, True]
    assert graphs["verify_off"] == [True, False]
    # tree buffers written over (as another graph's replay in the shared pool may) before
    # the step graphs' capture: it replays each size's round graph first
    assert graphs["clobbered"] == {"accept": True, "verify": True, "trees_valid": [True, True]}


@pytest.mark.parametrize("probe", [v for v in IMPORT_VERSIONS if not is_v1(v)], indirect=True)
def test_v2_start_up_warms_its_budget_at_every_graph_batch_size(probe):
    """The v2 worker runs the round's eager part at its budget once per batch size the
    target's decode CUDA graphs cover (1, 2 and 16 without graphs), before serving."""
    _, facts = probe
    v2 = facts["round_graphs"]["v2"]
    assert v2["warm_graphs"] == [[1, 15], [2, 15], [4, 15]]
    assert v2["warm_eager"] == [[1, 15], [2, 15], [16, 15]]
    # As the scheduler calls it: DFlash's draft graphs first, then the opt-in capture
    # (declined here: the CPU), then the warm-up (a capture empties PyTorch's allocator
    # caches, so the warm-up's blocks must be cached after it).
    assert v2["init_lines"] == [
        "dflash init_cuda_graphs",
        "DDTREE round graphs not used: not on a CUDA device.",
        "DDTREE eager kernels warmed: budgets [15] x batch sizes [1, 2]",
    ]
    assert v2["init_graphs"] is True


@pytest.mark.parametrize("probe", [v for v in IMPORT_VERSIONS if not is_v1(v)], indirect=True)
def test_each_runner_gets_its_width_v2(probe):
    """v2, with the resolved arguments published: the target runner is sized (graphs,
    logits rows, warmup dummy with the tree mask) at budget + 1, the draft runner at its
    block; the verify gets a window of budget + 1 slots that starts with the block's (and,
    from 0.5.22, a KV index plan of its own)."""
    version, facts = probe
    # 0.5.13 to 0.5.18 resolve the arguments in place; 0.5.19 on through a resolving view.
    assert facts["separate_resolution"] is at_least(version, "0.5.19")
    # SGLang's cache-loc kernel runs in the Triton interpreter except on triton 3.6 (the
    # pin of torch 2.11, so 0.5.17), where the probe's transcription of it stands in.
    if venv_release(version) != "0.5.17":
        assert facts["cache_locs_kernel_error"] is None
    chain = facts["widths"].pop("dflash")  # DFLASH keeps one width: the block
    assert chain["spec_num_draft_tokens"] == chain["max_draft_tokens"] == 16
    assert chain["target"] == [16, 16, False] and chain["draft"] == [16, 16, False]
    for budget, seen in facts["widths"].items():
        width = int(budget) + 1
        assert seen["spec_num_draft_tokens"] == seen["max_draft_tokens"] == width
        assert seen["target"] == [width, width, True]
        assert seen["draft"] == [16, 16, False]
        window = seen["window"]
        assert window["own_window"] is (width != 16)  # budget 15: DFLASH's window as is
        assert window["slots_ok"] and window["block_leads_it"]
        plan = window["kv_plan"]
        if at_least(version, "0.5.22"):
            assert plan["own"] is (width != 16) and plan["writes_ok"]
            assert plan["read_extent"] == width and plan["block_plan_kept"]
        else:
            assert plan is None  # no KV index plan in this release


@pytest.mark.parametrize("probe", ["0.5.13"], indirect=True)
def test_each_runner_gets_its_width(probe):
    """0.5.13: the draft runner's own ServerArgs copy carries the block."""
    version, facts = probe
    chain = facts["widths"].pop("dflash")  # DFLASH keeps one width: the block
    assert chain["draft_num_draft_tokens"] == chain["verify_width"] == 16
    assert chain["constructed_until"].startswith("_DraftRunnerBuilt")
    assert chain["decode_reservation_3_reqs"] == 3 * 16
    for budget, seen in facts["widths"].items():
        width = int(budget) + 1
        assert seen["verify_width"] == width
        # the draft runner is built with the drafter's block, not the verify width
        assert seen["draft_num_draft_tokens"] == 16 and seen["is_draft_worker"] is True
        assert seen["constructed_until"].startswith("_DraftRunnerBuilt")
        # target graphs are captured with the tree mask at budget + 1; the draft's at 16
        assert seen["capture_dummy"] == {"target": [width, True], "draft": [16, False]}
        assert seen["decode_reservation_3_reqs"] == 3 * max(width, 16)
    assert facts["tree_worker_unresolved"].startswith(
        "ValueError: DDTREE needs the drafter's block size, the budget and the verify width"
    )


def test_verify_inputs_at_budgets_8_and_64(probe):
    """Trees over 15 drafted positions (a block-16 drafter) at budgets 8, 15 and 64."""
    version, facts = probe
    for budget, vi in facts["verify_input_budgets"].items():
        assert vi["widths"] == [int(budget) + 1]
        assert vi["mask_errors"] == [] and vi["position_errors"] == 0
        assert vi["kernel_walk_mismatches"] == (0 if is_v1(version) else None)
        assert vi["deepest_accept_len"] >= 4
    if not is_v1(version):  # the DDTREE v2 worker's round at verify widths 33 and 65
        for name in ("verify_round_32", "verify_round_64"):
            r = facts[name]
            assert max(r["walk_accept_len"]) > 2
            assert r["commit_lens"] == r["walk_accept_len"]
            assert r["bonus"] == r["walk_bonus"] and r["tokens_ok"]
            assert r["out_tokens_shape"] == [3, 16] and r["hidden_shape"] == [3 * 16, 8]
            assert_window_fronts(r)
            assert r["hidden_ok"]
        return
    r = facts["verify_round_64"]
    assert max(r["walk_accept_len"]) > 2
    assert r["commit_lens"] == [*r["walk_accept_len"][:2], 2]
    assert r["appended"] == r["expected_appended"]
    assert r["kv_rows"] == r["expected_kv"] and r["freed"] == r["expected_freed"]
    assert r["hidden_ok"]
