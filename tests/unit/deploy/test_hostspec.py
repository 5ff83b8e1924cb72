from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from ddtree_cli.errors import RemoteError
from ddtree_cli.remote.hostspec import HostSpec
from ddtree_cli.remote.ssh import read_known_keys


@pytest.mark.parametrize(
    ("text", "user", "host", "port"),
    [
        ("gpu1", None, "gpu1", None),
        ("root@gpu1", "root", "gpu1", None),
        ("root@127.0.0.1:2222", "root", "127.0.0.1", 2222),
        ("ubuntu@[::1]:22", "ubuntu", "::1", 22),
        ("fe80::1", None, "fe80::1", None),
        ("a.b@host.example:65535", "a.b", "host.example", 65535),
    ],
)
def test_parse(text, user, host, port):
    spec = HostSpec.parse(text)
    assert (spec.user, spec.host, spec.port) == (user, host, port)


@pytest.mark.parametrize("text", ["", "@host", "host:0", "host:99999", "host:x", "[::1", "a b"])
def test_parse_rejects(text):
    with pytest.raises(RemoteError, match="invalid host"):
        HostSpec.parse(text)


def test_known_hosts_plain_hashed_and_bracketed(tmp_path):
    salt = b"0123456789abcdef0123"
    digest = hmac.new(salt, b"[10.0.0.5]:2222", hashlib.sha1).digest()
    hashed = f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"
    known = tmp_path / "known_hosts"
    known.write_text(
        "# comment\n"
        "[10.0.0.5]:2222 ssh-rsa AAAArsa\n"
        "10.0.0.5 ssh-ed25519 AAAAplain22\n"
        f"{hashed} ssh-ed25519 AAAAhashed\n"
        "*.example,!bad.example ssh-ed25519 AAAAwild\n"
        "@cert-authority *.example ssh-ed25519 AAAAca\n"
    )
    found = read_known_keys([known], "[10.0.0.5]:2222")
    assert [(k.line, k.key_b64) for k in found] == [(2, "AAAArsa"), (4, "AAAAhashed")]
    assert [k.line for k in read_known_keys([known], "10.0.0.5")] == [3]
    assert [k.line for k in read_known_keys([known], "gpu.example")] == [5]
    assert read_known_keys([known], "bad.example") == []
    assert read_known_keys([tmp_path / "missing"], "x") == []


def test_scan_skips_caches_vcs_and_secrets(tmp_path):
    from ddtree_cli.deploy.sync import diff_manifests, release_id, scan

    for rel in (
        "pkg/a.py",
        "pkg/__pycache__/a.cpython-311.pyc",
        ".git/config",
        ".env",
        "pkg/.env.local",
        "deploy/server.pem",
        ".ddtree/state",
        "pkg/tool.sh",
        "keys/id_ed25519",
        "pkg/data.bin",
    ):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rel.encode())
    (tmp_path / "pkg/tool.sh").chmod(0o755)
    manifest = scan(tmp_path)
    assert sorted(manifest) == ["pkg/a.py", "pkg/data.bin", "pkg/tool.sh"]
    assert manifest["pkg/tool.sh"][2] == 0o755 and manifest["pkg/a.py"][2] == 0o644
    assert sorted(scan(tmp_path, include=["pkg"], exclude=["*.bin"])) == ["pkg/a.py", "pkg/tool.sh"]
    changed = dict(manifest, **{"pkg/a.py": ["0" * 64, 1, 0o644]})
    diff = diff_manifests(manifest, changed)
    assert (diff.added, diff.changed, diff.removed) == ([], ["pkg/a.py"], [])
    assert release_id(manifest) != release_id(changed)
