"""Leftover ``sglang::`` processes: told apart from the children of live servers (started by
hand or by a unit), which are never to be killed."""

from __future__ import annotations

import re

from ddtree_cli.doctor.verdict import Verdict, failed, passed, warned
from ddtree_cli.remote import facts as host_facts


def in_unit_cgroup(cgroup: str | None, unit: str) -> bool:
    return bool(cgroup) and (cgroup.endswith(f"/{unit}") or f"/{unit}/" in cgroup)


def unit_name(unit: str) -> str:
    return unit if "." in unit else f"{unit}.service"


_LIVE_UNIT_STATES = ("active", "activating", "reloading", "deactivating")


def _server_root(process: dict, by_pid: dict[int, dict]) -> dict:
    """The top sglang:: process of a server's tree (a scheduler under a DP controller is
    judged with the controller)."""
    seen = set()
    while process.get("parent_is_sglang") and process.get("ppid") in by_pid:
        if process["pid"] in seen:
            break
        seen.add(process["pid"])
        process = by_pid[process["ppid"]]
    return process


def leftover_reason(root: dict) -> str | None:
    """Why the server tree under ``root`` is left over, or None while a live launcher (in
    a live unit, if any) owns it."""
    if "ppid" not in root:
        return None  # facts from a collector that did not read parents: see the caller
    if not root.get("parent_is_launcher"):
        return (
            f"its launcher is gone (re-parented to pid {root.get('ppid')}: "
            f"{(root.get('parent_cmdline') or '?')[:50]})"
        )
    own_unit = root.get("unit") or ""
    state = root.get("unit_active_state")
    if own_unit.endswith(".service") and state and state not in _LIVE_UNIT_STATES:
        return f"its unit {own_unit} is {state}"
    return None


def is_sglang_server(port_entry: dict) -> bool:
    return any(
        re.search(host_facts.LAUNCHER_PATTERN, cmd or "")
        for cmd in port_entry.get("processes") or []
    )


def check_leftover_processes(facts: dict, unit: str | None) -> Verdict:
    """sglang:: processes left behind by a server that is gone, told apart from the children
    of live servers (started by hand or by a unit), which are never to be killed."""
    processes = facts.get("processes") or []
    if not processes:
        return passed("gpu.leftovers", "no sglang:: processes")
    unit_full = unit_name(unit) if unit else None
    props = (facts.get("systemd") or {}).get("properties") or {}
    unit_running = bool(unit) and props.get("ActiveState") == "active"
    by_pid = {p["pid"]: p for p in processes}
    strays, owned = [], {}
    for process in processes:
        root = _server_root(process, by_pid)
        reason = leftover_reason(root)
        if reason:
            strays.append((process, root, reason))
        else:
            owned.setdefault(root.get("ppid"), []).append((process, root))
    if strays:
        return _leftovers_verdict(facts, strays)
    if any("ppid" not in p for p in processes):
        pids = " ".join(str(p["pid"]) for p in processes)
        return warned(
            "gpu.leftovers",
            f"{len(processes)} sglang:: process(es) (pid {pids}); these facts do not say "
            "whether their launcher still runs",
            f"ps -o pid,ppid,cmd -p {pids} shows their parents; a parent that is "
            "python -m sglang.launch_server or sglang serve is a live server",
        )
    servers, beside = [], []
    for launcher, members in sorted(owned.items(), key=lambda item: str(item[0])):
        root = members[0][1]
        where = f" in {root['unit']}" if (root.get("unit") or "").endswith(".service") else ""
        label = f"launcher pid {launcher}{where} ({(root.get('parent_cmdline') or '?')[:60]})"
        servers.append(f"{len(members)} under {label}")
        if unit_running and not any(in_unit_cgroup(p.get("cgroup"), unit_full) for p, _ in members):
            beside.append(label)
    summary = f"{len(processes)} sglang:: process(es) of {len(owned)} live server(s): " + (
        "; ".join(servers)
    )
    if beside:
        return warned(
            "gpu.leftovers",
            f"a server outside {unit_full} runs while {unit_full} runs, sharing its GPUs: "
            + "; ".join(beside),
            "if it is not meant to run beside the service, stop that server (its launcher "
            "stops its children); it is live, not a leftover",
        )
    return passed("gpu.leftovers", "no leftovers: " + summary)


def _leftovers_verdict(facts: dict, strays: list) -> Verdict:
    gpu_mib = {
        app.get("pid"): app.get("used_memory_mib") or 0
        for app in (facts.get("nvidia_smi") or {}).get("compute_apps") or []
    }
    held = sum(gpu_mib.get(p["pid"], 0) for p, _, _ in strays)
    names = ", ".join(
        f"pid {p['pid']} {p.get('name') or p['cmdline'][:40]}: {reason}"
        for p, _, reason in strays[:4]
    )
    orphans = [p["pid"] for p, root, _ in strays if not root.get("parent_is_launcher")]
    launchers = sorted({root["ppid"] for _, root, _ in strays if root.get("parent_is_launcher")})
    fixes = []
    if orphans:
        fixes.append(
            f"kill {' '.join(map(str, orphans))} (scheduler children outlive their launcher; "
            "KillMode=control-group in the unit prevents this)"
        )
    if launchers:
        fixes.append(
            f"stop the server{'s' if len(launchers) > 1 else ''} left in a stopped unit: kill "
            f"{' '.join(map(str, launchers))} (its launcher; SGLang stops its children)"
        )
    return failed(
        "gpu.leftovers",
        f"{len(strays)} leftover sglang:: process(es) ({names})"
        + (f", holding {held} MiB of GPU memory" if held else ""),
        "; ".join(fixes),
    )
