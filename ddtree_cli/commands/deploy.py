"""``ddtree deploy``: ship a snapshot to GPU hosts as a systemd service, health-gated."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.live import Live
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table

from ddtree_cli.commands._options import (
    AcceptNewHostKeyOpt,
    DryRunOpt,
    GroupOpt,
    HostsOpt,
    IdentityOpt,
    InventoryOpt,
    JsonOpt,
    KnownHostsOpt,
    SshConfigOpt,
)
from ddtree_cli.console import STATUS_STYLE, console, emit_json, err_console
from ddtree_cli.deploy.report import HostStatus
from ddtree_cli.errors import DdtreeError, ExitCode, UsageError

_STYLE_OF = {
    HostStatus.DRY_RUN: "cyan", HostStatus.PENDING: "cyan", HostStatus.ROLLED_BACK: "yellow",
    HostStatus.ACTIVATING: "yellow", HostStatus.RELOADING: "yellow",
}  # fmt: skip


def _style(state: str) -> str:
    """A host status in green (success), yellow or red; a phase (connecting, syncing, ...) cyan."""
    try:
        status = HostStatus(state)
    except ValueError:
        return "cyan"
    return _STYLE_OF.get(status) or ("green" if status.ok else "red")


def deploy_command(
    config: Annotated[Path, typer.Option("--config", "-c", help="Deployment YAML (see configs/).")],
    host: HostsOpt = None,
    inventory: InventoryOpt = None,
    group: GroupOpt = None,
    identity: IdentityOpt = None,
    algo: Annotated[
        str | None,
        typer.Option(
            help="dflash or ddtree (default: launch.algo). Only the algorithm flags differ."
        ),
    ] = None,
    remote_python: Annotated[
        str | None,
        typer.Option(help="The host's Python with torch and sglang (default: remote.python)."),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="Service port on every host (default: server.port or the inventory's).",
        ),
    ] = None,
    accept_new_host_key: AcceptNewHostKeyOpt = False,
    known_hosts: KnownHostsOpt = None,
    ssh_config: SshConfigOpt = None,
    force: Annotated[
        bool, typer.Option("--force", help="Deploy even when preflight checks fail.")
    ] = False,
    rollback: Annotated[
        bool, typer.Option("--rollback", help="Switch back to the previous release and restart.")
    ] = False,
    status: Annotated[
        bool, typer.Option("--status", help="Show the running release and health; change nothing.")
    ] = False,
    dry_run: DryRunOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Preflight, sync, install a systemd unit, wait until it serves; roll back if it does not."""
    from ddtree_cli import deploy as dp
    from ddtree_cli.deploy.config import load_deploy_config, load_inventory
    from ddtree_cli.remote.hostspec import HostSpec

    if sum([rollback, status, dry_run]) > 1:
        raise UsageError("--rollback, --status and --dry-run are exclusive")
    if algo is not None and algo not in ("dflash", "ddtree"):
        raise UsageError(f"--algo must be dflash or ddtree, got {algo!r}")
    cfg = load_deploy_config(config)
    hosts = [HostSpec.parse(h) for h in host or []]
    if inventory is not None:
        hosts += load_inventory(inventory).select(group)
    elif group is not None:
        raise UsageError("--group needs --inventory")
    if not hosts:
        raise UsageError("no hosts: pass --host or --inventory")
    opts = dp.DeployOptions(
        algo=algo,
        remote_python=remote_python,
        identity=identity,
        accept_new_host_key=accept_new_host_key,
        known_hosts=known_hosts,
        ssh_config=ssh_config,
        service_port=port,
        force=force,
    )

    action = "status" if status else "rollback" if rollback else "dry-run" if dry_run else "deploy"
    rows: dict[str, tuple[str, str]] = {h.label: ("queued", "") for h in hosts}
    lock = threading.Lock()

    def on_event(label: str, phase: str, detail: str) -> None:
        with lock:
            rows[label] = (phase, detail)

    def table() -> Table:
        t = Table(title=f"ddtree {action} · {cfg.name}", title_justify="left")
        t.add_column("host")
        t.add_column("phase")
        t.add_column("detail", overflow="fold")
        with lock:
            for label, (phase, detail) in rows.items():
                style = _style(phase)
                t.add_row(escape(label), f"[{style}]{escape(phase)}[/]", escape(detail[:100]))
        return t

    def work():
        if status:
            return dp.status(cfg, hosts, opts, on_event=on_event)
        if rollback:
            return dp.rollback(cfg, hosts, opts, on_event=on_event)
        return dp.deploy(cfg, hosts, opts, dry_run=dry_run, on_event=on_event)

    if json_out or not console.is_terminal:
        reports = work()
    else:
        with Live(table(), console=err_console, refresh_per_second=4, transient=True) as live:
            done = threading.Event()
            result: list = []

            def runner():
                try:
                    result.append(work())
                except BaseException as exc:  # re-raised in the main thread
                    result.append(exc)
                finally:
                    done.set()

            threading.Thread(target=runner, daemon=True).start()
            while not done.wait(0.25):
                live.update(table())
        if isinstance(result[0], BaseException):
            raise result[0]
        reports = result[0]

    ok = all(r.ok for r in reports)
    if json_out:
        emit_json(
            {
                "ok": ok,
                "action": action,
                "config": str(cfg.path),
                "unit": cfg.unit_name,
                "hosts": [r.to_json() for r in reports],
            }
        )
    else:
        _print_reports(reports, action)
    if not ok:
        failed = [r for r in reports if not r.ok]
        first = failed[0]
        raise DdtreeError(
            f"{len(failed)} of {len(reports)} host(s) failed; {first.host}: "
            f"{first.status}: {first.message or 'see above'}",
            exit_code=ExitCode.REMOTE
            if first.status is HostStatus.UNREACHABLE
            else ExitCode.FAILURE,
        )


def _print_reports(reports, action: str) -> None:
    for r in reports:
        if r.preflight and (
            action == "dry-run"
            or r.status is HostStatus.PREFLIGHT_FAILED
            or any(p.failed for p in r.preflight)
        ):
            t = Table(title=f"preflight · {escape(r.host)}", title_justify="left")
            for col in ("check", "status", "detail", "fix"):
                t.add_column(col, overflow="fold")
            for p in r.preflight:
                t.add_row(p.id, STATUS_STYLE[p.status.value], escape(p.detail), escape(p.fix))
            console.print(t)
        if r.file_diff is not None:
            d = r.file_diff
            console.print(
                f"[bold]{escape(r.host)}[/]: files +{len(d['added'])} "
                f"~{len(d['changed'])} -{len(d['removed'])}"
            )
            for sign, key in (("+", "added"), ("~", "changed"), ("-", "removed")):
                for path in d[key][:50]:
                    console.print(f"  {sign} {escape(path)}")
                if len(d[key]) > 50:
                    console.print(f"  … {len(d[key]) - 50} more {key}")
        if r.unit_diff:
            console.print(Syntax(r.unit_diff, "diff", background_color="default"))
        if r.journal:
            console.print(f"[bold]{escape(r.host)}[/] · last lines of {escape(r.unit)}:")
            for line in r.journal:
                console.print("  " + escape(line), style="dim")
    t = Table(title=f"ddtree {action}", title_justify="left")
    for col in ("host", "status", "release", "url", "uploaded", "detail"):
        t.add_column(col, overflow="fold")
    for r in reports:
        style = _style(r.status)
        uploaded = (
            f"{r.uploaded_files} files, {r.uploaded_bytes / 1e6:.1f} MB"
            if action == "deploy" and r.status is not HostStatus.UNREACHABLE
            else ""
        )
        t.add_row(
            escape(r.host),
            f"[{style}]{r.status}[/]",
            r.release or "-",
            r.url or "-",
            uploaded,
            escape(r.message),
        )
    console.print(t)


def register(app: typer.Typer) -> None:
    app.command("deploy")(deploy_command)
