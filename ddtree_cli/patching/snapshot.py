"""Find the ``sglang`` package inside what the user points at, and say which SGLang it is.

Accepted: a git checkout of sglang (``python/sglang`` inside), that ``python/sglang``
folder, an installed ``sglang`` package folder (site-packages), or an extracted wheel.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ddtree_cli.errors import ConfigError


class SnapshotKind(str, Enum):
    GIT = "git-checkout"
    PACKAGE = "package"  # an installed or extracted package folder (wheel, site-packages)


class Layout(str, Enum):
    V1 = "v1"  # speculative/dflash_worker.py (0.5.11 - 0.5.13)
    V2 = "v2"  # speculative/dflash_worker_v2.py (0.5.14 and later)


@dataclass(frozen=True)
class Snapshot:
    root: Path  # the folder that holds sglang/; diff paths are relative to it
    package_dir: Path  # root / "sglang"
    kind: SnapshotKind
    version: str
    layout: Layout
    git_root: Path | None = None  # the checkout, for a git snapshot

    @property
    def state_dir(self) -> Path:
        return self.root / ".ddtree"

    @property
    def export_prefix(self) -> str:
        """Path prefix that makes exported diffs apply from the checkout root with git."""
        if self.git_root is None:
            return ""
        return self.root.relative_to(self.git_root).as_posix() + "/"


# `__version__ = version = '0.5.23'` as setuptools-scm / vcs-versioning write it.
_VERSION_RE = re.compile(
    r"""^(?:__version__|version)\s*=\s*(?:(?:__version__|version)\s*=\s*)?['"]([^'"]+)['"]""",
    re.M,
)


def _is_package(path: Path) -> bool:
    return (path / "__init__.py").is_file() and (path / "srt").is_dir()


def _locate(path: Path) -> tuple[Path, Path | None]:
    """Return (package_dir, git_root) for the folder the user named."""
    candidates = [
        (path / "python" / "sglang", path),
        (path / "sglang", None),
        (path, None),
    ]
    for package_dir, git_root in candidates:
        if _is_package(package_dir):
            if git_root is None and (package_dir.parent.name == "python"):
                checkout = package_dir.parent.parent
                if (checkout / ".git").exists():
                    git_root = checkout
            return package_dir, git_root
    raise ConfigError(
        f"no sglang package found in {path}",
        hint="point at a git checkout of sglang, its python/sglang folder, "
        "an installed sglang package folder or an extracted wheel",
    )


def _version_from_files(package_dir: Path, git_root: Path | None) -> str | None:
    generated = package_dir / "_version.py"
    if generated.is_file():
        match = _VERSION_RE.search(generated.read_text(encoding="utf-8"))
        if match:
            return match.group(1)
    for dist_info in sorted(package_dir.parent.glob("sglang-*.dist-info")):
        metadata = dist_info / "METADATA"
        if metadata.is_file():
            for line in metadata.read_text(encoding="utf-8", errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
                if not line.strip():
                    break
    if git_root is not None:
        return _version_from_git(git_root)
    return None


def _git_refs(git_dir: Path) -> dict[str, str]:
    """Every ref -> sha, from packed-refs and loose refs (loose ones win)."""
    refs: dict[str, str] = {}
    packed = git_dir / "packed-refs"
    last = None
    if packed.is_file():
        for line in packed.read_text(encoding="utf-8").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].startswith("refs/"):
                last = parts[1]
                refs[last] = parts[0]
            elif line.startswith("^") and last is not None:
                refs[last] = line[1:].strip()  # an annotated tag, peeled to its commit
    ref_dir = git_dir / "refs"
    if ref_dir.is_dir():
        for ref in ref_dir.rglob("*"):
            if ref.is_file():
                name = "refs/" + ref.relative_to(ref_dir).as_posix()
                refs[name] = _peel(git_dir, ref.read_text().strip())
    return refs


def _peel(git_dir: Path, sha: str) -> str:
    """The commit a loose annotated tag object points at (the sha itself otherwise)."""
    obj = git_dir / "objects" / sha[:2] / sha[2:]
    if not obj.is_file():
        return sha
    try:
        data = zlib.decompress(obj.read_bytes())
    except zlib.error:
        return sha
    if data.startswith(b"tag "):
        body = data.split(b"\0", 1)[1]
        if body.startswith(b"object "):
            return body[7:47].decode("ascii")
    return sha


def _version_from_git(git_root: Path) -> str | None:
    # The release tag HEAD sits on, read without running git (git is optional).
    git_dir = git_root / ".git"
    if not git_dir.is_dir():
        return None
    refs = _git_refs(git_dir)
    head = (git_dir / "HEAD").read_text(encoding="utf-8").strip()
    if head.startswith("ref: "):
        head = refs.get(head[5:], "")
    for name, sha in sorted(refs.items()):
        if name.startswith("refs/tags/") and sha == head:
            return name[len("refs/tags/") :].lstrip("v")
    return None


def detect(path: Path) -> Snapshot:
    path = path.expanduser().resolve()
    if not path.is_dir():
        raise ConfigError(f"snapshot folder does not exist: {path}")
    package_dir, git_root = _locate(path)
    version = _version_from_files(package_dir, git_root)
    if version is None:
        raise ConfigError(
            f"cannot tell which SGLang version {package_dir} is",
            hint="expected sglang/_version.py, a sglang-*.dist-info next to the package, "
            "or a git checkout whose HEAD is a release tag",
        )
    speculative = package_dir / "srt" / "speculative"
    if (speculative / "dflash_worker_v2.py").is_file():
        layout = Layout.V2
    elif (speculative / "dflash_worker.py").is_file():
        layout = Layout.V1
    else:
        raise ConfigError(
            f"SGLang {version} at {package_dir} has no DFlash worker",
            hint="DDTREE builds on DFLASH, which first shipped in sglang 0.5.11",
        )
    return Snapshot(
        root=package_dir.parent,
        package_dir=package_dir,
        kind=SnapshotKind.GIT if git_root is not None else SnapshotKind.PACKAGE,
        version=version,
        layout=layout,
        git_root=git_root,
    )
