"""What an SGLang snapshot needs from the interpreter that will serve it.

Reads the snapshot on disk (version, Requires-Python, compiled extension modules and wheel
tags) into an :class:`~ddtree_cli.abi.SnapshotABI` for the rules in :mod:`ddtree_cli.abi`.
Real sglang wheels ship compiled modules (0.5.13: ``srt/grpc/_core.cpython-311-…so``;
0.5.23: five Rust extensions), so a snapshot taken from a cp311 wheel cannot be served
by Python 3.12.
"""

from __future__ import annotations

import re
from email.parser import Parser
from pathlib import Path

from ddtree_cli.abi import SnapshotABI
from ddtree_cli.errors import ConfigError

_EXTENSION = re.compile(r"\.(?:cpython-(\d)(\d+)(t?)-[^.]+|(abi3))\.so$")
_VERSION = re.compile(r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""", re.M)


def extension_tag(filename: str) -> str | None:
    """ "x.cpython-311-x86_64-linux-gnu.so" -> "cp311"; "x.abi3.so" -> "abi3"; else None."""
    match = _EXTENSION.search(filename)
    if not match:
        return None
    if match.group(4):
        return "abi3"
    return f"cp{match.group(1)}{match.group(2)}{match.group(3)}"


def _package_dir(path: Path) -> Path:
    for candidate in (path / "python" / "sglang", path / "sglang", path):
        if (candidate / "__init__.py").is_file() and (candidate / "srt").is_dir():
            return candidate
    raise ConfigError(
        f"no sglang package found in {path}",
        hint="point --snapshot at a git checkout of sglang, its python/sglang folder, "
        "an installed sglang package folder or an extracted wheel",
    )


def _dist_info(package_dir: Path) -> Path | None:
    found = sorted(package_dir.parent.glob("sglang-*.dist-info"))
    return found[-1] if found else None


def inspect_snapshot(path: str | Path) -> SnapshotABI:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(f"snapshot folder {root} does not exist")
    package_dir = _package_dir(root)
    dist_info = _dist_info(package_dir)
    version = requires_python = None
    wheel_tags: list[str] = []
    if dist_info is not None:
        metadata = Parser().parsestr((dist_info / "METADATA").read_text(errors="replace"))
        version = metadata.get("Version")
        requires_python = metadata.get("Requires-Python")
        wheel = dist_info / "WHEEL"
        if wheel.is_file():
            wheel_tags = Parser().parsestr(wheel.read_text(errors="replace")).get_all("Tag") or []
    generated = package_dir / "_version.py"
    if version is None and generated.is_file():
        match = _VERSION.search(generated.read_text(errors="replace"))
        version = match.group(1) if match else None
    compiled = []
    for so in sorted(package_dir.rglob("*.so")):
        tag = extension_tag(so.name)
        if tag:
            compiled.append((so.relative_to(package_dir.parent).as_posix(), tag))
    return SnapshotABI(
        version=version,
        requires_python=requires_python,
        compiled=compiled,
        wheel_tags=list(wheel_tags),
    )
