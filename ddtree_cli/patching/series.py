"""Patch series: what DDTREE adds to one SGLang release, written once where it is the same.

On disk, under ``series/``:

``families/common/`` and ``families/<layout>/``
    the files DDTREE adds to SGLang, whole (paths relative to the folder that holds
    ``sglang/``): the worker, the verify input and the draft head. ``common`` is shared by
    every layout; ``v1`` / ``v2`` hold what depends on the worker layout. They are the same
    for every release of a layout.
``<version>/release.patch``
    a reviewable unified diff of what that release needs in SGLang's own files (enum,
    flags, ``_handle_ddtree``, the worker seams). A release that needs a change in one of
    the family files carries it here too, as a hunk against the family file.
``<version>/series.json``
    the layout and the SHA-256 of every SGLang file the diff touches as released (the
    *pristine* hashes; they are how a snapshot is recognised by content).

The project's own modules are in neither: ``ddtree_cli/draft_tree.py`` (the algorithm) is
copied verbatim to ``sglang/srt/speculative/ddtree_tree.py`` and ``ddtree_cli/budget_policy.py``
(``--speculative-ddtree-budget auto``'s policy, standard library only) to
``sglang/srt/speculative/ddtree_budget_policy.py`` when a series is applied, in every
series alike (only the 0.5.13 series' worker runs the policy; the v2 worker uses its
``batch_bucket`` for the round timing).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path

from ddtree_cli.errors import DdtreeError
from ddtree_cli.patching import unidiff

VENDORED_TREE_PATH = "sglang/srt/speculative/ddtree_tree.py"
VENDORED_POLICY_PATH = "sglang/srt/speculative/ddtree_budget_policy.py"
# Snapshot path -> the ddtree_cli module copied there byte for byte.
VENDORED = {VENDORED_TREE_PATH: "draft_tree.py", VENDORED_POLICY_PATH: "budget_policy.py"}
RELEASE_PATCH = "release.patch"
SERIES_JSON = "series.json"
COMMON_FAMILY = "common"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Series:
    version: str
    layout: str
    pristine: dict[str, str]  # SGLang file -> sha256 as released
    added: dict[str, str] = field(compare=False)  # file DDTREE adds -> its text
    diffs: dict[str, unidiff.FileDiff] = field(compare=False)  # SGLang file -> its hunks
    release_patch: str = field(compare=False, default="")

    @property
    def new_files(self) -> tuple[str, ...]:
        return tuple(sorted(self.added))

    @property
    def touched(self) -> list[str]:
        return sorted([*self.pristine, *self.added, *VENDORED])

    def new_content(self, rel: str) -> bytes:
        if rel in VENDORED:
            return vendored_source(rel)
        return self.added[rel].encode("utf-8")

    def patched(self, rel: str, text: bytes, *, fuzzy: bool = False) -> bytes:
        return unidiff.apply(text.decode("utf-8"), self.diffs[rel], fuzzy=fuzzy).encode("utf-8")

    def hunk_count(self) -> int:
        return sum(len(d.hunks) for d in self.diffs.values())

    def full_diff(self) -> str:
        """Every change as one ``git apply``-able diff: the release's hunks on SGLang's
        files, then each added file whole (the algorithm module included)."""
        text = self.release_patch_for_sglang()
        for rel in [*self.new_files, *VENDORED]:
            text += unidiff.make(rel, None, self.new_content(rel).decode("utf-8"))
        return text

    def release_patch_for_sglang(self) -> str:
        """The release's hunks on SGLang's own files (not those on family files)."""
        chunks = _split_files(self.release_patch)
        text = "".join(c for path, c in chunks if path in self.pristine)
        return text if not text or text.endswith("\n") else text + "\n"


def _split_files(text: str) -> list[tuple[str, str]]:
    """(path, text) for every file section of a unified diff."""
    sections: list[list[str]] = []
    for line in text.splitlines(keepends=True):
        if line.startswith("diff --git ") or not sections:
            sections.append([])
        sections[-1].append(line)
    out = []
    for lines in sections:
        chunk = "".join(lines)
        parsed = unidiff.parse(chunk)
        if parsed:
            out.append((parsed[0].path, chunk))
    return out


def _series_root():
    return resources.files("ddtree_cli.patching") / "series"


def supported_versions() -> list[str]:
    versions = [
        p.name
        for p in _series_root().iterdir()
        if p.name != "families" and (p / SERIES_JSON).is_file()
    ]
    return sorted(versions, key=version_key)


def version_key(version: str) -> tuple:
    parts: list[tuple[int, object]] = []
    for piece in version.replace("-", ".").split("."):
        parts.append((0, int(piece)) if piece.isdigit() else (1, piece))
    return tuple(parts)


def family_files(layout: str) -> dict[str, str]:
    """Path -> text of every file the family of ``layout`` adds (common ones first)."""
    out: dict[str, str] = {}
    for family in (COMMON_FAMILY, layout):
        base = _series_root() / "families" / family
        for path in _walk(base):
            rel = "/".join(path)
            out[rel] = _join(base, path).read_text(encoding="utf-8")
    return out


def _walk(base, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if not base.is_dir():
        return []
    found: list[tuple[str, ...]] = []
    for child in sorted(base.iterdir(), key=lambda p: p.name):
        if child.name == "__pycache__":
            continue
        if child.is_dir():
            found.extend(_walk(child, (*prefix, child.name)))
        elif child.name.endswith(".py"):
            found.append((*prefix, child.name))
    return found


def _join(base, parts: tuple[str, ...]):
    for part in parts:
        base = base / part
    return base


@cache
def load(version: str) -> Series:
    folder = _series_root() / version
    if version == "families" or not (folder / SERIES_JSON).is_file():
        raise DdtreeError(
            f"SGLang {version} is not supported",
            hint=f"supported versions: {', '.join(supported_versions())}",
        )
    meta = json.loads((folder / SERIES_JSON).read_text(encoding="utf-8"))
    release_patch = (folder / RELEASE_PATCH).read_text(encoding="utf-8")
    layout = meta["layout"]
    added = family_files(layout)
    diffs: dict[str, unidiff.FileDiff] = {}
    for diff in unidiff.parse(release_patch):
        if diff.path in added:  # this release's change to a family file
            try:
                added[diff.path] = unidiff.apply(added[diff.path], diff)
            except unidiff.DiffError as exc:
                raise DdtreeError(f"patch series {version} is inconsistent: {exc}") from None
        else:
            diffs[diff.path] = diff
    if set(diffs) != set(meta["pristine"]):
        missing = sorted(set(diffs) ^ set(meta["pristine"]))
        raise DdtreeError(f"patch series {version} is inconsistent: {missing}")
    return Series(
        version=meta["version"],
        layout=layout,
        pristine=dict(meta["pristine"]),
        added=added,
        diffs=diffs,
        release_patch=release_patch,
    )


def of_layout(layout: str) -> list[Series]:
    return [load(v) for v in supported_versions() if load(v).layout == layout]


def vendored_source(rel: str) -> bytes:
    """The ddtree_cli module vendored at snapshot path ``rel``, byte for byte."""
    return (resources.files("ddtree_cli") / VENDORED[rel]).read_bytes()


def vendored_tree_source() -> bytes:
    """The algorithm module, byte for byte."""
    return vendored_source(VENDORED_TREE_PATH)


def series_dir_on_disk(version: str) -> Path:
    """Where a series lives in a source checkout (for maintainers adding one)."""
    return Path(__file__).parent / "series" / version
