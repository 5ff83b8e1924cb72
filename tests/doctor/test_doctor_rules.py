"""Operational rules, the per-host report and the cross-host difference table.

Unit/port/process facts here have the shape our collector produces on a real host (the
nspawn tests collect them for real); GPU/package facts come from the captured fixtures.
"""

from __future__ import annotations

import json

from ddtree_cli.doctor.cuda_rules import check_persistence_mode
from ddtree_cli.doctor.fairness import check_fairness, differences
from ddtree_cli.doctor.kernel_rules import check_attention_backend
from ddtree_cli.doctor.process_rules import check_leftover_processes
from ddtree_cli.doctor.report import DoctorOptions, HostFacts, build_report
from ddtree_cli.doctor.service_rules import (
    check_disk,
    check_health,
    check_ports,
    check_unit,
    check_unit_settings,
)
from ddtree_cli.doctor.verdict import Status
from ddtree_cli.errors import RemoteError


def unit_facts(active, sub, journal=(), result="success", status="0", pid="0"):
    return {
        "systemd": {
            "present": True,
            "unit": "sglang",
            "error": None,
            "journal": list(journal),
            "properties": {
                "LoadState": "loaded",
                "ActiveState": active,
                "SubState": sub,
                "Result": result,
                "ExecMainStatus": status,
                "ExecMainPID": pid,
                "NRestarts": "2",
            },
        }
    }


def test_running_unit_passes():
    verdict = check_unit(unit_facts("active", "running", ["Uvicorn running"]), "sglang")
    assert verdict.status is Status.PASS
    assert verdict.detail == "sglang active (running), 2 restart(s)"


def test_running_unit_that_fell_back_to_cpu_fails():
    journal = [
        "Warning: No accelerator (CUDA, XPU, HPU) is available. - Falling back to CPU",
        "Auto-configed device: cpu",
        "Uvicorn running",
    ]  # sglang#11395
    verdict = check_unit(unit_facts("active", "running", journal), "sglang")
    assert verdict.status is Status.FAIL
    assert "Auto-configed device: cpu" in verdict.detail


def test_crash_looping_unit_fails_with_its_last_lines():
    journal = [f"line {i}" for i in range(30)]
    verdict = check_unit(
        unit_facts("activating", "auto-restart", journal, "exit-code", "1"), "sglang"
    )
    assert verdict.status is Status.FAIL
    assert "line 29" in verdict.detail and "line 21" not in verdict.detail
    assert "exit status 1" in verdict.detail


def test_stopped_unit_warns_and_missing_unit_fails():
    verdict = check_unit(unit_facts("inactive", "dead"), "sglang")
    assert verdict.status is Status.WARN
    assert verdict.fix == "systemctl start sglang.service"
    facts = unit_facts("inactive", "dead")
    facts["systemd"]["properties"]["LoadState"] = "not-found"
    assert check_unit(facts, "sglang").status is Status.FAIL


def test_port_owned_by_the_unit_passes_and_by_someone_else_fails():
    facts = unit_facts("active", "running", pid="4242")
    facts["ports"] = [
        {
            "port": 30000,
            "listening": True,
            "pids": [4242],
            "processes": ["python -m sglang.launch_server"],
            "cgroups": ["0::/system.slice/sglang.service"],
        }
    ]
    assert check_ports(facts, "sglang")[0].status is Status.PASS
    facts["ports"][0].update(
        pids=[99], processes=["python -m http.server"], cgroups=["0::/user.slice"]
    )
    verdict = check_ports(facts, "sglang")[0]
    assert verdict.status is Status.FAIL
    assert verdict.fix == "stop it (kill 99) or serve on another --port"
    # Without --unit we cannot tell whose server it is: a warning with the owner.
    assert check_ports(facts, None)[0].status is Status.WARN


def test_leftover_scheduler_reports_the_gpu_memory_it_holds(h200):
    # Shapes as the collector writes them (see test_leftovers_real.py for real processes):
    # pid 7's launcher is gone (re-parented to init); pid 8 belongs to a live unit's server.
    h200["processes"] = [
        {
            "pid": 7,
            "name": "sglang::scheduler_TP0",
            "cmdline": "sglang::scheduler_TP0",
            "cgroup": "0::/user.slice/user-0.slice/session-3.scope",
            "ppid": 1,
            "parent_cmdline": "/sbin/init",
            "parent_is_launcher": False,
            "parent_is_sglang": False,
            "unit": "session-3.scope",
            "unit_active_state": "active",
        },
        {
            "pid": 8,
            "name": "sglang::detokenizer",
            "cmdline": "sglang::detokenizer",
            "cgroup": "0::/system.slice/sglang.service",
            "ppid": 5,
            "parent_cmdline": "/opt/venv/bin/python3 -m sglang.launch_server --port 30000",
            "parent_is_launcher": True,
            "parent_is_sglang": False,
            "unit": "sglang.service",
            "unit_active_state": "active",
        },
    ]
    h200["nvidia_smi"]["compute_apps"] = [
        {
            "pid": 7,
            "process_name": "sglang::scheduler_TP0",
            "gpu_uuid": None,
            "used_memory_mib": 101376,
        }
    ]
    verdict = check_leftover_processes(h200, "sglang")
    assert verdict.status is Status.FAIL
    assert "pid 7 sglang::scheduler_TP0: its launcher is gone" in verdict.detail
    assert "holding 101376 MiB of GPU memory" in verdict.detail
    assert "pid 8" not in verdict.detail  # its launcher and its unit live: not a leftover
    assert verdict.fix.startswith("kill 7 ")


def test_children_of_a_stopped_unit_are_leftovers_even_under_their_launcher(h200):
    # KillMode=none: systemd stopped the unit and left its whole tree running.
    h200["processes"] = [
        {
            "pid": 8, "name": "sglang::scheduler_TP0", "cmdline": "sglang::scheduler_TP0",
            "cgroup": "0::/system.slice/sglang.service", "ppid": 5,
            "parent_cmdline": "/opt/venv/bin/sglang serve --port 30000",
            "parent_is_launcher": True, "parent_is_sglang": False,
            "unit": "sglang.service", "unit_active_state": "inactive",
        }
    ]  # fmt: skip
    verdict = check_leftover_processes(h200, None)
    assert verdict.status is Status.FAIL
    assert "its unit sglang.service is inactive" in verdict.detail
    assert verdict.fix.startswith("stop the server left in a stopped unit: kill 5 ")


def test_facts_without_parents_are_never_a_kill(h200):
    # What a collector older than the parent fields wrote: no verdict to act on.
    h200["processes"] = [{"pid": 7, "name": "sglang::scheduler_TP0",
                          "cmdline": "sglang::scheduler_TP0", "cgroup": "0::/"}]  # fmt: skip
    verdict = check_leftover_processes(h200, None)
    assert verdict.status is Status.WARN
    assert "kill" not in verdict.fix and "ps -o pid,ppid,cmd -p 7" in verdict.fix


def test_disk_thresholds():
    gib = 1024**3
    facts = {
        "disk": [
            {"path": "/", "free_bytes": 500 * gib, "total_bytes": 900 * gib},
            {"path": "/opt/ddtree", "free_bytes": 4 * gib, "total_bytes": 50 * gib},
        ]
    }
    verdict = check_disk(facts)
    assert verdict.status is Status.FAIL
    assert "4.0 GiB free at /opt/ddtree" in verdict.detail
    facts["disk"][1]["free_bytes"] = 20 * gib
    assert check_disk(facts).status is Status.WARN


def test_health_verdicts():
    ok = {"url": "http://h:30000/health", "status": 200, "error": None}
    assert check_health(ok, "here").status is Status.PASS
    assert check_health(dict(ok, status=503), "here").status is Status.WARN
    refused = dict(ok, status=None, error="[Errno 111] Connection refused")
    assert check_health(refused, "here").status is Status.FAIL


def test_h200_and_a40_differ_in_everything_an_ab_depends_on(h200, a40):
    diffs = differences({"h200": h200, "a40": a40})
    keys = [row["key"] for row in diffs]
    for key in (
        "gpu",
        "compute capability",
        "driver",
        "python",
        "torch",
        "torch CUDA",
        "nvcc",
        "sglang",
        "flashinfer-python",
    ):
        assert key in keys
    gpu = next(row for row in diffs if row["key"] == "gpu")
    assert gpu["values"] == {"h200": "1× NVIDIA H200", "a40": "1× NVIDIA A40"}
    verdict = check_fairness(diffs, ["h200", "a40"])
    assert verdict.status is Status.WARN
    assert "measures the hosts, not the algorithm" in verdict.detail


def test_identical_hosts_have_no_differences(h200):
    assert differences({"a": h200, "b": json.loads(json.dumps(h200))}) == []
    assert check_fairness([], ["a", "b"]).status is Status.PASS


def test_report_json_has_the_documented_shape(h200, a40):
    results = [
        HostFacts("h200", h200),
        HostFacts("a40", a40),
        HostFacts("gone", None, RemoteError("cannot reach gone: timed out")),
    ]
    report = build_report(results, DoctorOptions())
    data = report.to_json()
    assert data["ok"] is False
    assert set(data) >= {"ok", "checks", "differences"}
    for check in data["checks"]:
        assert set(check) == {"host", "id", "status", "detail", "fix"}
        assert check["status"] in ("pass", "warn", "fail", "skip")
    gone = [c for c in data["checks"] if c["host"] == "gone"]
    assert gone == [
        {
            "host": "gone",
            "id": "host.reachable",
            "status": "fail",
            "detail": "cannot reach gone: timed out",
            "fix": "",
        }
    ]
    assert data["checks"][-1]["id"] == "ab.fairness"
    assert {row["key"] for row in data["differences"]} >= {"gpu", "driver"}


def test_fa3_on_an_sm120_gpu_fails_and_on_an_h200_passes(rtx5080, h200):
    # sglang#8373's RTX 5080 (CC 12.0); FA3 supports SM80-SM90 (see docs/doctor.md).
    for facts in (rtx5080, h200):
        facts["systemd"]["server_args"] = {"--attention-backend": "fa3"}
    verdict = check_attention_backend(rtx5080)
    assert verdict.status is Status.FAIL
    assert verdict.detail == "--attention-backend fa3 supports SM80-SM90 only; this host has sm_120"
    assert check_attention_backend(h200).status is Status.PASS


def test_trtllm_mla_prefill_on_sm120_fails(rtx5080):
    rtx5080["systemd"]["server_args"] = {"--prefill-attention-backend": "trtllm_mla"}
    assert check_attention_backend(rtx5080).status is Status.FAIL


def test_server_args_keep_only_whitelisted_flags():
    from ddtree_cli.remote.facts import parse_server_args

    exec_start = (
        "{ path=/opt/v/bin/python ; argv[]=/opt/v/bin/python -m sglang.launch_server "
        "--model-path /m --api-key s3cret --attention-backend=triton "
        "--speculative-algorithm DFLASH ; ignore_errors=no ; start_time=[n/a] }"
    )
    assert parse_server_args(exec_start) == {
        "--attention-backend": "triton",
        "--speculative-algorithm": "DFLASH",
    }


def test_private_devices_fails_and_soft_settings_warn():
    facts = unit_facts("active", "running")
    props = facts["systemd"]["properties"]
    props.update(PrivateDevices="yes")
    assert check_unit_settings(facts, "sglang").status is Status.FAIL
    props.update(
        PrivateDevices="no", DevicePolicy="closed", KillMode="control-group", LimitNOFILE="524288"
    )
    verdict = check_unit_settings(facts, "sglang")
    assert verdict.status is Status.WARN
    assert "char-nvidia-uvm" in verdict.fix
    props.update(DevicePolicy="auto")
    assert check_unit_settings(facts, "sglang").status is Status.PASS


def test_persistence_mode_off_warns(h200):
    h200["nvidia_smi"]["gpus"][0]["persistence_mode"] = "Disabled"
    verdict = check_persistence_mode(h200)
    assert verdict.status is Status.WARN
    assert "nvidia-persistenced" in verdict.fix
    h200["nvidia_smi"]["gpus"][0]["persistence_mode"] = "Enabled"
    assert check_persistence_mode(h200).status is Status.PASS


def test_table_output_shows_the_difference_table(h200, a40, capsys, monkeypatch):
    from ddtree_cli.commands import doctor as command
    from ddtree_cli.console import console

    monkeypatch.setattr(console, "width", 200)
    report = build_report([HostFacts("h200", h200), HostFacts("a40", a40)], DoctorOptions())
    command._print_report(report)
    out = capsys.readouterr().out
    assert "differences across hosts" in out
    row = next(line for line in out.splitlines() if line.startswith("│ torch CUDA"))
    assert "13.0" in row and "12.1" in row
    assert "ab.fairness" in out


def test_checkpoint_paths_come_from_execstart():
    from ddtree_cli.remote.facts import _arg_parser, _options_to_argv, checkpoint_paths

    exec_start = (
        "{ path=/v/bin/python ; argv[]=/v/bin/python -m sglang.launch_server --model-path /m/t "
        "--speculative-draft-model-path=/m/d --api-key s3cret ; ignore_errors=no }"
    )
    assert checkpoint_paths(exec_start) == {"target": "/m/t", "draft": "/m/d"}
    assert checkpoint_paths("{ argv[]=python -m sglang.launch_server --port 1 ; }") == {}
    # What doctor passes to the script on a remote host comes back as the same mapping.
    argv = _options_to_argv(None, None, (), (), None, True, 5.0, {"draft": "/m/d"})
    args = _arg_parser().parse_args(argv)
    assert dict(item.partition("=")[::2] for item in args.checkpoint) == {"draft": "/m/d"}


def _ckpt_facts(ids, target_layers=4, declared=4, draft_layers=1):
    dflash = {"block_size": 16, "target_layer_ids": ids, "num_target_layers": declared,
              "mask_token_id": 257}  # fmt: skip
    return {"checkpoints": {
        "target": {"path": "/m/t", "local": True, "error": None,
                   "config": {"num_hidden_layers": target_layers}},
        "draft": {"path": "/m/d", "local": True, "error": None,
                  "config": {"num_hidden_layers": draft_layers, "dflash_config": dflash}},
    }}  # fmt: skip


def test_draft_layers_rule():
    from ddtree_cli.doctor.checkpoints import check_draft_layers as check

    assert check(_ckpt_facts([1, 2])).status is Status.PASS
    # The drafter of the first H200 attempt: layers (1, 3) of a 4-layer target.
    last = check(_ckpt_facts([1, 3]))
    assert last.status is Status.FAIL and "layer 3 is the target's last" in last.detail
    assert "target_layer_ids below 3" in last.fix
    assert check(_ckpt_facts([-1, 2])).status is Status.FAIL
    wrong = check(_ckpt_facts([1, 2], target_layers=8))
    assert wrong.status is Status.FAIL and "made for a 4-layer target" in wrong.detail
    # Without num_target_layers SGLang bounds the ids by the draft's own layer count.
    bounded = check(_ckpt_facts([1, 2], declared=None))
    assert bounded.status is Status.FAIL and "num_target_layers" in bounded.fix
    assert check(_ckpt_facts([0], declared=None)).status is Status.PASS
    # Nothing to judge: no draft, a hub id, a draft that is not DFlash.
    assert check({"checkpoints": {}}).status is Status.SKIP
    hub = {"checkpoints": {"draft": {"path": "org/draft", "local": False, "config": None,
                                     "error": "not a local folder"}}}  # fmt: skip
    assert check(hub).status is Status.SKIP
    plain = _ckpt_facts([1])
    plain["checkpoints"]["draft"]["config"].pop("dflash_config")
    assert check(plain).status is Status.SKIP


def test_launch_checkpoints_only_for_sglang_launches():
    from ddtree_cli.deploy.config import LaunchConfig
    from ddtree_cli.doctor.checkpoints import launch_checkpoints

    sglang = LaunchConfig(model_path="/m/t", draft_model_path="/m/d")
    assert launch_checkpoints(sglang) == {"target": "/m/t", "draft": "/m/d"}
    assert launch_checkpoints(LaunchConfig(model_path="Qwen/Qwen3-8B")) == {
        "target": "Qwen/Qwen3-8B"
    }
    assert launch_checkpoints(LaunchConfig(kind="embedded", model_path="/m/t")) == {}
