"""SSH connections with paramiko, checked the way OpenSSH checks them.

- Targets are ``[USER@]HOST[:PORT]`` (IPv6 as ``[addr]:port``) or a ``~/.ssh/config`` alias;
  HostName, User, Port, IdentityFile, UserKnownHostsFile, StrictHostKeyChecking and
  ProxyJump are honoured (ProxyJump through ``direct-tcpip`` channels of the jump host).
- Host keys are checked against known_hosts. An unknown key is refused unless
  ``accept_new_host_key`` (OpenSSH's ``accept-new``: the key is recorded); a changed key is
  always refused, naming the known_hosts file and line that holds the old one.
- Every failure a user can act on is one :class:`RemoteError` line.
- Remote commands are argument lists, joined with :func:`shlex.join`.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import shlex
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

import paramiko

from ddtree_cli.errors import RemoteError
from ddtree_cli.remote.hostspec import HostSpec

DEFAULT_KEYS = ("id_ed25519", "id_ecdsa", "id_rsa")
# paramiko logs refused tunnel channels (expected while a server starts) at ERROR level;
# our callers report failures themselves, as one line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False
CONNECT_TIMEOUT_S = 15.0


class _Transport(paramiko.Transport):
    # AES-GCM needs no separate MAC pass: about 1.6x the throughput of paramiko's default
    # aes128-ctr + hmac-sha2-256 for a bulk upload. A wide window keeps the pipe full.
    _preferred_ciphers = (
        "aes128-gcm@openssh.com",
        "aes256-gcm@openssh.com",
        *(c for c in paramiko.Transport._preferred_ciphers if "gcm" not in c),
    )
    default_window_size = 32 * 1024 * 1024


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


# ---------------------------------------------------------------------------- known_hosts


@dataclass(frozen=True)
class KnownKey:
    path: Path
    line: int
    keytype: str
    key_b64: str


def known_host_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def _glob_match(pattern: str, name: str) -> bool:
    # OpenSSH patterns know only '*' and '?'; '[' is literal (as in "[host]:port").
    import re

    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, name) is not None


def _host_matches(pattern_field: str, name: str) -> bool:
    if pattern_field.startswith("|1|"):
        try:
            _, _, salt_b64, hash_b64 = pattern_field.split("|")
            import hmac

            salt = base64.b64decode(salt_b64)
            digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
            return base64.b64encode(digest).decode() == hash_b64
        except (ValueError, TypeError):
            return False
    matched = False
    for pattern in pattern_field.split(","):
        negated = pattern.startswith("!")
        if _glob_match(pattern[1:] if negated else pattern, name):
            if negated:
                return False
            matched = True
    return matched


def read_known_keys(paths: Iterable[Path], name: str) -> list[KnownKey]:
    """Every key recorded for ``name`` (``host`` or ``[host]:port``), with file and line."""
    found: list[KnownKey] = []
    for path in paths:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for number, line in enumerate(lines, start=1):
            fields = line.split()
            if len(fields) < 3 or fields[0].startswith("#") or fields[0].startswith("@"):
                continue  # markers (@cert-authority, @revoked) are not handled here
            if _host_matches(fields[0], name):
                found.append(KnownKey(path, number, fields[1], fields[2]))
    return found


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class _HostKeyCheck(paramiko.MissingHostKeyPolicy):
    """Decides on the server's key with our own known_hosts reading, which knows line numbers.

    The client is given no host keys of its own, so paramiko hands every key to this policy.
    """

    def __init__(self, name: str, known: list[KnownKey], record_to: Path | None):
        self.name = name
        self.known = known
        self.record_to = record_to

    def missing_host_key(self, client, hostname, key) -> None:
        key_b64 = key.get_base64()
        same_type = [k for k in self.known if k.keytype == key.get_name()]
        if any(k.key_b64 == key_b64 for k in same_type):
            return
        if self.known:
            raise self.changed(key)
        if self.record_to is None:
            raise RemoteError(
                f"unknown host key for {self.name} ({key.get_name()} {fingerprint(key)})",
                hint="check the fingerprint, then re-run with --accept-new-host-key to record it",
            )
        _append_known_host(self.record_to, f"{self.name} {key.get_name()} {key_b64}\n")

    def changed(self, key: paramiko.PKey) -> RemoteError:
        same_type = [k for k in self.known if k.keytype == key.get_name()]
        old = same_type[0] if same_type else self.known[0]
        return RemoteError(
            f"host key for {self.name} has CHANGED ({key.get_name()} {fingerprint(key)}); "
            f"refusing to connect: {old.path}:{old.line} holds a different key",
            hint=f"if the host was reinstalled, remove that line "
            f"(ssh-keygen -R '{self.name}' -f {old.path}) and connect again",
        )


def _append_known_host(path: Path, line: str) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = path.read_bytes() if path.exists() else b""
    prefix = b"\n" if existing and not existing.endswith(b"\n") else b""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "ab") as f:
        f.write(prefix + line.encode())


# ---------------------------------------------------------------------------- connection


class Connection:
    """An authenticated SSH session to one host. Use as a context manager or call close()."""

    def __init__(
        self,
        spec: HostSpec,
        client: paramiko.SSHClient,
        hostname: str,
        port: int,
        user: str,
        jumps: list[Connection],
    ):
        self.spec = spec
        self.hostname = hostname
        self.port = port
        self.user = user
        self._client = client
        self._jumps = jumps
        self._sftp: paramiko.SFTPClient | None = None

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def transport(self) -> paramiko.Transport:
        transport = self._client.get_transport()
        if transport is None or not transport.is_active():
            raise RemoteError(f"{self.label}: connection lost")
        return transport

    @property
    def is_root(self) -> bool:
        return self.user == "root"

    def _command(self, argv: Sequence[str], sudo: bool) -> str:
        if not argv:
            raise ValueError("empty command")
        words = [str(a) for a in argv]
        if sudo and not self.is_root:
            words = ["sudo", "-n", "--", *words]
        return shlex.join(words)

    def run(
        self,
        argv: Sequence[str],
        stdin: bytes | str | IO[bytes] | Iterable[bytes] | None = None,
        timeout: float | None = None,
        *,
        sudo: bool = False,
        check: bool = False,
    ) -> Result:
        """Run ``argv`` on the host and collect its output.

        ``stdin`` may be bytes, text, a binary file or an iterable of byte chunks; it is sent
        from a thread so a command that writes while it reads cannot deadlock. ``sudo`` runs
        as root through passwordless sudo when the login user is not root. ``check`` turns a
        non-zero exit into a RemoteError carrying the last stderr line.
        """
        command = self._command(argv, sudo)
        try:
            channel = self.transport.open_session(timeout=CONNECT_TIMEOUT_S)
            channel.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise RemoteError(
                f"{self.label}: connection lost ({exc or type(exc).__name__})"
            ) from exc
        writer = _start_stdin_writer(channel, stdin)
        out, err = bytearray(), bytearray()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                busy = False
                if channel.recv_ready():
                    out += channel.recv(1 << 16)
                    busy = True
                if channel.recv_stderr_ready():
                    err += channel.recv_stderr(1 << 16)
                    busy = True
                # The exit status can arrive before the last output: stop at EOF instead.
                if (
                    channel.eof_received
                    and not channel.recv_ready()
                    and not channel.recv_stderr_ready()
                ):
                    break
                if not self.transport.is_active():
                    raise RemoteError(
                        f"{self.label}: connection lost while running {_short(command)}"
                    )
                if deadline is not None and time.monotonic() > deadline:
                    channel.close()
                    raise RemoteError(
                        f"{self.label}: {_short(command)} timed out after {timeout:.0f} s"
                    )
                if not busy:
                    channel.status_event.wait(0.005)
            # Drain what arrived between the last read and the exit status.
            while channel.recv_ready():
                out += channel.recv(1 << 16)
            while channel.recv_stderr_ready():
                err += channel.recv_stderr(1 << 16)
            code = channel.recv_exit_status()
        finally:
            if writer is not None:
                writer.join(timeout=5)
            channel.close()
        if writer is not None and writer.error is not None and code == 0:
            raise RemoteError(f"{self.label}: connection lost while sending data ({writer.error})")
        result = Result(code, out.decode(errors="replace"), err.decode(errors="replace"))
        if check and not result.ok:
            last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RemoteError(f"{self.label}: {_short(command)} failed (exit {code}): {last}")
        return result

    def check_root(self) -> None:
        """Raise unless commands can run as root (logged in as root, or passwordless sudo)."""
        if self.is_root:
            return
        if not self.run(["sudo", "-n", "true"], timeout=30).ok:
            raise RemoteError(
                f"{self.label}: user {self.user} is not root and has no passwordless sudo",
                hint="log in as root or allow NOPASSWD sudo for this user",
            )

    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            try:
                self._sftp = self._client.open_sftp()
            except (paramiko.SSHException, OSError, EOFError) as exc:
                raise RemoteError(f"{self.label}: cannot open SFTP ({exc})") from exc
        return self._sftp

    def open_tunnel(
        self, host: str, port: int, timeout: float = CONNECT_TIMEOUT_S
    ) -> paramiko.Channel:
        """A TCP connection made by the host to ``host:port`` (the host's own view)."""
        try:
            return self.transport.open_channel(
                "direct-tcpip", (host, port), ("127.0.0.1", 0), timeout=timeout
            )
        except paramiko.ChannelException as exc:
            raise ConnectionRefusedError(f"{host}:{port} via {self.label}: {exc}") from exc

    def close(self) -> None:
        if self._sftp is not None:
            with contextlib.suppress(Exception):
                self._sftp.close()
            self._sftp = None
        with contextlib.suppress(Exception):
            self._client.close()
        for jump in reversed(self._jumps):
            jump.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _StdinWriter(threading.Thread):
    def __init__(self, channel: paramiko.Channel, chunks: Iterable[bytes]):
        super().__init__(daemon=True)
        self.channel = channel
        self.chunks = chunks
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for chunk in self.chunks:
                if chunk:
                    self.channel.sendall(chunk)
            self.channel.shutdown_write()
        except Exception as exc:  # reported by run(); the thread must not die silently
            self.error = exc


def _start_stdin_writer(channel: paramiko.Channel, stdin) -> _StdinWriter | None:
    if stdin is None:
        channel.shutdown_write()
        return None
    if isinstance(stdin, str):
        stdin = stdin.encode()
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        data = bytes(stdin)
        chunks: Iterable[bytes] = (data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20))
    elif hasattr(stdin, "read"):
        chunks = iter(lambda: stdin.read(1 << 20), b"")
    else:
        chunks = stdin
    writer = _StdinWriter(channel, chunks)
    writer.start()
    return writer


def _short(command: str, limit: int = 80) -> str:
    return command if len(command) <= limit else command[: limit - 3] + "..."


# ---------------------------------------------------------------------------- connect


def _load_ssh_config(path: str | Path | None) -> paramiko.SSHConfig:
    path = Path(path).expanduser() if path else Path("~/.ssh/config").expanduser()
    if not path.exists():
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(str(path))
    except Exception as exc:  # paramiko raises several types for malformed files
        raise RemoteError(f"{path}: cannot read SSH config ({exc})") from exc


def _expand(path: str) -> Path:
    return Path(os.path.expandvars(path)).expanduser()


def connect(
    target: str | HostSpec,
    *,
    identity: str | Path | None = None,
    accept_new_host_key: bool = False,
    known_hosts: str | Path | None = None,
    ssh_config: str | Path | paramiko.SSHConfig | None = None,
    timeout: float = CONNECT_TIMEOUT_S,
    _depth: int = 0,
) -> Connection:
    """Open an authenticated connection; raise RemoteError with one line on any failure.

    ``known_hosts`` replaces the user's known_hosts file (and is where new keys are
    recorded); ``ssh_config`` is a path or a parsed config (default ``~/.ssh/config``).
    """
    spec = target if isinstance(target, HostSpec) else HostSpec.parse(target)
    config = (
        ssh_config if isinstance(ssh_config, paramiko.SSHConfig) else _load_ssh_config(ssh_config)
    )
    hostname, port, options = _resolve(spec, config)
    common = dict(accept_new_host_key=accept_new_host_key, known_hosts=known_hosts, timeout=timeout)
    jumps: list[Connection] = []
    try:
        proxy = options.get("proxyjump", "")
        if proxy and proxy.lower() != "none":
            if _depth > 8:
                raise RemoteError(f"{spec.label}: ProxyJump chain too long (a loop in ssh config?)")
            hops = [HostSpec.parse(h) for h in proxy.split(",")]
            via = connect(hops[0], ssh_config=config, _depth=_depth + 1, **common)
            jumps.append(via)
            for hop in hops[1:]:
                hop_host, hop_port, hop_options = _resolve(hop, config)
                sock = _tunnel(via, hop_host, hop_port, hop.label, timeout)
                via = _handshake(sock, hop, hop_host, hop_port, hop_options, None, **common)
                jumps.append(via)
            sock = _tunnel(via, hostname, port, spec.label, timeout)
        else:
            sock = _open_socket(hostname, port, timeout, spec.label)
        conn = _handshake(sock, spec, hostname, port, options, identity, **common)
        conn._jumps = jumps
        return conn
    except BaseException:
        for jump in reversed(jumps):
            jump.close()
        raise


def _resolve(spec: HostSpec, config: paramiko.SSHConfig) -> tuple[str, int, dict]:
    options = config.lookup(spec.host)
    hostname = options.get("hostname", spec.host)
    try:
        port = spec.port or int(options.get("port", 22))
    except ValueError as exc:
        raise RemoteError(f"{spec.label}: invalid Port in ssh config") from exc
    return hostname, port, options


def _tunnel(via: Connection, host: str, port: int, label: str, timeout: float):
    try:
        return via.open_tunnel(host, port, timeout=timeout)
    except (ConnectionRefusedError, paramiko.SSHException, OSError) as exc:
        raise RemoteError(f"cannot reach {label} through jump host {via.label}: {exc}") from exc


def _handshake(
    sock,
    spec: HostSpec,
    hostname: str,
    port: int,
    options: dict,
    identity: str | Path | None,
    *,
    accept_new_host_key: bool,
    known_hosts: str | Path | None,
    timeout: float,
) -> Connection:
    name = known_host_name(options.get("hostkeyalias", hostname), port)
    if known_hosts is not None:
        user_known = [Path(known_hosts).expanduser()]
    elif "userknownhostsfile" in options:
        user_known = [_expand(p) for p in options["userknownhostsfile"].split()]
    else:
        user_known = [_expand("~/.ssh/known_hosts"), _expand("~/.ssh/known_hosts2")]
    system_known = [Path("/etc/ssh/ssh_known_hosts"), Path("/etc/ssh/ssh_known_hosts2")]
    strict = options.get("stricthostkeychecking", "").lower()
    accept_new = accept_new_host_key or strict in ("accept-new", "no", "off")
    known = read_known_keys([*user_known, *system_known], name)
    check = _HostKeyCheck(name, known, user_known[0] if accept_new else None)
    user = spec.user or options.get("user") or _local_user()
    identities = _identity_files(identity or spec.identity, options)

    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(check)
    _prefer_known_key_type(client, name, known)
    try:
        client.connect(
            hostname,
            port=port,
            username=user,
            key_filename=[str(p) for p in identities] or None,
            look_for_keys=False,
            allow_agent=True,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
            sock=sock,
            transport_factory=_Transport,
        )
    except RemoteError:
        client.close()
        raise
    except paramiko.BadHostKeyException as exc:
        client.close()
        raise check.changed(exc.key) from exc
    except paramiko.AuthenticationException as exc:
        client.close()
        tried = ", ".join(str(p) for p in identities) or "no key files"
        raise RemoteError(
            f"authentication failed for {user}@{name} (tried {tried} and the SSH agent)",
            hint="pass --identity KEY or add the key to the agent",
        ) from exc
    except (paramiko.SSHException, OSError, EOFError) as exc:
        client.close()
        reason = str(exc) or type(exc).__name__
        raise RemoteError(f"cannot reach {spec.label}: SSH handshake failed ({reason})") from exc
    return Connection(replace(spec, user=user), client, hostname, port, user, [])


def _prefer_known_key_type(client: paramiko.SSHClient, name: str, known: list[KnownKey]) -> None:
    # paramiko negotiates the server's preferred key type unless it holds a key for the host;
    # seeding the first recorded key makes it ask for that type, as OpenSSH does. A mismatch
    # then surfaces as BadHostKeyException, which connect() turns into the file:line error.
    if not known:
        return
    first = known[0]
    try:
        key = paramiko.PKey.from_type_string(first.keytype, base64.b64decode(first.key_b64))
    except Exception:
        return
    client.get_host_keys().add(name, first.keytype, key)


def _identity_files(explicit: str | Path | None, options: dict) -> list[Path]:
    if explicit:
        path = _expand(str(explicit))
        if not path.exists():
            raise RemoteError(f"identity file {path} does not exist")
        return [path]
    files = [_expand(p) for p in options.get("identityfile", [])]
    if not files:
        files = [_expand(f"~/.ssh/{name}") for name in DEFAULT_KEYS]
    return [p for p in files if p.exists()]


def _open_socket(hostname: str, port: int, timeout: float, label: str) -> socket.socket:
    try:
        return socket.create_connection((hostname, port), timeout=timeout)
    except socket.gaierror as exc:
        raise RemoteError(f"cannot reach {label}: unknown host name {hostname!r}") from exc
    except TimeoutError as exc:
        raise RemoteError(
            f"cannot reach {label}: connection to {hostname}:{port} timed out"
        ) from exc
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise RemoteError(f"cannot reach {label}: {hostname}:{port}: {reason.lower()}") from exc


def _local_user() -> str:
    import getpass

    return getpass.getuser()
