"""Incremental, atomic sync of a source tree into ``releases/<id>/`` on a host.

1. :func:`scan` hashes the local tree into a manifest (path -> sha256, size, mode),
   skipping caches, VCS folders and anything that looks like a secret.
2. The release id is the hash of that manifest, so deploying the same content twice finds
   the release already on the host and sends nothing but a few hundred bytes.
3. Otherwise one helper call on the host hard-links every file an earlier release already
   has into a staging folder and answers what is missing; only those files travel: a few
   over SFTP, many as one tar stream into ``tar -x`` (one channel instead of a round trip per
   file, which is what keeps a first deploy near rsync).
4. The host checks sizes and the hashes of what was uploaded, then renames staging to
   ``releases/<id>``; ``current`` switches with a symlink rename. A dropped connection
   leaves only a staging folder, which the next run removes: the running release is never
   touched, and a re-run converges.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree_cli.deploy import release_helper
from ddtree_cli.errors import ConfigError, RemoteError
from ddtree_cli.remote.ssh import Connection

DEFAULT_EXCLUDES = (
    "__pycache__",
    "*.pyc",
    ".ddtree",
    ".git",
    ".hg",
    ".svn",
    ".venv",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".DS_Store",
    # secrets: never shipped, whatever the include list says
    ".env",
    ".env.*",
    "*.pem",
    "*.key",
    "id_rsa*",
    "id_ed25519*",
    "id_ecdsa*",
    ".netrc",
    ".pypirc",
    "*.token",
    "credentials*",
    ".git-credentials",
    ".hf_token",
)
SFTP_MAX_FILES = 32  # above this, one tar stream beats a round trip per file

Manifest = dict[str, list]  # path -> [sha256 hex, size, mode]


def exclusion_matcher(patterns: tuple[str, ...] | list[str]) -> Callable[[str], bool]:
    """A test for relative paths: a pattern matches the file name or the whole path."""
    regex = re.compile("|".join(fnmatch.translate(p) for p in patterns))

    def excluded(relpath: str) -> bool:
        return bool(regex.match(relpath.rsplit("/", 1)[-1]) or regex.match(relpath))

    return excluded


def scan(
    source: Path, include: list[str] | None = None, exclude: list[str] | None = None
) -> Manifest:
    """Hash every file under ``source`` (or only the ``include`` entries in it)."""
    source = Path(source)
    if not source.is_dir():
        raise ConfigError(f"source {source} is not a folder")
    is_excluded = exclusion_matcher((*DEFAULT_EXCLUDES, *(exclude or [])))
    roots = [source / entry for entry in include] if include else [source]
    for root in roots:
        if not root.exists():
            raise ConfigError(f"source entry {root} does not exist")
    manifest: Manifest = {}
    for root in roots:
        if root.is_file():
            rel = root.relative_to(source).as_posix()
            if not is_excluded(rel):
                manifest[rel] = _entry(root)
            continue
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            rel_dir = Path(dirpath).relative_to(source).as_posix()
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            dirnames[:] = sorted(d for d in dirnames if not is_excluded(rel_dir + d))
            for name in filenames:
                rel = rel_dir + name
                if is_excluded(rel):
                    continue
                full = os.path.join(dirpath, name)
                if not os.path.isfile(full):  # dangling symlinks, sockets, fifos
                    continue
                manifest[rel] = _entry(Path(full))
    return dict(sorted(manifest.items()))


def _entry(path: Path) -> list:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    mode = 0o755 if os.stat(path).st_mode & stat.S_IXUSR else 0o644
    return [h.hexdigest(), size, mode]


def release_id(manifest: Manifest) -> str:
    blob = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class SyncResult:
    release: str
    previous: str | None
    uploaded_files: int = 0
    uploaded_bytes: int = 0
    linked_files: int = 0
    already_present: bool = False
    method: str = "none"  # none | sftp | tar


@dataclass
class FileDiff:
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.added or self.changed or self.removed)


def diff_manifests(old: Manifest | None, new: Manifest) -> FileDiff:
    old = old or {}
    return FileDiff(
        added=sorted(p for p in new if p not in old),
        changed=sorted(p for p in new if p in old and old[p] != new[p]),
        removed=sorted(p for p in old if p not in new),
    )


class Releases:
    """Release bookkeeping on one host, through the stdlib helper (run as root)."""

    def __init__(self, conn: Connection, base: str, helper_python: str = "python3"):
        self.conn = conn
        self.base = base
        self.python = helper_python

    def call(self, action: str, *args: str, stdin: Any = None, timeout: float = 300) -> dict:
        argv = [self.python, "-c", _helper_source(), action, self.base, *args]
        data = None if stdin is None else json.dumps(stdin, separators=(",", ":"))
        result = self.conn.run(argv, stdin=data, timeout=timeout, sudo=True)
        if result.returncode == 127:
            raise RemoteError(
                f"{self.conn.label}: no {self.python} on the host to manage releases with",
                hint="install python3 on the host",
            )
        if not result.ok:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise RemoteError(f"{self.conn.label}: release {action} failed: {last}")
        try:
            return json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise RemoteError(f"{self.conn.label}: release {action} gave no answer") from exc

    def state(self) -> dict:
        return self.call("state")

    def manifest(self, rid: str = "current") -> Manifest | None:
        return self.call("manifest", rid)["manifest"]

    def switch(self, rid: str, keep: int) -> dict:
        out = self.call("switch", rid, str(keep))
        if not out.get("ok"):
            raise RemoteError(f"{self.conn.label}: {out.get('error')}")
        return out

    def previous(self) -> str | None:
        return self.call("previous")["previous"]


_HELPER: str | None = None


def _helper_source() -> str:
    global _HELPER
    if _HELPER is None:
        _HELPER = Path(release_helper.__file__).read_text()
    return _HELPER


Progress = Callable[[str], None]


def sync(
    conn: Connection,
    releases: Releases,
    source: Path,
    manifest: Manifest,
    *,
    rid: str | None = None,
    metadata: dict[str, str] | None = None,
    progress: Progress | None = None,
) -> SyncResult:
    """Make ``releases/<rid>`` on the host hold exactly ``manifest``; does not switch.

    ``rid`` defaults to the manifest's hash; a deploy mixes the unit file into it, so the
    same files run with another unit make another (fully hard-linked) release.
    """
    rid = rid or release_id(manifest)
    note = progress or (lambda _msg: None)
    st = releases.state()
    result = SyncResult(release=rid, previous=st["current"])
    if rid in st["releases"]:  # nothing to send, not even the manifest
        result.already_present = True
        return result
    owner = "" if conn.is_root else conn.user
    plan = releases.call("plan", rid, owner, stdin=manifest)
    if plan["exists"]:
        result.already_present = True
        return result
    missing: list[str] = plan["missing"]
    result.linked_files = plan["linked"]
    staging = f"{releases.base}/releases/.staging-{rid}"
    result.uploaded_files = len(missing)
    result.uploaded_bytes = sum(manifest[p][1] for p in missing)
    if missing:
        note(f"uploading {len(missing)} file(s), {_human(result.uploaded_bytes)}")
        if len(missing) <= SFTP_MAX_FILES:
            result.method = "sftp"
            sftp = conn.sftp()
            for path in missing:
                sftp.put(str(source / path), f"{staging}/{path}", confirm=False)
        else:
            result.method = "tar"
            out = conn.run(
                ["tar", "-x", "-f", "-", "-C", staging, "--no-same-owner"],
                stdin=_tar_stream(source, missing),
                timeout=3600,
            )
            if not out.ok:
                last = (out.stderr.strip().splitlines() or ["no output"])[-1]
                raise RemoteError(f"{conn.label}: unpacking the upload failed: {last}")
    # Files that came over SFTP are hashed on the host; the tar stream is covered by SSH's
    # message authentication and the size check, and hashing 100+ MB there costs a second.
    verify = missing if result.method == "sftp" else []
    done = releases.call(
        "finalize", rid, stdin={"manifest": manifest, "uploaded": verify, "files": metadata or {}}
    )
    if not done["ok"]:
        raise RemoteError(
            f"{conn.label}: release {rid} failed verification on the host: "
            f"{done['count']} file(s) wrong, e.g. {done['bad'][0]}",
            hint="run the deploy again; the running release was not touched",
        )
    return result


def _tar_stream(source: Path, paths: list[str]) -> Iterator[bytes]:
    """A plain ustar/pax stream of ``paths``, produced lazily while it is being sent."""
    for path in paths:
        full = source / path
        info = tarfile.TarInfo(path)
        st = full.stat()
        info.size = st.st_size
        info.mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
        info.mtime = int(st.st_mtime)
        yield info.tobuf(format=tarfile.GNU_FORMAT)
        sent = 0
        with open(full, "rb") as f:
            while chunk := f.read(1 << 20):
                sent += len(chunk)
                yield chunk
        if sent != info.size:
            raise RemoteError(f"{full} changed while it was being sent; run the deploy again")
        pad = (-info.size) % tarfile.BLOCKSIZE
        if pad:
            yield b"\0" * pad
    yield b"\0" * (2 * tarfile.BLOCKSIZE)


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
