"""`ddtree doctor`: parse options, collect facts (here or over SSH), print verdicts."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ddtree_cli.commands._options import (
    AcceptNewHostKeyOpt,
    GroupOpt,
    HostsOpt,
    IdentityOpt,
    InventoryOpt,
    JsonOpt,
    KnownHostsOpt,
    SshConfigOpt,
)
from ddtree_cli.console import STATUS_STYLE, console, emit_json, err_console
from ddtree_cli.doctor.checkpoints import checkpoint_roles
from ddtree_cli.doctor.report import (
    DoctorOptions,
    DoctorReport,
    HostFacts,
    build_report,
    collect_many,
    health_url_on_host,
)
from ddtree_cli.errors import ExitCode, UsageError
from ddtree_cli.remote import facts as host_facts


def _targets(hosts: list[str], inventory: Path | None, group: str | None) -> dict[str, object]:
    """label -> what ``remote.ssh.connect`` takes (a "[user@]host[:port]" or an inventory
    HostSpec, which carries its own user, port and key)."""
    targets: dict[str, object] = {h: h for h in hosts}
    if inventory is not None:
        from ddtree_cli.deploy.config import load_inventory

        for spec in load_inventory(inventory).select(group):
            targets.setdefault(spec.label, spec)
    elif group:
        raise UsageError("--group needs --inventory")
    return targets


def _collector(targets, options: DoctorOptions, identity, accept_new, known_hosts, ssh_config):
    def collect(label: str) -> dict:
        from ddtree_cli.remote.ssh import connect

        target = targets[label]
        key = identity or getattr(target, "identity", None)
        with connect(
            target,
            identity=key,
            accept_new_host_key=accept_new,
            known_hosts=known_hosts,
            ssh_config=ssh_config,
        ) as connection:
            return host_facts.collect_remote(
                connection,
                python=options.python,
                unit=options.unit,
                ports=options.ports,
                health_url=health_url_on_host(options),
                probes=options.probes,
                checkpoints=options.checkpoints,
            )

    return collect


def _cell(value: object) -> str:
    return "—" if value is None else str(value)


def _print_report(report: DoctorReport) -> None:
    table = Table(title="ddtree doctor", show_lines=False, expand=False)
    for column in ("host", "check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for check in report.checks:
        table.add_row(
            escape(check.host),
            escape(check.id),
            STATUS_STYLE[check.status.value],
            escape(check.detail),
            escape(check.fix),
        )
    console.print(table)
    if report.differences:
        hosts = [h for h in report.hosts if any(h in row["values"] for row in report.differences)]
        diff = Table(title="differences across hosts (an A/B between them is not fair)")
        diff.add_column("what")
        for host in hosts:
            diff.add_column(escape(host), overflow="fold")
        for row in report.differences:
            diff.add_row(escape(row["key"]), *(escape(_cell(row["values"].get(h))) for h in hosts))
        console.print(diff)
    counts = {s: sum(1 for c in report.checks if c.status.value == s) for s in STATUS_STYLE}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    console.print(("[green]ok[/]" if report.ok else "[red]problems found[/]") + f": {summary}")


def doctor_command(
    host: HostsOpt = None,
    inventory: InventoryOpt = None,
    group: GroupOpt = None,
    identity: IdentityOpt = None,
    accept_new_host_key: AcceptNewHostKeyOpt = False,
    known_hosts: KnownHostsOpt = None,
    ssh_config: SshConfigOpt = None,
    snapshot: Annotated[
        Path | None,
        typer.Option(
            "--snapshot", help="SGLang snapshot to be served: checks its ABI, version, patch."
        ),
    ] = None,
    python: Annotated[
        str | None,
        typer.Option("--python", help="The serving venv's python on the host (default: python3)."),
    ] = None,
    unit: Annotated[str | None, typer.Option("--unit", help="systemd unit of the server.")] = None,
    port: Annotated[
        list[int] | None,
        typer.Option("--port", min=1, max=65535, help="Server port: who holds it, /health on it."),
    ] = None,
    url: Annotated[
        str | None,
        typer.Option("--url", help="Check GET URL (e.g. http://h:30000/health) from here."),
    ] = None,
    no_probes: Annotated[
        bool, typer.Option("--no-probes", help="Skip importing the kernels in subprocesses.")
    ] = False,
    model_path: Annotated[
        str | None,
        typer.Option(
            "--model-path",
            help="Target checkpoint folder on the host (default: the unit's --model-path).",
        ),  # fmt: skip
    ] = None,
    draft_model_path: Annotated[
        str | None,
        typer.Option(
            "--draft-model-path",
            help="DFlash draft checkpoint folder on the host "
            "(default: the unit's --speculative-draft-model-path).",
        ),  # fmt: skip
    ] = None,
    save_facts: Annotated[
        Path | None,
        typer.Option(
            "--save-facts",
            hidden=True,
            help="Also write the collected facts, {host: facts}, as JSON to this file (for "
            "fixtures and bug reports).",
        ),  # fmt: skip
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Pass / warn / fail verdicts with fixes for serving SGLang + DDTree, here or over SSH."""
    from ddtree_cli.doctor.snapshot_abi import read_snapshot_abi

    targets = _targets(host or [], inventory, group)
    if url and len(targets) > 1:
        raise UsageError("--url names one server; use it with at most one --host")
    options = DoctorOptions(
        snapshot=read_snapshot_abi(snapshot) if snapshot else None,
        snapshot_path=str(snapshot) if snapshot else None,
        python=python,
        unit=unit,
        ports=tuple(port or ()),
        url=url,
        probes=not no_probes,
        checkpoints=checkpoint_roles(model_path, draft_model_path),
    )
    quiet = json_out or not sys.stderr.isatty()
    with err_console.status("collecting host facts…") if not quiet else _nothing():
        if targets:
            collect = _collector(
                targets, options, identity, accept_new_host_key, known_hosts, ssh_config
            )
            results = collect_many(list(targets), collect)
        else:
            facts = host_facts.collect_local(
                python=python,
                unit=unit,
                ports=options.ports,
                health_url=health_url_on_host(options),
                probes=options.probes,
                checkpoints=options.checkpoints,
            )
            results = [HostFacts("local", facts)]
        local_health = host_facts.health_facts(url, 10.0) if url else None
    if len(results) == 1 and results[0].error is not None:
        raise results[0].error  # one host, unreachable: one line and the remote exit code
    for result in results:
        if result.error is not None and not json_out:
            err_console.print(f"[red]{escape(result.host)}:[/] {escape(str(result.error))}")
    report = build_report(results, options, local_health)
    if save_facts is not None:
        facts_by_host = {r.host: r.facts for r in results if r.facts is not None}
        save_facts.write_text(json.dumps(facts_by_host, indent=1, sort_keys=True) + "\n")
    if json_out:
        emit_json(report.to_json())
    else:
        _print_report(report)
    if not report.ok:
        raise typer.Exit(int(ExitCode.CHECK_FAILED))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor_command)
