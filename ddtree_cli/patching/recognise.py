"""Which patch series fits a snapshot, decided by its content, not its version string.

In order: the series recorded in the snapshot's state folder when ddtree patched it; a
series whose pristine hashes every touched file matches (0.5.13.post1 ships 0.5.13's files,
so it is 0.5.13's series); a series the snapshot already carries (patched by ``git apply``
of an export); the series named like the snapshot's version (its files then differ from
the release, and ``check`` says where). Anything else is unknown content: refused, naming
the nearest series and the hunks of it that would not apply; ``--force`` takes the nearest
series only when every one of its hunks finds a unique anchor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ddtree_cli.errors import DdtreeError
from ddtree_cli.patching import series as series_mod
from ddtree_cli.patching import unidiff
from ddtree_cli.patching.series import Series, sha256
from ddtree_cli.patching.snapshot import Snapshot

STATE_MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Match:
    series: Series
    how: str  # recorded | content | applied | version | forced
    why: str  # one sentence for people
    forced: bool = False

    def to_json(self) -> dict:
        return {"series": self.series.version, "how": self.how, "why": self.why}


def manifest(snapshot: Snapshot) -> dict | None:
    path = snapshot.state_dir / STATE_MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _read(root: Path, rel: str) -> bytes | None:
    path = root / rel
    return path.read_bytes() if path.is_file() else None


def is_pristine(series: Series, root: Path) -> bool:
    """Every SGLang file the series touches is byte-identical to its release."""
    for rel, digest in series.pristine.items():
        data = _read(root, rel)
        if data is None or sha256(data) != digest:
            return False
    return all(_read(root, rel) is None for rel in series.new_files)


def unpatched(series: Series, rel: str, data: bytes) -> bytes | None:
    """The release's file, if ``data`` is that file with the series applied."""
    try:
        undone = unidiff.apply(data.decode("utf-8"), unidiff.reverse(series.diffs[rel]))
    except (unidiff.DiffError, UnicodeDecodeError):
        return None
    original = undone.encode("utf-8")
    return original if sha256(original) == series.pristine[rel] else None


def carries(series: Series, root: Path) -> bool:
    """The snapshot is exactly the release with this series applied."""
    for rel in series.pristine:
        data = _read(root, rel)
        if data is None or unpatched(series, rel, data) is None:
            return False
    return all(_read(root, rel) == series.new_content(rel) for rel in series.touched
               if rel not in series.pristine)  # fmt: skip


def unmatched(series: Series, root: Path) -> list[str]:
    """The hunks of ``series`` that would not find a unique anchor in the snapshot."""
    problems: list[str] = []
    for rel, diff in sorted(series.diffs.items()):
        data = _read(root, rel)
        if data is None:
            problems.append(f"{rel} (missing)")
            continue
        problems.extend(unidiff.unmatched_hunks(data.decode("utf-8", "replace"), diff))
    return problems


def nearest(snapshot: Snapshot, *, exclude: str | None = None) -> tuple[Series, list[str]]:
    """The series of the snapshot's layout with the fewest hunks that would not apply
    (ties: the closest release at or below the snapshot's version, then above it)."""
    candidates = [s for s in series_mod.of_layout(snapshot.layout.value) if s.version != exclude]
    if not candidates:
        raise DdtreeError(f"no patch series for the {snapshot.layout.value} layout")
    key = series_mod.version_key(snapshot.version)
    below = [s for s in candidates if series_mod.version_key(s.version) <= key]
    above = [s for s in candidates if series_mod.version_key(s.version) > key]
    preference = [*reversed(below), *above]
    scored = [(len(p), rank, s, p) for rank, s in enumerate(preference)
              for p in [unmatched(s, snapshot.root)]]  # fmt: skip
    _, _, best, problems = min(scored, key=lambda item: (item[0], item[1]))
    return best, problems


def identify(snapshot: Snapshot, *, force: bool = False) -> Match:
    state = manifest(snapshot)
    if state is not None:
        series = series_mod.load(state["series"])
        forced = bool(state.get("forced"))
        why = f"recorded in {snapshot.state_dir.name}/ when ddtree patched it" + (
            " with --force" if forced else ""
        )
        return Match(series, "recorded", why, forced)
    layout = series_mod.of_layout(snapshot.layout.value)
    # The series named like the version first, so a release that shares files with
    # another is reported under its own name when both fit.
    layout.sort(key=lambda s: s.version != snapshot.version)
    for s in layout:
        if is_pristine(s, snapshot.root):
            return Match(s, "content", _content_why(s, snapshot, "as released"))
    for s in layout:
        if carries(s, snapshot.root):
            return Match(s, "applied", _content_why(s, snapshot, "with this series applied"))
    if snapshot.version in series_mod.supported_versions():
        s = series_mod.load(snapshot.version)
        return Match(s, "version", f"version {snapshot.version}; its files differ from the release")
    best, problems = nearest(snapshot)
    if force and not problems:
        why = (
            f"forced: no release matches by content; every hunk of the nearest series, "
            f"{best.version}, found a unique anchor"
        )
        return Match(best, "forced", why, forced=True)
    total = best.hunk_count()
    if problems:
        listed = "; ".join(problems[:6]) + (
            f"; and {len(problems) - 6} more" if len(problems) > 6 else ""
        )
        detail = f"{len(problems)} of its {total} hunks would not apply: {listed}"
        hint = "no --force: it applies only when every hunk finds a unique anchor"
    else:
        detail = f"all {total} of its hunks find a unique anchor"
        hint = "--force applies that series by anchor matching"
    raise DdtreeError(
        f"SGLang {snapshot.version} at {snapshot.root} matches no supported release by "
        f"content; nearest series {best.version}: {detail}",
        hint=f"{hint}; supported: {', '.join(series_mod.supported_versions())}",
    )


def _content_why(s: Series, snapshot: Snapshot, state: str) -> str:
    files = len(s.pristine)
    if s.version == snapshot.version:
        return f"its {files} touched SGLang files are {s.version}'s {state}"
    return (
        f"version {snapshot.version}, but its {files} touched SGLang files are "
        f"byte-identical to {s.version}'s {state}"
    )
