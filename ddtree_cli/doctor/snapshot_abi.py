"""What an SGLang snapshot needs from the interpreter that will serve it.

One reader, :func:`read_snapshot_abi`, turns a snapshot's files (version, Requires-Python,
compiled extension modules and wheel tags) into a :class:`SnapshotABI` for the rules in
:mod:`ddtree_cli.doctor.snapshot_rules`. ``doctor --snapshot`` gives it a folder;
``deploy``'s preflight gives it the folder and the sync manifest of what will be shipped.
Real sglang wheels ship compiled modules (0.5.13: ``srt/grpc/_core.cpython-311-…so``;
0.5.23: five Rust extensions), so a snapshot taken from a cp311 wheel cannot be served
by Python 3.12.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

from ddtree_cli.errors import ConfigError


@dataclass(frozen=True)
class SnapshotABI:
    """What the snapshot to be served needs from the interpreter."""

    version: str | None = None
    requires_python: str | None = None  # e.g. ">=3.11", from the snapshot's dist-info
    # (path relative to the snapshot, tag): tag is "cp311", "cp313t" or "abi3".
    compiled: list[tuple[str, str]] = field(default_factory=list)
    wheel_tags: list[str] = field(default_factory=list)  # "cp311-cp311-manylinux_2_34_x86_64"


_EXTENSION = re.compile(r"\.(?:cpython-(\d)(\d+)(t?)-[^.]+|(abi3))\.so$")
_VERSION = re.compile(r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""", re.M)
_DIST_INFO = re.compile(r"sglang-[^/]+\.dist-info/(METADATA|WHEEL)")
_VERSION_FILE = re.compile(r"(?:.*/)?sglang/_version\.py")


def extension_tag(filename: str) -> str | None:
    """ "x.cpython-311-x86_64-linux-gnu.so" -> "cp311"; "x.abi3.so" -> "abi3"; else None."""
    match = _EXTENSION.search(filename)
    if not match:
        return None
    if match.group(4):
        return "abi3"
    return f"cp{match.group(1)}{match.group(2)}{match.group(3)}"


def read_snapshot_abi(root: str | Path, files: Iterable[str] | None = None) -> SnapshotABI:
    """The ABI of the snapshot under ``root``.

    ``files`` are the snapshot's files relative to ``root`` (deploy passes its sync manifest,
    so the verdict is about exactly what will be shipped). Without them, ``root`` is a git
    checkout of sglang, its ``python/sglang`` folder, an installed ``sglang`` package folder
    or an extracted wheel, and the files are the sglang package's and its dist-info's.
    """
    root = Path(root).expanduser()
    if files is None:
        if not root.is_dir():
            raise ConfigError(f"snapshot folder {root} does not exist")
        root, files = _package_files(root)
    files = sorted(files)
    compiled = [(path, tag) for path in files if (tag := extension_tag(path.rsplit("/", 1)[-1]))]
    version = requires_python = None
    wheel_tags: list[str] = []
    dist_info = [path for path in files if _DIST_INFO.fullmatch(path)]
    for path in dist_info:  # sorted: the last sglang-*.dist-info wins
        text = (root / path).read_text(errors="replace")
        if path.endswith("/METADATA"):
            metadata = Parser().parsestr(text, headersonly=True)
            version = metadata.get("Version")
            requires_python = metadata.get("Requires-Python")
        else:
            wheel_tags = Parser().parsestr(text, headersonly=True).get_all("Tag") or []
    version_files = sorted((p for p in files if _VERSION_FILE.fullmatch(p)), key=len)
    if version is None and version_files:
        match = _VERSION.search((root / version_files[0]).read_text(errors="replace"))
        version = match.group(1) if match else None
    return SnapshotABI(
        version=version,
        requires_python=requires_python,
        compiled=compiled,
        wheel_tags=list(wheel_tags),
    )


def _package_files(path: Path) -> tuple[Path, list[str]]:
    """(the folder holding the sglang package, the files the reader needs relative to it)."""
    package_dir = _package_dir(path)
    base = package_dir.parent
    files = [so.relative_to(base).as_posix() for so in package_dir.rglob("*.so")]
    if (package_dir / "_version.py").is_file():
        files.append(f"{package_dir.name}/_version.py")
    dist_infos = sorted(base.glob("sglang-*.dist-info"))
    if dist_infos:  # an installed package's site-packages holds one; an old one may linger
        for name in ("METADATA", "WHEEL"):
            if (dist_infos[-1] / name).is_file():
                files.append(f"{dist_infos[-1].name}/{name}")
    return base, files


def _package_dir(path: Path) -> Path:
    for candidate in (path / "python" / "sglang", path / "sglang", path):
        if (candidate / "__init__.py").is_file() and (candidate / "srt").is_dir():
            return candidate
    raise ConfigError(
        f"no sglang package found in {path}",
        hint="point --snapshot at a git checkout of sglang, its python/sglang folder, "
        "an installed sglang package folder or an extracted wheel",
    )
