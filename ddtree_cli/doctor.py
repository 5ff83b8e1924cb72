"""`ddtree doctor`: host facts in, verdicts (pass / warn / fail / skip + fix) out.

The compatibility rules live in :mod:`ddtree_cli.abi`; this module adds the operational
ones (the unit, its port, leftover ``sglang::`` processes, disk, ``/health``), runs them
all per host, and compares hosts for anything that would make an A/B unfair.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ddtree_cli import abi
from ddtree_cli.abi import SnapshotABI
from ddtree_cli.checkpoints import check_draft_layers
from ddtree_cli.errors import DdtreeError
from ddtree_cli.remote import facts as host_facts
from ddtree_cli.verdict import Status, Verdict, failed, passed, skipped, warned

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


@dataclass(frozen=True)
class DoctorOptions:
    """What the user asked us to look at, besides the host itself."""

    snapshot: SnapshotABI | None = None
    snapshot_path: str | None = None  # local folder, for the patch-state check
    python: str | None = None
    unit: str | None = None
    ports: tuple[int, ...] = ()
    url: str | None = None  # /health checked from where doctor runs
    probes: bool = True
    checkpoints: dict | None = None  # {"target"|"draft": folder} on the host


@dataclass(frozen=True)
class HostCheck:
    host: str
    id: str
    status: Status
    detail: str
    fix: str


@dataclass
class DoctorReport:
    checks: list[HostCheck] = field(default_factory=list)
    differences: list[dict] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(c.status is Status.FAIL for c in self.checks)

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "checks": [
                {
                    "host": c.host,
                    "id": c.id,
                    "status": c.status.value,
                    "detail": c.detail,
                    "fix": c.fix,
                }
                for c in self.checks
            ],
            "differences": self.differences,
            "hosts": self.hosts,
        }


# --- operational rules ---------------------------------------------------------------


def _unit_pids_in(cgroup: str | None, unit: str) -> bool:
    return bool(cgroup) and (cgroup.endswith(f"/{unit}") or f"/{unit}/" in cgroup)


def _unit_name(unit: str) -> str:
    return unit if "." in unit else f"{unit}.service"


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
    logs = f"journalctl -u {_unit_name(unit)} -n 200 --no-pager"
    if active in ("failed",) or (active == "activating" and sub == "auto-restart"):
        result = props.get("Result") or "?"
        status = props.get("ExecMainStatus") or "?"
        return failed(
            "service.unit",
            f"{unit} {state}: result {result}, exit status {status}, {restarts} restart(s); "
            f"last journal lines:\n{lines}"
            if lines
            else f"{unit} {state}: result {result}",
            f"fix the cause in the journal ({logs}), then systemctl restart {_unit_name(unit)}",
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
            f"wait, or follow it with journalctl -fu {_unit_name(unit)}",
        )
    return warned(
        "service.unit",
        f"{unit} {state}" + (f"; last journal lines:\n{lines}" if lines else ""),
        f"systemctl start {_unit_name(unit)}",
    )


MIN_NOFILE = 65535


def check_unit_settings(facts: dict, unit: str | None) -> Verdict:
    """Unit options that hide the GPU or leave orphans behind (see docs/doctor.md)."""
    if not unit:
        return skipped("service.settings", "no --unit given")
    props = (facts.get("systemd") or {}).get("properties") or {}
    if props.get("LoadState") in (None, "not-found"):
        return skipped("service.settings", f"{unit} is not installed")
    name = _unit_name(unit)
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


# Attention backends that only run on some compute capabilities (major, minor) ranges.
_BACKEND_CAPS = {
    "fa3": ((8, 0), (9, 0), "SM80-SM90"),
    "trtllm_mla": ((10, 0), (10, 3), "SM100/SM103"),
}


def check_attention_backend(facts: dict) -> Verdict:
    args = (facts.get("systemd") or {}).get("server_args") or {}
    chosen = {flag: args[flag] for flag in args if "attention-backend" in flag}
    if not chosen:
        return skipped("sglang.attention_backend", "no --attention-backend in the unit's ExecStart")
    caps = {
        abi.capability_tuple(g.get("compute_cap"))
        for g in (facts.get("nvidia_smi") or {}).get("gpus") or []
    } - {None}
    if not caps:
        return skipped("sglang.attention_backend", "no GPU compute capability known")
    for flag, backend in sorted(chosen.items()):
        if backend not in _BACKEND_CAPS:
            continue
        low, high, label = _BACKEND_CAPS[backend]
        wrong = sorted(c for c in caps if not low <= c <= high)
        if wrong:
            sm = ", ".join(f"sm_{a}{b}" for a, b in wrong)
            return failed(
                "sglang.attention_backend",
                f"{flag} {backend} supports {label} only; this host has {sm}",
                f"use {flag} flashinfer (or triton) in the unit's ExecStart",
            )
    listing = ", ".join(f"{f} {b}" for f, b in sorted(chosen.items()))
    return passed("sglang.attention_backend", f"{listing} runs on this GPU")


def check_persistence_mode(facts: dict) -> Verdict:
    gpus = (facts.get("nvidia_smi") or {}).get("gpus") or []
    modes = [g.get("persistence_mode") for g in gpus if g.get("persistence_mode")]
    if not modes:
        return skipped("gpu.persistence", "persistence mode not reported")
    off = [str(g.get("index")) for g in gpus if g.get("persistence_mode") == "Disabled"]
    if off:
        return warned(
            "gpu.persistence",
            f"persistence mode off on GPU {', '.join(off)}: slower first CUDA init, and "
            "NoNewPrivileges= units cannot create device nodes",
            "systemctl enable --now nvidia-persistenced (or nvidia-smi -pm 1)",
        )
    return passed("gpu.persistence", "persistence mode on")


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
            or any(_unit_pids_in(c, _unit_name(unit)) for c in cgroups)
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
        elif _is_sglang_server(entry) and unit:
            # A live server someone started: name it, never kill it.
            verdicts.append(
                failed(
                    check_id,
                    f"port {port} is held by a live SGLang server outside {unit}: {owners}",
                    f"stop that server if it is not meant to run, or serve {unit} on another "
                    "--port",
                )
            )
        elif _is_sglang_server(entry):
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


def _is_sglang_server(port_entry: dict) -> bool:
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
    unit_full = _unit_name(unit) if unit else None
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
        if unit_running and not any(_unit_pids_in(p.get("cgroup"), unit_full) for p, _ in members):
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
    launchers = sorted(
        {root["ppid"] for _, root, _ in strays if root.get("parent_is_launcher")}
    )
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


def check_patch_state(snapshot_path: str) -> Verdict:
    """Is DDTREE in the snapshot to be served? (applied / pristine / drifted, by `patch`)."""
    from pathlib import Path

    from ddtree_cli.patching import engine
    from ddtree_cli.patching.snapshot import detect

    try:
        result = engine.check(detect(Path(snapshot_path)))
    except DdtreeError as exc:
        return failed("snapshot.patch", str(exc), exc.hint or "")
    state = result.state.value
    where = f"{snapshot_path} (SGLang {result.snapshot.version})"
    if state == "applied":
        return passed("snapshot.patch", f"DDTREE applied to {where}")
    if state == "pristine":
        return failed(
            "snapshot.patch",
            f"{where} is pristine: no DDTREE in it",
            f"ddtree patch {snapshot_path}",
        )
    drifted = [f"{f.path}: {f.detail}" for f in result.files if f.state.value == "drifted"]
    return failed(
        "snapshot.patch",
        f"{where} has drifted: " + "; ".join(drifted[:3]) + (" …" if len(drifted) > 3 else ""),
        f"ddtree patch {snapshot_path} --revert (or start from a fresh copy), then ddtree patch",
    )


# --- running everything --------------------------------------------------------------


def diagnose(facts: dict, options: DoctorOptions, health: dict | None = None) -> list[Verdict]:
    """Every verdict for one host's facts, in display order."""
    verdicts = abi.run_abi_checks(facts, options.snapshot)
    verdicts.append(check_persistence_mode(facts))
    verdicts.append(check_unit(facts, options.unit))
    verdicts.append(check_unit_settings(facts, options.unit))
    verdicts.append(check_attention_backend(facts))
    verdicts.append(check_draft_layers(facts))
    verdicts.extend(check_ports(facts, options.unit))
    verdicts.append(check_leftover_processes(facts, options.unit))
    verdicts.append(check_disk(facts))
    if health is not None:
        verdicts.append(check_health(health, "from this machine"))
    elif facts.get("health") and not any(p.get("listening") for p in facts.get("ports") or []):
        verdicts.append(skipped("service.health", "nothing listens on the port to ask /health"))
    else:
        verdicts.append(check_health(facts.get("health"), "from the host"))
    return verdicts


def health_url_on_host(options: DoctorOptions) -> str | None:
    """With --port (and no --url), the host itself GETs its own /health on loopback."""
    if options.url or not options.ports:
        return None
    return f"http://127.0.0.1:{options.ports[0]}/health"


# --- across hosts --------------------------------------------------------------------

_FINGERPRINT: list[tuple[str, Callable[[dict], str | None]]] = [
    (
        "gpu",
        lambda f: (
            ", ".join(
                sorted(
                    f"{sum(1 for g in f['nvidia_smi']['gpus'] if g.get('name') == n)}× {n}"
                    for n in {g.get("name") for g in (f.get("nvidia_smi") or {}).get("gpus") or []}
                )
            )
            or None
        ),
    ),
    (
        "compute capability",
        lambda f: (
            ", ".join(
                sorted(
                    {
                        g.get("compute_cap") or "?"
                        for g in (f.get("nvidia_smi") or {}).get("gpus") or []
                    }
                )
            )
            or None
        ),
    ),
    ("driver", lambda f: (f.get("nvidia_smi") or {}).get("driver_version")),
    ("python", lambda f: (f.get("python") or {}).get("version")),
    ("torch", lambda f: (f.get("torch") or {}).get("version")),
    ("torch CUDA", lambda f: (f.get("torch") or {}).get("cuda")),
    ("nvcc", lambda f: (f.get("nvcc") or {}).get("release")),
]
_FINGERPRINT_PACKAGES = (
    "sglang",
    "sglang-kernel",
    "sgl-kernel",
    "flashinfer-python",
    "flashinfer-cubin",
    "flashinfer-jit-cache",
    "triton",
    "transformers",
)


def fingerprint(facts: dict) -> dict[str, str | None]:
    """What an A/B's two arms must share, per host."""
    result: dict[str, str | None] = {}
    for key, read in _FINGERPRINT:
        try:
            result[key] = read(facts)
        except (KeyError, TypeError):
            result[key] = None
    packages = facts.get("packages") or {}
    for name in _FINGERPRINT_PACKAGES:
        result[name] = packages.get(name)
    env = facts.get("env") or {}
    result["FLASHINFER_DISABLE_VERSION_CHECK"] = env.get("FLASHINFER_DISABLE_VERSION_CHECK")
    return result


def differences(facts_by_host: dict[str, dict]) -> list[dict]:
    """[{"key", "values": {host: value}}] for every fingerprint key on which hosts differ."""
    prints = {host: fingerprint(facts) for host, facts in facts_by_host.items()}
    rows = []
    keys = next(iter(prints.values())).keys() if prints else []
    for key in keys:
        values = {host: fp.get(key) for host, fp in prints.items()}
        if len(set(values.values())) > 1:
            rows.append({"key": key, "values": values})
    return rows


def check_fairness(diffs: list[dict], hosts: list[str]) -> Verdict:
    if len(hosts) < 2:
        return skipped("ab.fairness", "one host")
    if not diffs:
        return passed("ab.fairness", f"{len(hosts)} hosts share GPU, driver, torch and kernels")
    keys = ", ".join(row["key"] for row in diffs)
    return warned(
        "ab.fairness",
        f"hosts differ in {keys}: an A/B across them measures the hosts, not the algorithm",
        "run both arms on one host, or on hosts whose difference table is empty",
    )


# --- collection ----------------------------------------------------------------------


@dataclass
class HostFacts:
    host: str
    facts: dict | None
    error: DdtreeError | None = None


def collect_many(
    hosts: Iterable[str],
    collect: Callable[[str], dict],
    max_workers: int = 8,
) -> list[HostFacts]:
    """Run ``collect(host)`` for every host in parallel; a host's DdtreeError is kept, not
    raised, so one unreachable host does not hide the others' verdicts."""
    hosts = list(hosts)

    def one(host: str) -> HostFacts:
        try:
            return HostFacts(host, collect(host))
        except DdtreeError as exc:
            return HostFacts(host, None, exc)

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(hosts)))) as pool:
        return list(pool.map(one, hosts))


def build_report(
    results: list[HostFacts], options: DoctorOptions, local_health: dict | None = None
) -> DoctorReport:
    report = DoctorReport(hosts=[r.host for r in results])
    if options.snapshot_path:
        verdict = check_patch_state(options.snapshot_path)
        report.checks.append(
            HostCheck("snapshot", verdict.id, verdict.status, verdict.detail, verdict.fix)
        )
    for result in results:
        if result.facts is None:
            error = result.error
            report.checks.append(
                HostCheck(
                    result.host,
                    "host.reachable",
                    Status.FAIL,
                    str(error),
                    (error.hint if error else "") or "",
                )
            )
            continue
        for verdict in diagnose(result.facts, options, local_health):
            report.checks.append(
                HostCheck(result.host, verdict.id, verdict.status, verdict.detail, verdict.fix)
            )
    reached = {r.host: r.facts for r in results if r.facts is not None}
    if len(results) > 1:
        report.differences = differences(reached)
        verdict = check_fairness(report.differences, list(reached))
        report.checks.append(
            HostCheck("all hosts", verdict.id, verdict.status, verdict.detail, verdict.fix)
        )
    return report


def label_for(target: str) -> str:
    """A short host label for tables: "root@10.0.0.5:2222" -> "10.0.0.5:2222"."""
    return re.sub(r"^[^@]+@", "", target)
