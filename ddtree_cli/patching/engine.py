"""Check, apply and revert a patch series on a snapshot, atomically.

Apply computes every new file in memory, compiles it, saves the originals to the state
folder ``<root>/.ddtree/`` and only then renames staged files into place with SIGINT
blocked; any failure rolls every renamed file back. Revert restores the saved originals
byte for byte and removes the state folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from ddtree_cli.errors import DdtreeError, ExitCode
from ddtree_cli.patching import unidiff
from ddtree_cli.patching.recognise import STATE_MANIFEST, Match, identify, unpatched
from ddtree_cli.patching.recognise import manifest as _manifest
from ddtree_cli.patching.series import Series, load, sha256
from ddtree_cli.patching.snapshot import Snapshot


class State(str, Enum):
    APPLIED = "applied"
    PRISTINE = "pristine"
    DRIFTED = "drifted"
    OUTDATED = "outdated"  # patched by ddtree, untouched since, but by another series content


@dataclass
class FileState:
    path: str
    state: State
    detail: str = ""


@dataclass
class CheckResult:
    snapshot: Snapshot
    match: Match
    state: State
    files: list[FileState]
    # OUTDATED: per file either version of the series touches, what an update starts from
    # and writes (``_update_targets``), computed once here for plan and apply.
    update: list[_Target] | None = field(default=None, repr=False)

    @property
    def series_version(self) -> str:
        return self.match.series.version

    def describe(self) -> str:
        """``applied``, or ``applied (forced, series 0.5.23)`` after a forced apply."""
        if self.state is State.APPLIED and self.match.forced:
            return f"applied (forced, series {self.series_version})"
        return self.state.value


@dataclass
class FileChange:
    path: str
    before: bytes | None  # None: the file is created
    after: bytes | None  # None: the file is removed (an update from another series)

    def diff(self) -> str:
        before = None if self.before is None else self.before.decode("utf-8")
        after = "" if self.after is None else self.after.decode("utf-8")
        return unidiff.make(self.path, before, after)


@dataclass
class ApplyResult:
    snapshot: Snapshot
    series_version: str
    match: Match
    changed: list[str] = field(default_factory=list)
    already_applied: bool = False
    forced: bool = False
    compiled: list[str] = field(default_factory=list)
    updated: bool = False  # it carried another version of the series, now this one


def _read(snapshot: Snapshot, rel: str) -> bytes | None:
    path = snapshot.root / rel
    return path.read_bytes() if path.is_file() else None


def _file_state(series: Series, snapshot: Snapshot, rel: str, manifest: dict | None) -> FileState:
    current = _read(snapshot, rel)
    if manifest is not None and rel in manifest["files"]:
        entry = manifest["files"][rel]
        if current is not None and sha256(current) == entry["after"]:
            return FileState(rel, State.APPLIED)
        return FileState(rel, State.DRIFTED, "changed since ddtree patched it")
    if rel in series.pristine:
        if current is None:
            return FileState(rel, State.DRIFTED, "missing")
        if sha256(current) == series.pristine[rel]:
            return FileState(rel, State.PRISTINE)
        # Patched by other means (e.g. `git apply` of an export)? Undo in memory and compare.
        if unpatched(series, rel, current) is not None:
            return FileState(rel, State.APPLIED)
        return FileState(rel, State.DRIFTED, "differs from the release")
    if current is None:
        return FileState(rel, State.PRISTINE)
    if current == series.new_content(rel):
        return FileState(rel, State.APPLIED)
    return FileState(rel, State.DRIFTED, "exists with other content")


def _overall(files: list[FileState]) -> State:
    states = {f.state for f in files}
    if states == {State.APPLIED}:
        return State.APPLIED
    if states == {State.PRISTINE}:
        return State.PRISTINE
    return State.DRIFTED


def check(snapshot: Snapshot, *, force: bool = False, match: Match | None = None) -> CheckResult:
    match = match or identify(snapshot, force=force)
    manifest = _manifest(snapshot)
    if manifest is not None:
        update = _update_targets(match, snapshot, manifest)
        if update is not None and any(u.current != u.target for u in update):
            files = [
                FileState(u.path, State.OUTDATED, "patched by another version of ddtree")
                if u.current != u.target
                else FileState(u.path, State.APPLIED)
                for u in update
            ]
            return CheckResult(snapshot, match, State.OUTDATED, files, update)
    files = [_file_state(match.series, snapshot, rel, manifest) for rel in match.series.touched]
    return CheckResult(snapshot, match, _overall(files), files)


@dataclass
class _Target:
    path: str
    original: bytes | None  # the release's file (None: absent from it)
    current: bytes | None  # on disk now
    target: bytes | None  # what this version of the series makes of the original


def _update_targets(match: Match, snapshot: Snapshot, manifest: dict) -> list[_Target] | None:
    """Per file that either version of the series touches: the release's original (saved in
    the state folder when ddtree patched the snapshot), what is on disk and what this
    ddtree's series makes of the original. None when the snapshot changed since it was
    patched (a file no longer hashes as recorded, or a saved original is damaged): that is
    drift, not an older patch."""
    series = match.series
    originals = snapshot.state_dir / "originals"
    out: list[_Target] = []
    for rel in sorted(set(manifest["files"]) | set(series.touched)):
        current = _read(snapshot, rel)
        entry = manifest["files"].get(rel)
        if entry is not None:
            if current is None or sha256(current) != entry["after"]:
                return None
            if entry["before"] is None:
                original = None
            else:
                path = originals / rel
                original = path.read_bytes() if path.is_file() else None
                if original is None or sha256(original) != entry["before"]:
                    return None
        else:  # not touched by the recorded patch: as released (or absent)
            original = current
        if rel in series.pristine:
            if original is None:
                return None
            try:
                target = series.patched(rel, original, fuzzy=match.forced)
            except unidiff.DiffError:
                return None
        elif rel in series.touched:
            if entry is None and original is not None:  # a file ddtree did not create
                return None
            target = series.new_content(rel)
        else:  # the recorded patch touched it, this series does not: back to the release
            target = original
        out.append(_Target(rel, original, current, target))
    return out


def plan(snapshot: Snapshot, *, force: bool = False) -> tuple[Match, list[FileChange]]:
    """Every change apply would make, computed in memory. Empty when already applied."""
    result, changes = _plan(snapshot, force=force)
    return result.match, changes


def _plan(snapshot: Snapshot, *, force: bool) -> tuple[CheckResult, list[FileChange]]:
    """The snapshot's state and the changes that would bring it to this series."""
    match = identify(snapshot, force=force)
    series, forced = match.series, match.forced
    result = check(snapshot, force=force, match=match)
    if result.state is State.APPLIED:
        return result, []
    if result.state is State.OUTDATED:
        return result, [FileChange(u.path, u.current, u.target) for u in result.update
                        if u.current != u.target]  # fmt: skip
    if result.state is State.DRIFTED and not force:
        if _manifest(snapshot) is not None:
            raise DdtreeError(
                f"{snapshot.root} was patched and then changed: " + _drift_summary(result.files),
                hint="run `ddtree patch --revert --force` to restore the originals",
            )
        raise DdtreeError(
            f"{snapshot.root} does not match SGLang {series.version} as released: "
            + _drift_summary(result.files),
            hint="start from an unmodified snapshot, or --force to match hunks by their context",
        )
    if result.state is State.DRIFTED and _manifest(snapshot) is not None:
        raise DdtreeError(
            f"{snapshot.root} carries an earlier, changed ddtree patch",
            hint="run `ddtree patch --revert --force` first",
        )
    fuzzy = forced or result.state is State.DRIFTED
    changes: list[FileChange] = []
    for rel in series.touched:
        before = _read(snapshot, rel)
        if rel in series.pristine:
            if before is None:
                raise DdtreeError(f"{rel} is missing from {snapshot.root}")
            try:
                after = series.patched(rel, before, fuzzy=fuzzy)
            except unidiff.DiffError as exc:
                raise DdtreeError(f"cannot patch {snapshot.version}: {exc}") from None
        else:
            if before is not None and not force:
                raise DdtreeError(f"{rel} already exists in {snapshot.root}")
            after = series.new_content(rel)
        if before != after:
            changes.append(FileChange(rel, before, after))
    return result, changes


def _drift_summary(files: list[FileState]) -> str:
    drifted = [f"{f.path} ({f.detail})" for f in files if f.state is State.DRIFTED]
    if drifted:
        return ", ".join(drifted[:3]) + (
            f" and {len(drifted) - 3} more" if len(drifted) > 3 else ""
        )
    return "partly patched"


def _compile(rel: str, data: bytes) -> None:
    if not rel.endswith(".py"):
        return
    try:
        compile(data, rel, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise DdtreeError(
            f"patched {rel} does not compile: {exc.msg} (line {exc.lineno})"
        ) from None


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while files are renamed, so Ctrl-C cannot split the commit."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    blocked = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _stage(path: Path, data: bytes, mode_from: Path | None) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".ddtree-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        mode = mode_from.stat().st_mode & 0o7777 if mode_from and mode_from.exists() else 0o644
        os.chmod(tmp, mode)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


def commit_files(
    root: Path, writes: dict[str, bytes | None], originals: dict[str, bytes | None]
) -> None:
    """Write (bytes) or delete (None) every path under ``root``, all or nothing.

    ``originals`` holds each path's current content (None: absent) for the rollback.
    """
    staged: dict[str, Path] = {}
    done: list[str] = []
    try:
        for rel, data in writes.items():
            if data is not None:
                target = root / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                staged[rel] = _stage(target, data, target)
        with _sigint_deferred():
            try:
                for rel, data in writes.items():
                    target = root / rel
                    if data is None:
                        if target.exists():
                            target.unlink()
                    else:
                        os.replace(staged[rel], target)
                        del staged[rel]
                    done.append(rel)
            except BaseException:
                _rollback(root, done, originals)
                raise
    finally:
        for tmp in staged.values():
            with contextlib.suppress(OSError):
                tmp.unlink()


def _rollback(root: Path, done: list[str], originals: dict[str, bytes | None]) -> None:
    for rel in reversed(done):
        target = root / rel
        original = originals[rel]
        with contextlib.suppress(OSError):
            if original is None:
                target.unlink(missing_ok=True)
            else:
                os.replace(_stage(target, original, target), target)


def _write_state(
    snapshot: Snapshot, series: Series, changes: list[FileChange], forced: bool
) -> Path:
    """Write the state folder under a temporary name; the caller renames it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=".ddtree-state-", dir=snapshot.root))
    originals = tmp / "originals"
    manifest = {
        "sglang_version": snapshot.version,
        "series": series.version,
        "forced": forced,
        "files": {},
    }
    for change in changes:
        if change.before is not None:
            dest = originals / change.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(change.before)
        manifest["files"][change.path] = {
            "before": None if change.before is None else sha256(change.before),
            "after": sha256(change.after),
        }
    (tmp / STATE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return tmp


def apply(snapshot: Snapshot, *, force: bool = False) -> ApplyResult:
    checked, changes = _plan(snapshot, force=force)
    match = checked.match
    series, forced = match.series, match.forced
    result = ApplyResult(snapshot, series.version, match, forced=forced)
    if not changes:
        result.already_applied = True
        return result
    for change in changes:
        if change.after is not None:
            _compile(change.path, change.after)
    if checked.state is State.OUTDATED:
        # Bring a snapshot patched by another version of the series to this one's: the new
        # record is what a fresh patch of the release writes (every file whose target
        # differs from the release's, in the series' order, the release's originals kept
        # from the old record), so that ``--revert`` still restores the release.
        targets = {u.path: u for u in checked.update}
        recorded = [FileChange(rel, targets[rel].original, targets[rel].target)
                    for rel in series.touched
                    if rel in targets and targets[rel].original != targets[rel].target]  # fmt: skip
        result.updated = True
    elif snapshot.state_dir.exists():
        raise DdtreeError(
            f"{snapshot.state_dir} exists but the snapshot is not fully patched",
            hint="run `ddtree patch --revert --force` to restore the originals first",
        )
    else:
        recorded = changes
    _commit(snapshot, changes, _write_state(snapshot, series, recorded, forced))
    result.changed = [c.path for c in changes]
    result.compiled = [c.path for c in changes if c.after is not None and c.path.endswith(".py")]
    return result


def _commit(snapshot: Snapshot, changes: list[FileChange], state_tmp: Path) -> None:
    """Write ``changes`` and put ``state_tmp`` in place of the state folder (replacing an
    older one), all or nothing; then compile what is now on disk, so that a write that went
    wrong is caught, not shipped."""
    writes: dict[str, bytes | None] = {c.path: c.after for c in changes}
    before = {c.path: c.before for c in changes}
    state_dir = snapshot.state_dir
    old_state = state_dir.with_name(state_dir.name + ".old")
    replacing = state_dir.exists()
    shutil.rmtree(old_state, ignore_errors=True)
    try:
        commit_files(snapshot.root, writes, before)
        try:
            with _sigint_deferred():
                if replacing:
                    os.replace(state_dir, old_state)
                try:
                    os.replace(state_tmp, state_dir)
                except BaseException:
                    if replacing:
                        os.replace(old_state, state_dir)
                    raise
        except BaseException:
            _rollback(snapshot.root, list(writes), before)
            raise
    finally:
        if state_tmp.exists():
            shutil.rmtree(state_tmp, ignore_errors=True)
    shutil.rmtree(old_state, ignore_errors=True)
    for change in changes:
        if change.after is not None:
            _compile(change.path, (snapshot.root / change.path).read_bytes())


@dataclass
class RevertResult:
    snapshot: Snapshot
    restored: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    nothing_to_do: bool = False


def revert(snapshot: Snapshot, *, force: bool = False) -> RevertResult:
    manifest = _manifest(snapshot)
    result = RevertResult(snapshot)
    if manifest is None:
        return _revert_without_state(snapshot, result)
    originals_dir = snapshot.state_dir / "originals"
    writes: dict[str, bytes | None] = {}
    current: dict[str, bytes | None] = {}
    changed_since: list[str] = []
    for rel, entry in manifest["files"].items():
        now = _read(snapshot, rel)
        current[rel] = now
        if now is None or sha256(now) != entry["after"]:
            changed_since.append(rel)
        if entry["before"] is None:
            writes[rel] = None
            result.removed.append(rel)
        else:
            original = (originals_dir / rel).read_bytes()
            if sha256(original) != entry["before"]:
                raise DdtreeError(f"saved original of {rel} is damaged; cannot revert")
            writes[rel] = original
            result.restored.append(rel)
    if changed_since and not force:
        raise DdtreeError(
            f"files changed after patching: {', '.join(changed_since[:3])}",
            hint="--revert --force restores the originals anyway (those edits are lost)",
        )
    commit_files(snapshot.root, writes, current)
    shutil.rmtree(snapshot.state_dir)
    return result


def _revert_without_state(snapshot: Snapshot, result: RevertResult) -> RevertResult:
    """Undo a patch applied by other means (`git apply` of an export): reverse the diffs.

    Only when every touched file is recognised as applied; the reversed files must hash
    to the release's pristine SHA-256.
    """
    try:
        match = identify(snapshot)
    except DdtreeError:  # unknown content: nothing ddtree recognises as its patch
        result.nothing_to_do = True
        return result
    if match.how != "applied":
        result.nothing_to_do = True
        return result
    series = match.series
    writes: dict[str, bytes | None] = {}
    current: dict[str, bytes | None] = {}
    for rel in series.touched:
        now = _read(snapshot, rel)
        current[rel] = now
        if rel in series.pristine:
            assert now is not None
            original = unpatched(series, rel, now)
            if original is None:
                raise DdtreeError(f"cannot reconstruct the released {rel}; nothing changed")
            writes[rel] = original
            result.restored.append(rel)
        else:
            writes[rel] = None
            result.removed.append(rel)
    commit_files(snapshot.root, writes, current)
    return result


def export_patch(snapshot: Snapshot | None, version: str | None, *, force: bool = False) -> str:
    """One ``git apply``-able patch: the series' diff plus the vendored algorithm module.

    With a snapshot, paths carry its prefix (``python/`` in a git checkout) so the patch
    applies from the checkout root.
    """
    if snapshot is not None:
        series = identify(snapshot, force=force).series
        prefix = snapshot.export_prefix
    else:
        series = load(version or "")
        prefix = ""
    text = series.full_diff()
    if prefix:
        text = _prefix_paths(text, prefix)
    return text


def _prefix_paths(text: str, prefix: str) -> str:
    out = []
    for line in text.splitlines(keepends=True):
        if line.startswith("diff --git a/"):
            a, b = line[len("diff --git ") :].rstrip("\n").split(" ", 1)
            line = f"diff --git a/{prefix}{a[2:]} b/{prefix}{b[2:]}\n"
        elif line.startswith("--- a/"):
            line = f"--- a/{prefix}{line[6:]}"
        elif line.startswith("+++ b/"):
            line = f"+++ b/{prefix}{line[6:]}"
        out.append(line)
    return "".join(out)


CHECK_EXIT = {
    State.APPLIED: ExitCode.OK,
    State.PRISTINE: ExitCode.CHECK_FAILED,
    State.DRIFTED: ExitCode.CHECK_FAILED,
    State.OUTDATED: ExitCode.CHECK_FAILED,
}
