"""Rules over the service on the host: its systemd unit (state, journal, settings), its
ports, its ``/health``, and the disk it lives on."""

from __future__ import annotations

from ddtree_cli.doctor.process_rules import in_unit_cgroup, is_sglang_server, unit_name
from ddtree_cli.doctor.verdict import Verdict, failed, passed, skipped, warned

GIB = 1024**3
DISK_FAIL_GIB = 10  # below this a model download or a release sync fails part-way
DISK_WARN_GIB = 30

# Lines in a unit's journal that mean it is not serving what it should, whatever its state.
FATAL_JOURNAL_PATTERNS = (
    "Auto-configed device: cpu",
    "Falling back to CPU",
    "undefined symbol",
    "no kernel image is available",
    "Unsupported architecture",
    "does not match flashinfer version",
    "CUDA out of memory",
    "Traceback (most recent call last)",
)
JOURNAL_LINES_SHOWN = 8


def check_unit(facts: dict, unit: str | None) -> Verdict:
    if not unit:
        return skipped("service.unit", "no --unit given")
    systemd = facts.get("systemd") or {}
    if not systemd.get("present"):
        return failed(
            "service.unit",
            f"systemd is not running on this host, so {unit} cannot run here",
            "serve from a host booted with systemd (ddtree deploy installs a systemd unit)",
        )
    props = systemd.get("properties") or {}
    if systemd.get("error") and not props:
        return failed(
            "service.unit",
            f"cannot read {unit}: {systemd['error']}",
            "run doctor as root or a user in the systemd-journal group",
        )
    load, active, sub = props.get("LoadState"), props.get("ActiveState"), props.get("SubState")
    if load == "not-found":
        return failed(
            "service.unit", f"{unit} is not installed", f"ddtree deploy --host <host> --unit {unit}"
        )
    journal = systemd.get("journal") or []
    fatal = [line for line in journal if any(p in line for p in FATAL_JOURNAL_PATTERNS)]
    restarts = props.get("NRestarts") or "0"
    plain = sub in (None, "", active) or (active, sub) == ("inactive", "dead")
    state = active if plain else f"{active} ({sub})"
    if active == "active" and sub == "running" and not fatal:
        return passed("service.unit", f"{unit} {state}, {restarts} restart(s)")
    tail = journal[-JOURNAL_LINES_SHOWN:]
    shown = fatal[-3:] if fatal and active == "active" else tail
    lines = "\n".join(f"  {line}" for line in shown)
    logs = f"journalctl -u {unit_name(unit)} -n 200 --no-pager"
    if active in ("failed",) or (active == "activating" and sub == "auto-restart"):
        result = props.get("Result") or "?"
        status = props.get("ExecMainStatus") or "?"
        return failed(
            "service.unit",
            f"{unit} {state}: result {result}, exit status {status}, {restarts} restart(s); "
            f"last journal lines:\n{lines}"
            if lines
            else f"{unit} {state}: result {result}",
            f"fix the cause in the journal ({logs}), then systemctl restart {unit_name(unit)}",
        )
    if fatal:
        return failed(
            "service.unit",
            f"{unit} is {state} but its journal shows:\n{lines}",
            f"see {logs}; the matching doctor checks above name the fix",
        )
    if active == "activating":
        return warned(
            "service.unit",
            f"{unit} {state}: still starting",
            f"wait, or follow it with journalctl -fu {unit_name(unit)}",
        )
    return warned(
        "service.unit",
        f"{unit} {state}" + (f"; last journal lines:\n{lines}" if lines else ""),
        f"systemctl start {unit_name(unit)}",
    )


MIN_NOFILE = 65535


def check_unit_settings(facts: dict, unit: str | None) -> Verdict:
    """Unit options that hide the GPU or leave orphans behind (see docs/doctor.md)."""
    if not unit:
        return skipped("service.settings", "no --unit given")
    props = (facts.get("systemd") or {}).get("properties") or {}
    if props.get("LoadState") in (None, "not-found"):
        return skipped("service.settings", f"{unit} is not installed")
    name = unit_name(unit)
    if props.get("PrivateDevices") == "yes":
        return failed(
            "service.settings",
            f"{name} has PrivateDevices=yes: /dev/nvidia* is hidden, CUDA finds no GPU",
            f"remove PrivateDevices= from {name}, then systemctl daemon-reload",
        )
    problems, fixes = [], []
    if props.get("DevicePolicy") in ("closed", "strict"):
        problems.append(f"DevicePolicy={props['DevicePolicy']} denies devices not allowed")
        fixes.append(
            "DeviceAllow=char-nvidia rw, DeviceAllow=char-nvidia-uvm rw, DeviceAllow="
            "char-nvidia-caps rw (older drivers: char-nvidia-frontend), or no DevicePolicy="
        )
    if props.get("KillMode") in ("process", "none"):
        problems.append(f"KillMode={props['KillMode']} leaves sglang:: children running on stop")
        fixes.append("KillMode=control-group")
    limit = props.get("LimitNOFILE")
    if limit and limit.isdigit() and int(limit) < MIN_NOFILE:
        problems.append(f"LimitNOFILE={limit} is low for many concurrent streams")
        fixes.append(f"LimitNOFILE={MIN_NOFILE}")
    if problems:
        return warned(
            "service.settings",
            "; ".join(problems),
            f"in {name}: " + ", ".join(fixes) + "; then systemctl daemon-reload",
        )
    return passed("service.settings", "no device sandbox, KillMode and LimitNOFILE are fine")


def check_ports(facts: dict, unit: str | None) -> list[Verdict]:
    verdicts = []
    props = (facts.get("systemd") or {}).get("properties") or {}
    unit_active = props.get("ActiveState") == "active"
    main_pid = props.get("ExecMainPID")
    for entry in facts.get("ports") or []:
        port = entry["port"]
        check_id = f"service.port.{port}"
        if not entry.get("listening"):
            if unit and unit_active:
                verdicts.append(
                    warned(
                        check_id,
                        f"{unit} is active but nothing listens on {port}",
                        f"check --port in {unit}'s ExecStart, or wait for startup",
                    )
                )
            else:
                verdicts.append(passed(check_id, f"port {port} is free"))
            continue
        pids = entry.get("pids") or []
        cgroups = entry.get("cgroups") or []
        owners = (
            ", ".join(
                f"pid {p} ({cmd[:60]})"
                for p, cmd in zip(pids, entry.get("processes") or [], strict=False)
            )
            or "unknown"
        )
        if unit and (
            str(main_pid) in map(str, pids)
            or any(in_unit_cgroup(c, unit_name(unit)) for c in cgroups)
        ):
            verdicts.append(passed(check_id, f"port {port} is served by {unit} ({owners})"))
        elif not pids:
            verdicts.append(
                warned(
                    check_id,
                    f"port {port} is in use by a process doctor cannot see",
                    "run doctor as root to see the owner",
                )
            )
        elif is_sglang_server(entry) and unit:
            # A live server someone started: name it, never kill it.
            verdicts.append(
                failed(
                    check_id,
                    f"port {port} is held by a live SGLang server outside {unit}: {owners}",
                    f"stop that server if it is not meant to run, or serve {unit} on another "
                    "--port",
                )
            )
        elif is_sglang_server(entry):
            verdicts.append(passed(check_id, f"port {port} is served by SGLang ({owners})"))
        elif unit:
            verdicts.append(
                failed(
                    check_id,
                    f"port {port} is held by {owners}, not by {unit}",
                    f"stop it (kill {' '.join(map(str, pids))}) or serve on another --port",
                )
            )
        else:
            verdicts.append(
                warned(
                    check_id,
                    f"port {port} is in use by {owners}",
                    f"if that is not your server: kill {' '.join(map(str, pids))}",
                )
            )
    return verdicts


def check_disk(facts: dict) -> Verdict:
    disks = facts.get("disk") or []
    if not disks:
        return skipped("disk.free", "no disk facts")
    worst = min(disks, key=lambda d: d["free_bytes"])
    free = worst["free_bytes"] / GIB
    detail = f"{free:.1f} GiB free at {worst['path']}"
    if free < DISK_FAIL_GIB:
        return failed(
            "disk.free",
            detail + f" (< {DISK_FAIL_GIB} GiB)",
            f"free space under {worst['path']} (old releases, ~/.cache/huggingface)",
        )
    if free < DISK_WARN_GIB:
        return warned(
            "disk.free",
            detail + f" (< {DISK_WARN_GIB} GiB)",
            "a model download or a new release may not fit",
        )
    return passed("disk.free", detail)


def check_health(health: dict | None, where: str) -> Verdict:
    if health is None:
        return skipped("service.health", "no --url or --port given")
    url = health.get("url")
    status = health.get("status")
    if status == 200:
        return passed("service.health", f"GET {url} -> 200 ({where})")
    if status == 503:
        return warned(
            "service.health",
            f"GET {url} -> 503: the server is still warming up",
            "wait for /health to return 200 before benchmarking",
        )
    if status is not None:
        return failed(
            "service.health",
            f"GET {url} -> {status}",
            "check the server's log (journalctl -u <unit>)",
        )
    return failed(
        "service.health",
        f"GET {url} failed ({where}): {health.get('error')}",
        "start the service (systemctl start <unit>) or check --url/--port",
    )
