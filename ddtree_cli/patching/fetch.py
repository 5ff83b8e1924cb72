"""Download an SGLang release wheel from the package index and extract it as a snapshot."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ddtree_cli.errors import DdtreeError

_VERSION_RE = re.compile(r"^\d+(\.\d+)*([a-z]+\d*)?(\.post\d+)?$")


def wheel_cache_dir() -> Path:
    """Where downloaded wheels are kept between runs (``DDTREE_WHEEL_CACHE`` overrides)."""
    env = os.environ.get("DDTREE_WHEEL_CACHE")
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ddtree" / "wheels"


def cached_wheel(version: str, cache: Path | None = None) -> Path | None:
    cache = cache or wheel_cache_dir()
    matches = sorted(cache.glob(f"sglang-{version}-*.whl"))
    return matches[-1] if matches else None


def download_wheel(version: str, cache: Path | None = None) -> Path:
    """``pip download --no-deps sglang==VERSION`` into the cache (reused when present)."""
    if not _VERSION_RE.match(version):
        raise DdtreeError(f"not a version: {version!r}", hint="e.g. --fetch 0.5.23")
    cache = cache or wheel_cache_dir()
    found = cached_wheel(version, cache)
    if found is not None:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "--dest", str(cache), f"sglang=={version}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise DdtreeError(f"cannot download sglang {version}: {last}")
    found = cached_wheel(version, cache)
    if found is None:
        raise DdtreeError(f"pip reported success but no sglang {version} wheel is in {cache}")
    return found


def extract_wheel(wheel: Path, into: Path) -> Path:
    """Extract into ``into`` (created; must be absent or empty), atomically."""
    into = into.expanduser().resolve()
    if into.exists() and any(into.iterdir()):
        raise DdtreeError(f"{into} exists and is not empty", hint="pass an empty or new --into")
    into.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{into.name}.", dir=into.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        if into.exists():
            into.rmdir()
        os.replace(tmp, into)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return into


def fetch(version: str, into: Path | None = None, cache: Path | None = None) -> Path:
    wheel = download_wheel(version, cache)
    return extract_wheel(wheel, into or Path.cwd() / f"sglang-{version}")
