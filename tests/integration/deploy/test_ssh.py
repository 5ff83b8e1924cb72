"""The SSH layer against real OpenSSH servers in systemd-nspawn test hosts."""

from __future__ import annotations

import socket

import pytest

from ddtree_cli.errors import RemoteError
from ddtree_cli.remote.ssh import connect

pytestmark = pytest.mark.nspawn


def test_run_argv_stdin_and_sftp(testhost, tmp_path):
    known = tmp_path / "known_hosts"
    with connect(
        testhost.target, identity=testhost.client_key, accept_new_host_key=True, known_hosts=known
    ) as conn:
        # Arguments with spaces and quotes survive as single words.
        result = conn.run(["printf", "%s|", "a b", "it's", "$HOME"])
        assert result.ok and result.stdout == "a b|it's|$HOME|"
        assert conn.run(["cat"], stdin=b"x" * 3_000_000).stdout == "x" * 3_000_000
        failed = conn.run(["sh", "-c", "echo oops >&2; exit 3"])
        assert (failed.returncode, failed.stderr) == (3, "oops\n")
        with pytest.raises(RemoteError, match="exit 3"):
            conn.run(["sh", "-c", "exit 3"], check=True)
        with conn.sftp().open("/tmp/sftp-check", "w") as f:
            f.write(b"hello")
        assert conn.run(["cat", "/tmp/sftp-check"]).stdout == "hello"
        with pytest.raises(RemoteError, match="timed out"):
            conn.run(["sleep", "30"], timeout=1)
        conn.check_root()
    # accept-new recorded the key in the given file; the next connection needs no flag.
    assert f"[127.0.0.1]:{testhost.ssh_port} ssh-ed25519 " in known.read_text()
    with connect(testhost.target, identity=testhost.client_key, known_hosts=known) as conn:
        assert conn.run(["true"]).ok


def test_unknown_host_key_refused_without_accept_new(testhost, tmp_path):
    known = tmp_path / "known_hosts"
    with pytest.raises(RemoteError, match="unknown host key") as info:
        connect(testhost.target, identity=testhost.client_key, known_hosts=known)
    assert "--accept-new-host-key" in info.value.hint
    assert not known.exists()


def test_changed_host_key_refused_naming_file_and_line(testhost, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("# comment\nother.example ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBx\n")
    connect(
        testhost.target, identity=testhost.client_key, accept_new_host_key=True, known_hosts=known
    ).close()
    testhost.regenerate_host_keys()
    before = known.read_text()
    for accept in (False, True):  # accept-new never overrides a changed key
        with pytest.raises(RemoteError, match=rf"CHANGED.*{known}:3 holds a different key"):
            connect(
                testhost.target,
                identity=testhost.client_key,
                known_hosts=known,
                accept_new_host_key=accept,
            )
    assert known.read_text() == before


def test_auth_failure_and_unreachable_are_one_line(testhost, tmp_path):
    import subprocess

    other_key = tmp_path / "other"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True
    )
    known = tmp_path / "known_hosts"
    known.write_text(testhost.known_hosts_line)
    with pytest.raises(RemoteError, match="authentication failed for root@"):
        connect(testhost.target, identity=other_key, known_hosts=known)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    with pytest.raises(RemoteError, match="cannot reach .*connection refused"):
        connect(f"root@127.0.0.1:{closed_port}", identity=other_key, known_hosts=known)
    with pytest.raises(RemoteError, match="unknown host name"):
        connect("root@no-such-host.invalid", identity=other_key, known_hosts=known)


def test_ssh_config_alias_and_proxyjump(testhost_factory, tmp_path):
    jump, target = testhost_factory(), testhost_factory()
    known = tmp_path / "known_hosts"
    known.write_text(jump.known_hosts_line + target.known_hosts_line)
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host jumpbox\n  HostName 127.0.0.1\n  Port {jump.ssh_port}\n  User root\n"
        f"  IdentityFile {jump.client_key}\n"
        f"Host gpu-behind\n  HostName 127.0.0.1\n  Port {target.ssh_port}\n  User root\n"
        f"  IdentityFile {target.client_key}\n  ProxyJump jumpbox\n"
    )
    with connect("gpu-behind", ssh_config=config, known_hosts=known) as conn:
        assert conn.run(["cat", "/etc/ssh/sshd_config.d/10-testhost.conf"]).stdout.startswith(
            f"Port {target.ssh_port}\n"
        )
        assert conn.user == "root" and conn.port == target.ssh_port
    # Proof that the session went through the jump host: forbid forwarding there.
    (jump.root / "etc/ssh/sshd_config.d/05-nofwd.conf").write_text("AllowTcpForwarding no\n")
    jump.reload_sshd()
    with pytest.raises(RemoteError, match="through jump host"):
        connect("gpu-behind", ssh_config=config, known_hosts=known)
