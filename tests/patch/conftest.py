"""Fixtures for `ddtree patch`: real SGLang wheels from the package index, cached.

Wheels are fetched once with ``pip download --no-deps`` into the wheel cache
(``DDTREE_WHEEL_CACHE``, default ``~/.cache/ddtree/wheels``) and reused across runs; each
version is extracted once per session and copied into a fresh folder per test.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from ddtree_cli.errors import DdtreeError
from ddtree_cli.patching import fetch
from tests.conftest import require

# Every release the wheel tests patch, with the series it must be recognised as; written by
# `python -m ddtree_cli.patching.regenerate` (PyPI wheels; docs/patch.md, "Releases").
RELEASES: dict[str, dict[str, str]] = json.loads(
    (Path(__file__).with_name("releases.json")).read_text(encoding="utf-8")
)
VERSIONS = tuple(RELEASES)
# The import tier: the v1 layout and one v2 release per torch pin (2.11, 2.13, 2.14.1). Set
# DDTREE_IMPORT_RELEASES to a comma-separated list, or "all", to run it on other releases
# (each in the venv of the release with its torch pin, see sglang_venv.venv_release).
_IMPORT_DEFAULT = ("0.5.13", "0.5.17", "0.5.21", "0.5.23")
_IMPORT_ENV = os.environ.get("DDTREE_IMPORT_RELEASES", "").strip()
IMPORT_VERSIONS = (
    VERSIONS if _IMPORT_ENV == "all"
    else tuple(v.strip() for v in _IMPORT_ENV.split(",") if v.strip()) or _IMPORT_DEFAULT
)  # fmt: skip


@pytest.fixture(scope="session")
def pristine_root(tmp_path_factory):
    """version -> a read-only-by-convention extracted wheel (shared; never modify)."""
    roots: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in roots:
            try:
                wheel = fetch.download_wheel(version)
            except DdtreeError as exc:
                require(False, f"cannot download sglang {version}: {exc}")
            root = tmp_path_factory.mktemp(f"sglang-{version}-pristine")
            roots[version] = fetch.extract_wheel(wheel, root / "s")
        return roots[version]

    return get


@pytest.fixture
def snapshot_copy(pristine_root, tmp_path):
    """version -> a private copy of the extracted wheel for one test to change."""

    def get(version: str, name: str = "snap") -> Path:
        dest = tmp_path / name
        shutil.copytree(pristine_root(version), dest, symlinks=True)
        return dest

    return get


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file (and '<dir>' for every folder) under root."""
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_dir():
            out[rel] = "<dir>"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out
