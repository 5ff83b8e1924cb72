"""Patch series: per SGLang version, one reviewable unified diff plus a manifest.

``series/<version>/series.json`` names the layout, the SHA-256 of every file the diff
touches as shipped in that release (the *pristine* hashes), and the files the diff creates.
``series/<version>/ddtree.patch`` is the diff itself (paths relative to the folder that
holds ``sglang/``). The algorithm module is not in the diff: ``ddtree_cli/draft_tree.py``
is copied verbatim to ``sglang/srt/speculative/ddtree_tree.py`` when the series is applied.
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


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Series:
    version: str
    layout: str
    pristine: dict[str, str]  # path -> sha256 of the release's file
    new_files: tuple[str, ...]
    diff_text: str
    diffs: dict[str, unidiff.FileDiff] = field(compare=False)

    @property
    def touched(self) -> list[str]:
        return sorted([*self.pristine, *self.new_files, VENDORED_TREE_PATH])


def _series_root():
    return resources.files("ddtree_cli.patching") / "series"


def supported_versions() -> list[str]:
    versions = [p.name for p in _series_root().iterdir() if (p / "series.json").is_file()]
    return sorted(versions, key=_version_key)


def _version_key(version: str) -> tuple:
    parts: list[tuple[int, object]] = []
    for piece in version.replace("-", ".").split("."):
        parts.append((0, int(piece)) if piece.isdigit() else (1, piece))
    return tuple(parts)


@cache
def load(version: str) -> Series:
    folder = _series_root() / version
    if not (folder / "series.json").is_file():
        raise DdtreeError(
            f"SGLang {version} is not supported",
            hint=f"supported versions: {', '.join(supported_versions())}; "
            "--force tries the nearest series by anchor matching",
        )
    meta = json.loads((folder / "series.json").read_text(encoding="utf-8"))
    diff_text = (folder / "ddtree.patch").read_text(encoding="utf-8")
    diffs = {d.path: d for d in unidiff.parse(diff_text)}
    new_files = tuple(meta["new_files"])
    missing = (set(meta["pristine"]) | set(new_files)) ^ set(diffs)
    if missing:
        raise DdtreeError(f"patch series {version} is inconsistent: {sorted(missing)}")
    return Series(
        version=meta["version"],
        layout=meta["layout"],
        pristine=dict(meta["pristine"]),
        new_files=new_files,
        diff_text=diff_text,
        diffs=diffs,
    )


def nearest(version: str, layout: str) -> Series:
    """The supported series of the same layout closest to ``version`` (for ``--force``)."""
    same_layout = [v for v in supported_versions() if load(v).layout == layout]
    if not same_layout:
        raise DdtreeError(f"no patch series for the {layout} layout")
    key = _version_key(version)
    below = [v for v in same_layout if _version_key(v) <= key]
    return load(below[-1] if below else same_layout[0])


def vendored_tree_source() -> bytes:
    """The algorithm module, byte for byte."""
    return (resources.files("ddtree_cli") / "draft_tree.py").read_bytes()


def series_dir_on_disk(version: str) -> Path:
    """Where a series lives in a source checkout (for maintainers regenerating it)."""
    return Path(__file__).parent / "series" / version
