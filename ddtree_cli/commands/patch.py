"""`ddtree patch`: add DDTREE to an SGLang snapshot; check, preview, revert, export, fetch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.syntax import Syntax

from ddtree_cli.commands._options import DryRunOpt, JsonOpt
from ddtree_cli.console import console, emit_json, err_console, info
from ddtree_cli.errors import DdtreeError, UsageError
from ddtree_cli.patching import engine, fetch, recognise, snapshot


def _snapshot_json(snap: snapshot.Snapshot) -> dict:
    return {
        "root": str(snap.root),
        "kind": snap.kind.value,
        "version": snap.version,
        "layout": snap.layout.value,
    }


def _print_diff(text: str) -> None:
    if console.is_terminal:
        console.print(Syntax(text, "diff", theme="ansi_dark", background_color="default"))
    else:
        sys.stdout.write(text)


def patch(
    snapshot_path: Annotated[
        Path | None,
        typer.Argument(
            metavar="[SNAPSHOT]",
            help="sglang git checkout, its python/sglang, an installed sglang folder or an "
            "extracted wheel (default: the current folder, or the --fetch result).",
        ),
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Report applied | pristine | drifted; exit 0 only if applied."
        ),
    ] = False,
    dry_run: DryRunOpt = False,
    revert: Annotated[
        bool, typer.Option("--revert", help="Restore every touched file byte for byte.")
    ] = False,
    export: Annotated[
        Path | None,
        typer.Option(
            "--export", metavar="FILE", help="Write the patch as one file for `git apply`."
        ),
    ] = None,
    fetch_version: Annotated[
        str | None,
        typer.Option(
            "--fetch", metavar="VERSION", help="Download that sglang wheel and extract it."
        ),
    ] = None,
    into: Annotated[
        Path | None,
        typer.Option(
            "--into", metavar="DIR", help="Where --fetch extracts (default ./sglang-VERSION)."
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Match hunks by their context on unknown or edited snapshots."
        ),
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Add the DDTREE speculative algorithm to an SGLang snapshot (atomic, revertible)."""
    modes = [
        m for m, on in (("--check", check), ("--dry-run", dry_run), ("--revert", revert)) if on
    ]
    if len(modes) > 1:
        raise UsageError(f"{' and '.join(modes)} cannot be combined")
    if into is not None and fetch_version is None:
        raise UsageError("--into only goes with --fetch")

    out: dict = {}
    if fetch_version is not None:
        if snapshot_path is not None:
            raise UsageError("give either SNAPSHOT or --fetch, not both")
        if json_out or not err_console.is_terminal:
            snapshot_path = fetch.fetch(fetch_version, into)
        else:
            with err_console.status(f"Fetching sglang {fetch_version} from the package index…"):
                snapshot_path = fetch.fetch(fetch_version, into)
        out["fetched"] = str(snapshot_path)
        if not (check or dry_run or revert or export):
            # Fetching alone prepares a pristine snapshot; patching is the next explicit step.
            snap = snapshot.detect(snapshot_path)
            try:
                match = recognise.identify(snap)
            except DdtreeError:
                match = None
            out.update(
                snapshot=_snapshot_json(snap),
                supported=match is not None,
                match=match.to_json() if match else None,
            )
            series_note = f", series {match.series.version}" if match else ", no series fits"
            _finish(
                json_out,
                out,
                f"Extracted sglang {snap.version} ({snap.layout.value}{series_note}) to {snap.root}",
            )
            return

    snap = snapshot.detect(snapshot_path or Path.cwd())
    out["snapshot"] = _snapshot_json(snap)

    if export is not None:
        text = engine.export_patch(snap, None, force=force)
        export.write_text(text, encoding="utf-8")
        out["exported"] = str(export)
        if not (check or dry_run or revert):
            _finish(
                json_out,
                out,
                f"Wrote {export} (apply with `git apply` from {snap.git_root or snap.root})",
            )
            return

    if check:
        result = engine.check(snap, force=force)
        out.update(
            state=result.state.value,
            series=result.series_version,
            forced=result.match.forced,
            match=result.match.to_json(),
            files=[
                {"path": f.path, "state": f.state.value, "detail": f.detail} for f in result.files
            ],
        )
        if json_out:
            emit_json(out)
        else:
            for f in result.files:
                if f.state in (engine.State.DRIFTED, engine.State.OUTDATED):
                    err_console.print(f"  {f.state.value:<8} {f.path} {f.detail}")
            console.print(
                f"{snap.root}: sglang {snap.version} is [bold]{result.describe()}[/] "
                f"(series {result.series_version}: {result.match.why})"
            )
            if result.state is engine.State.OUTDATED:
                info(f"`ddtree patch {snap.root}` brings it to this version's series")
        raise typer.Exit(int(engine.CHECK_EXIT[result.state]))

    if revert:
        result = engine.revert(snap, force=force)
        out.update(
            restored=result.restored, removed=result.removed, nothing_to_do=result.nothing_to_do
        )
        message = (
            f"{snap.root} carries no ddtree patch; nothing to revert"
            if result.nothing_to_do
            else f"Reverted {len(result.restored)} files and removed {len(result.removed)}"
        )
        _finish(json_out, out, message)
        return

    if dry_run:
        match, changes = engine.plan(snap, force=force)
        diff = "".join(c.diff() for c in changes)
        out.update(
            series=match.series.version,
            forced=match.forced,
            match=match.to_json(),
            files=[c.path for c in changes],
            diff=diff,
        )
        if json_out:
            emit_json(out)
        elif not changes:
            info(f"{snap.root} is already patched; nothing would change")
        else:
            _print_diff(diff)
            info(f"Would change {len(changes)} files (nothing written)")
        return

    result = engine.apply(snap, force=force)
    out.update(
        series=result.series_version,
        forced=result.forced,
        match=result.match.to_json(),
        changed=result.changed,
        compiled=result.compiled,
        already_applied=result.already_applied,
        updated=result.updated,
    )
    message = (
        f"sglang {snap.version} at {snap.root} is already patched"
        if result.already_applied
        else f"Updated the ddtree patch of sglang {snap.version} at {snap.root} to this "
        f"version's series {result.series_version}: {len(result.changed)} files; revert "
        f"with `ddtree patch --revert {snap.root}`"
        if result.updated
        else f"Patched sglang {snap.version} ({snap.layout.value}, series "
        f"{result.series_version}{', forced' if result.forced else ''}): "
        f"{len(result.changed)} files, all compiled; revert with `ddtree patch --revert {snap.root}`"
    )
    _finish(json_out, out, message)


def _finish(json_out: bool, out: dict, message: str) -> None:
    if json_out:
        emit_json(out)
    else:
        console.print(message)


def register(app: typer.Typer) -> None:
    app.command("patch")(patch)
