"""Release sync against a real host: dropped connections, convergence, pruning."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path

import pytest

from ddtree_cli.deploy.sync import Releases, scan, sync
from ddtree_cli.errors import RemoteError
from ddtree_cli.remote.ssh import connect

pytestmark = pytest.mark.nspawn


class CuttingProxy:
    """A TCP forwarder to sshd that drops both sides once ``limit`` bytes went upstream:
    a real connection dying in the middle of an upload, not a simulated exception."""

    def __init__(self, port: int, limit: int):
        self.target = port
        self.limit = limit
        self.sent = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        client, _ = self.server.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target))

        def pump(src, dst, count):
            try:
                while data := src.recv(65536):
                    if count:
                        self.sent += len(data)
                        if self.sent > self.limit:
                            break
                    dst.sendall(data)
            except OSError:
                pass
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

        threading.Thread(target=pump, args=(client, upstream, True), daemon=True).start()
        threading.Thread(target=pump, args=(upstream, client, False), daemon=True).start()


def make_tree(root: Path, files: int, size: int, seed: bytes) -> None:
    for i in range(files):
        path = root / f"pkg{i % 4}" / f"f{i}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(seed + os.urandom(size))


def remote_sha(host, path: str) -> dict[str, str]:
    out = host.ssh(
        [
            "sh",
            "-c",
            f"cd {path} && find . -path ./.ddtree -prune -o -type f -print0 | xargs -0 sha256sum",
        ]
    ).stdout.decode()
    return {line.split(None, 1)[1][2:]: line.split()[0] for line in out.splitlines()}


def test_connection_killed_mid_sync_leaves_current_and_rerun_converges(testhost, tmp_path):
    known = tmp_path / "known_hosts"
    base = "/opt/synctest"
    src_a, src_b = tmp_path / "a", tmp_path / "b"
    make_tree(src_a, 40, 20_000, b"a")
    make_tree(src_b, 200, 50_000, b"b")  # 10 MB, all new: goes as a tar stream
    manifest_a, manifest_b = scan(src_a), scan(src_b)

    with connect(
        testhost.target, identity=testhost.client_key, known_hosts=known, accept_new_host_key=True
    ) as conn:
        releases = Releases(conn, base)
        a = sync(conn, releases, src_a, manifest_a)
        releases.switch(a.release, 3)
    files_a = remote_sha(testhost, f"{base}/current")
    assert len(files_a) == 40

    proxy = CuttingProxy(testhost.ssh_port, limit=3_000_000)
    known_proxy = tmp_path / "known_proxy"
    known_proxy.write_text(
        testhost.known_hosts_line.replace(f"]:{testhost.ssh_port} ", f"]:{proxy.port} ")
    )
    with (
        pytest.raises(RemoteError, match="connection lost|failed"),
        connect(
            f"root@127.0.0.1:{proxy.port}", identity=testhost.client_key, known_hosts=known_proxy
        ) as conn,
    ):
        sync(conn, Releases(conn, base), src_b, manifest_b)
    assert proxy.sent > 3_000_000  # it really died mid-upload
    # The running release is untouched; the half upload sits in a staging folder only.
    assert (
        testhost.ssh(["readlink", f"{base}/current"]).stdout.decode().strip()
        == f"releases/{a.release}"
    )
    assert remote_sha(testhost, f"{base}/current") == files_a
    leftovers = testhost.ssh(["ls", "-A", f"{base}/releases"]).stdout.decode().split()
    assert any(name.startswith(".staging-") for name in leftovers)

    with connect(testhost.target, identity=testhost.client_key, known_hosts=known) as conn:
        releases = Releases(conn, base)
        b = sync(conn, releases, src_b, manifest_b)
        assert b.uploaded_files == 200
        releases.switch(b.release, 3)
        assert releases.manifest("current") == manifest_b
    expected = {path: entry[0] for path, entry in manifest_b.items()}
    assert remote_sha(testhost, f"{base}/current") == expected
    names = testhost.ssh(["ls", "-A", f"{base}/releases"]).stdout.decode().split()
    assert sorted(names) == sorted([a.release, b.release])  # staging cleaned up


def test_unchanged_files_are_hard_linked_and_old_releases_pruned(testhost, tmp_path):
    known = tmp_path / "known_hosts"
    base = "/opt/prunetest"
    src = tmp_path / "src"
    make_tree(src, 20, 1000, b"x")
    ids = []
    with connect(
        testhost.target, identity=testhost.client_key, known_hosts=known, accept_new_host_key=True
    ) as conn:
        releases = Releases(conn, base)
        for round_ in range(4):
            (src / "pkg0" / "f0.bin").write_bytes(b"round %d" % round_)
            result = sync(conn, releases, src, scan(src))
            assert result.uploaded_files == (20 if round_ == 0 else 1)
            assert result.linked_files == (0 if round_ == 0 else 19)
            releases.switch(result.release, 2)
            ids.append(result.release)
        state = releases.state()
    assert state["current"] == ids[-1] and state["releases"] == sorted(ids[-2:])
    assert state["history"] == ids[-2:]
    inode = "stat -c %i {}/releases/{}/pkg1/f1.bin"
    same = {testhost.ssh(["sh", "-c", inode.format(base, rid)]).stdout for rid in ids[-2:]}
    assert len(same) == 1  # one file on disk shared by both releases
