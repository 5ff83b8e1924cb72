"""Today's rules over the facts `ddtree doctor` collected on an H200 in every state of
benchmarks/sglang_h200/doctor_states.sh (SGLang 0.5.17; fixtures/README.md has the runs).

Healthy states must give no FAIL; the broken ones must fail with the fix that repaired
that machine, and no fix may remove or kill what a healthy host needs.
"""

from __future__ import annotations

import re

import pytest

from ddtree_cli.doctor.report import DoctorOptions, HostFacts, build_report
from ddtree_cli.doctor.snapshot_abi import read_snapshot_abi
from ddtree_cli.doctor.snapshot_rules import check_patch_state, check_sglang_vs_snapshot
from ddtree_cli.doctor.verdict import Status
from ddtree_cli.errors import DdtreeError
from ddtree_cli.patching import engine, fetch, snapshot
from tests.conftest import require
from tests.doctor.conftest import load_h200_state

# The states, with the ports doctor was given there (DOCTOR_PORTS="30000 30001 30002 30003":
# plain, DFLASH, DDTREE budget 15, DDTREE budget 64; `installed` and `bare` had none).
SERVER_PORTS = (30000, 30001, 30002, 30003)
PORTS = {
    "bare": (),
    "installed": (),
    "installed-snapshot": (),
    "serving": SERVER_PORTS,
    "leftover": SERVER_PORTS,
    "leftover-fixed": SERVER_PORTS,
    "broken": SERVER_PORTS,
    "repaired": SERVER_PORTS,
}
HEALTHY = ("bare", "installed", "serving")
# The checks that read the --snapshot folder itself, not the facts (not re-run here).
SNAPSHOT_CHECKS = {"snapshot.patch", "python.abi", "sglang.version"}


def verdicts(state: str) -> dict:
    facts = load_h200_state(state)
    report = build_report([HostFacts("local", facts)], DoctorOptions(ports=PORTS[state]))
    return {check.id: check for check in report.checks}


def fails(found: dict) -> dict:
    return {i: v for i, v in found.items() if v.status is Status.FAIL}


def torch_dependencies(facts: dict) -> set[str]:
    """The distributions the installed torch pulls in: its Requires-Dist and cuda-toolkit's."""
    names = set()
    for line in facts["requires"]["torch"] + facts["requires"]["cuda-toolkit"]:
        names.add(re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower())
    return names | {p for p in facts["packages"] if p.startswith("nvidia-")}


@pytest.mark.parametrize("state", sorted(PORTS))
def test_todays_rules_give_the_statuses_recorded_on_the_h200(state):
    recorded = {c["id"]: c["status"] for c in load_h200_state(state, "doctor")["checks"]}
    now = {i: v.status.value for i, v in verdicts(state).items()}
    # installed-snapshot's snapshot checks read the snapshot folder, which is not kept:
    # without --snapshot they skip.
    assert {i: now.pop(i) for i in SNAPSHOT_CHECKS if i in now} == {
        "python.abi": "skip",
        "sglang.version": "skip",
    }
    assert now == {i: s for i, s in recorded.items() if i not in SNAPSHOT_CHECKS}


@pytest.mark.parametrize("state", HEALTHY)
def test_a_healthy_h200_has_no_fail(state):
    found = verdicts(state)
    assert fails(found) == {}
    packages = found["cuda.packages"]
    assert packages.status is Status.PASS
    assert "belong to CUDA 13, judged by torch's own pins" in packages.detail
    for verdict in found.values():
        assert "uninstall" not in verdict.fix and "kill" not in verdict.fix


@pytest.mark.parametrize("state", ["installed", "serving"])
def test_the_live_servers_started_by_hand_are_not_leftovers(state):
    facts = load_h200_state(state)
    launchers = {p["ppid"] for p in facts["processes"]}
    assert len(facts["processes"]) == 8 and len(launchers) == 4  # the facts' own count
    leftovers = verdicts(state)["gpu.leftovers"]
    assert leftovers.status is Status.PASS
    assert "8 sglang:: process(es) of 4 live server(s)" in leftovers.detail
    for pid in launchers:
        assert f"launcher pid {pid} " in leftovers.detail
    assert leftovers.fix == ""


def test_serving_names_sglang_on_every_port_and_health_passes():
    found = verdicts("serving")
    for port in SERVER_PORTS:
        assert found[f"service.port.{port}"].status is Status.PASS
        assert "served by SGLang" in found[f"service.port.{port}"].detail
    assert found["service.health"].status is Status.PASS


@pytest.mark.parametrize("state", ["leftover", "leftover-fixed"])
def test_a_killed_launcher_leaves_no_process_to_kill(state):
    serving, facts = load_h200_state("serving"), load_h200_state(state)
    plain = next(p["pids"][0] for p in serving["ports"] if p["port"] == 30000)
    children = {p["pid"] for p in serving["processes"] if p["ppid"] == plain}
    assert len(children) == 2  # plain's scheduler and detokenizer while it served
    # SGLang's children died with their launcher: none of them is in the facts any more.
    assert not children & {p["pid"] for p in facts["processes"]}
    assert plain not in {p["ppid"] for p in facts["processes"]}
    found = verdicts(state)
    leftovers = found["gpu.leftovers"]
    assert leftovers.status is Status.PASS, leftovers
    assert "6 sglang:: process(es) of 3 live server(s)" in leftovers.detail
    for verdict in found.values():
        assert "kill" not in verdict.fix, verdict
        for pid in children | {plain}:
            assert not re.search(rf"\b{pid}\b", verdict.fix), verdict
    assert set(fails(found)) == {"service.health"}
    health = found["service.health"]
    assert "127.0.0.1:30000/health" in health.detail and "Connection refused" in health.detail
    assert found["service.port.30000"].detail == "port 30000 is free"


def test_a_kernel_built_for_another_torch_fails_with_the_pinned_kernel_as_fix():
    facts = load_h200_state("broken")
    assert facts["packages"]["sglang-kernel"] == "0.4.6.post1"
    found = verdicts("broken")
    assert set(fails(found)) == {"kernels.sgl_kernel", "sglang.pins", "service.health"}
    kernel, pins = found["kernels.sgl_kernel"], found["sglang.pins"]
    assert "sglang-kernel 0.4.6.post1 was built for another torch than 2.11.0+cu130" in (
        kernel.detail
    )
    assert "undefined symbol _ZNR5torch7Library4_def" in kernel.detail
    assert "--force-reinstall --no-deps 'sglang-kernel==0.4.5'" in kernel.fix
    assert "(what sglang 0.5.17 pins)" in kernel.fix
    assert "sglang-kernel 0.4.6.post1 (pinned 0.4.5)" in pins.detail
    assert pins.fix.endswith("-m pip install 'sglang-kernel==0.4.5'")
    assert facts["requires"]["sglang-kernel"] == []  # so that install pulls in nothing else
    # The fixes touch the kernel only: torch and what it pulls in stay as they are.
    torch_own = torch_dependencies(facts) | {"torch"}
    assert {"nvidia-cublas", "nvidia-cudnn-cu13", "triton", "cuda-toolkit"} <= torch_own
    for verdict in (kernel, pins):
        assert "uninstall" not in verdict.fix
        named = set(re.findall(r"'([A-Za-z0-9_.-]+)==", verdict.fix))
        assert named == {"sglang-kernel"} and not named & torch_own


def test_the_fix_applied_makes_both_kernel_checks_pass():
    facts = load_h200_state("repaired")
    assert facts["packages"]["sglang-kernel"] == "0.4.5"
    found = verdicts("repaired")
    assert found["kernels.sgl_kernel"].status is Status.PASS
    assert found["sglang.pins"].status is Status.PASS
    assert "sglang-kernel==0.4.5" in found["sglang.pins"].detail
    assert set(fails(found)) == {"service.health"}  # plain stays stopped since `leftover`


def test_a_0_5_17_snapshot_patched_by_todays_series_passes_the_snapshot_checks(tmp_path):
    # On the H200 these failed "SGLang 0.5.17 is not supported": the ddtree there predated
    # the per-release series. The snapshot folder itself is not kept; this is the same
    # release's wheel from the package index, patched as prepare.py patched the bundle's.
    try:
        wheel = fetch.download_wheel("0.5.17")
    except DdtreeError as exc:
        require(False, f"cannot download sglang 0.5.17: {exc}")
    root = fetch.extract_wheel(wheel, tmp_path / "s")
    engine.apply(snapshot.detect(root))
    patch = check_patch_state(str(root / "sglang"))
    assert patch.status is Status.PASS and "(SGLang 0.5.17)" in patch.detail
    facts = load_h200_state("installed-snapshot")
    version = check_sglang_vs_snapshot(facts, read_snapshot_abi(root / "sglang"))
    assert version.status is Status.PASS
    assert version.detail == "installed sglang 0.5.17 = snapshot 0.5.17"
