"""Real test hosts: Debian 12 with systemd and OpenSSH, booted in systemd-nspawn on loopback.

Usage (as root, on a Debian-like machine with ``debootstrap`` and ``systemd-container``)::

    from tests.testhosts import start_host, unavailable_reason

    reason = unavailable_reason()          # None when hosts can be started here
    host = start_host(tmp_path)            # boots a fresh host, returns when sshd answers
    host.target                            # "root@127.0.0.1:PORT"
    host.client_key                        # private key accepted for root
    host.ssh(["systemctl", "is-system-running"])   # OpenSSH client, independent of ddtree
    host.stop()                            # `systemctl poweroff`, waits, cleans up

or the pytest fixture ``testhost`` / ``testhost_factory`` from ``tests/integration/conftest.py``.

How it works:
- ``ensure_rootfs()`` runs ``debootstrap --variant=minbase`` once (about two minutes) into a
  cache folder (``$DDTREE_TESTHOST_CACHE``, default ``~/.cache/ddtree/testhosts``), under a
  file lock so parallel test processes build it once.
- Each host gets an overlayfs over that read-only image (a full copy where overlayfs is not
  available), its own SSH host keys, sshd on its own free port on 127.0.0.1, and root's
  ``authorized_keys``. With no ``--network-*`` option the container shares this machine's
  network namespace, so a service the host starts on 127.0.0.1:PORT is reachable from the
  tests at the same address. Pick service ports with ``free_port()``.
- ``binds_ro`` bind-mounts folders read-only at the same or another path (the deploy tests
  mount a virtual environment with torch and the Python it was built from).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUITE = "bookworm"
MIRROR = os.environ.get("DDTREE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "libstdc++6",
    "libgomp1",
    "rsync",
    "sudo",
)
ROOTFS_VERSION = "3"  # bump when PACKAGES or the image setup changes


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "ddtree" / "testhosts"
    return Path(os.environ.get("DDTREE_TESTHOST_CACHE", default))


def unavailable_reason() -> str | None:
    """Why test hosts cannot start on this machine, or None when they can."""
    if os.geteuid() != 0:
        return "test hosts need root (debootstrap, mount, systemd-nspawn)"
    for tool in ("debootstrap", "systemd-nspawn", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return (
                f"{tool} not found (apt-get install debootstrap systemd-container openssh-client)"
            )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_rootfs() -> Path:
    """The cached read-only base image, built on first use."""
    base = cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    rootfs = base / f"{SUITE}-minbase-v{ROOTFS_VERSION}"
    if (rootfs / ".complete").exists():
        return rootfs
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (rootfs / ".complete").exists():
            return rootfs
        building = base / f".building-{uuid.uuid4().hex[:8]}"
        cmd = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            SUITE,
            str(building),
            MIRROR,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(building, ignore_errors=True)
            raise RuntimeError(f"debootstrap failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        _prepare_image(building)
        (building / ".complete").write_text("ok\n")
        if rootfs.exists():
            shutil.rmtree(rootfs)
        building.rename(rootfs)
    return rootfs


def _prepare_image(root: Path) -> None:
    # Host keys are made per host at start; a shared key would defeat the host-key tests.
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    # Units that only slow down or fail in a container.
    for unit in ("systemd-timesyncd.service", "apt-daily.timer", "apt-daily-upgrade.timer"):
        link = root / "etc/systemd/system/multi-user.target.wants" / unit
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
    (root / "etc/hostname").write_text("testhost\n")


@dataclass
class TestHost:
    """One booted host. ``target`` is what ``ddtree deploy --host`` takes."""

    __test__ = False  # not a pytest class

    name: str
    ssh_port: int
    root: Path
    client_key: Path
    workdir: Path
    process: subprocess.Popen
    mounted: bool
    log_path: Path
    binds_ro: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"root@127.0.0.1:{self.ssh_port}"

    @property
    def known_hosts_line(self) -> str:
        """The host's ed25519 key as a known_hosts line, for tests that pre-trust it."""
        pub = (self.root / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()
        return f"[127.0.0.1]:{self.ssh_port} {pub[0]} {pub[1]}\n"

    def ssh(
        self,
        argv: Sequence[str] | str,
        *,
        check: bool = True,
        timeout: float = 60,
        input: bytes | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a command on the host with the OpenSSH client (independent of ddtree's layer)."""
        import shlex

        command = argv if isinstance(argv, str) else shlex.join(argv)
        cmd = [
            "ssh",
            "-p",
            str(self.ssh_port),
            "-i",
            str(self.client_key),
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "BatchMode=yes",
            "root@127.0.0.1",
            command,
        ]
        proc = subprocess.run(cmd, capture_output=True, timeout=timeout, input=input)
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{command!r} on {self.name} failed ({proc.returncode}): "
                f"{proc.stderr.decode(errors='replace')[-2000:]}"
            )
        return proc

    def add_sudo_user(self, name: str = "deployer") -> str:
        """A non-root login with passwordless sudo and the same client key; returns its target."""
        script = (
            f"id {name} >/dev/null 2>&1 || useradd -m -s /bin/sh {name}; "
            f"install -d -m 700 -o {name} -g {name} /home/{name}/.ssh; "
            f"install -m 600 -o {name} -g {name} /root/.ssh/authorized_keys "
            f"/home/{name}/.ssh/authorized_keys; "
            f"echo '{name} ALL=(ALL) NOPASSWD: ALL' > /etc/sudoers.d/{name}; "
            f"chmod 440 /etc/sudoers.d/{name}"
        )
        self.ssh(["sh", "-c", script])
        return f"{name}@127.0.0.1:{self.ssh_port}"

    def reload_sshd(self) -> None:
        """Apply sshd_config changes and wait until sshd accepts connections again."""
        self.ssh(["systemctl", "reload", "ssh"])
        deadline = time.monotonic() + 30
        while self.ssh(["true"], check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {self.name} did not come back after reload")
            time.sleep(0.2)

    def regenerate_host_keys(self) -> None:
        """Give the host new SSH host keys, as a reinstall (or an attacker) would."""
        for key in (self.root / "etc/ssh").glob("ssh_host_*"):
            key.unlink()
        _make_host_keys(self.root)
        self.reload_sshd()

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(Exception):
                self.ssh(["systemctl", "poweroff"], check=False, timeout=15)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.terminate()  # nspawn turns SIGTERM into an orderly shutdown
                try:
                    self.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout=10)
        if self.mounted:
            for _ in range(20):
                if subprocess.run(["umount", str(self.root)], capture_output=True).returncode == 0:
                    break
                time.sleep(0.25)
            else:
                return  # still mounted: leave everything in place rather than delete through it
            self.mounted = False
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.workdir / "upper", ignore_errors=True)
        shutil.rmtree(self.workdir / "work", ignore_errors=True)


def _make_host_keys(root: Path) -> None:
    # ssh-keygen -A -f PREFIX writes PREFIX/etc/ssh/ssh_host_*_key for every key type.
    subprocess.run(["ssh-keygen", "-A", "-f", str(root)], check=True, capture_output=True)


def start_host(
    workdir: Path, *, binds_ro: Sequence[tuple[Path | str, str]] = (), boot_timeout: float = 90
) -> TestHost:
    """Boot a fresh host whose state lives under ``workdir``; returns once sshd answers."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    image = ensure_rootfs()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    name = f"ddt-{uuid.uuid4().hex[:10]}"
    root = workdir / "root"
    root.mkdir(exist_ok=True)
    mounted = _mount_overlay(image, workdir, root)
    if not mounted:
        root.rmdir()  # no overlayfs here (e.g. inside a container): a full copy instead
        subprocess.run(["cp", "-a", str(image), str(root)], check=True, capture_output=True)

    port = free_port()
    _make_host_keys(root)
    (root / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/ssh/sshd_config.d/10-testhost.conf").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nUseDNS no\n"
    )
    client_key = workdir / "id_ed25519"
    if not client_key.exists():
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(client_key)],
            check=True,
            capture_output=True,
        )
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text((workdir / "id_ed25519.pub").read_text())
    os.chmod(ssh_dir / "authorized_keys", 0o600)

    binds = [(Path(src), dst) for src, dst in binds_ro]
    cmd = [
        "systemd-nspawn",
        "--register=no",
        "--keep-unit",
        "--quiet",
        "-D",
        str(root),
        "-b",
        "-M",
        name,
        "--console=pipe",
    ]
    for src, dst in binds:
        cmd.append(f"--bind-ro={src}:{dst}")
    log_path = workdir / "console.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    host = TestHost(
        name=name,
        ssh_port=port,
        root=root,
        client_key=client_key,
        workdir=workdir,
        process=process,
        mounted=mounted,
        log_path=log_path,
        binds_ro=binds,
    )
    deadline = time.monotonic() + boot_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            host.stop()
            raise RuntimeError(
                f"systemd-nspawn exited ({process.returncode}): "
                f"{log_path.read_text(errors='replace')[-2000:]}"
            )
        try:
            proc = host.ssh(["systemctl", "is-system-running", "--wait"], check=False, timeout=60)
        except subprocess.TimeoutExpired:
            continue
        if proc.returncode in (0, 1) and proc.stdout.strip():
            return host
        time.sleep(0.3)
    host.stop()
    raise RuntimeError(f"test host {name} did not answer on SSH within {boot_timeout:.0f} s")


def _mount_overlay(image: Path, workdir: Path, root: Path) -> bool:
    upper, work = workdir / "upper", workdir / "work"
    upper.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    opts = f"lowerdir={image},upperdir={upper},workdir={work}"
    proc = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", opts, str(root)], capture_output=True
    )
    return proc.returncode == 0


def host_python_binds(python: str | Path) -> tuple[str, list[tuple[Path, str]]]:
    """Read-only binds that make a virtual environment built here usable inside a host.

    Returns the interpreter path to use inside the host and the binds: the venv at
    ``/opt/ddtree/venv`` and the base Python prefix it links to at its own path (a venv's
    ``bin/python`` is a symlink into that prefix).
    """
    venv = Path(python).parent.parent
    base = subprocess.run(
        [str(python), "-c", "import sys; print(sys.base_prefix)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    binds: list[tuple[Path, str]] = [(venv.resolve(), "/opt/ddtree/venv")]
    if not base.startswith("/usr"):
        binds.append((Path(base), base))
    return "/opt/ddtree/venv/bin/python", binds


# ---------------------------------------------------------------------------- pytest fixtures
# Import these into a conftest.py: ``from tests.testhosts import testhost, testhost_factory``.

import pytest  # noqa: E402


@pytest.fixture
def testhost_factory(tmp_path_factory):
    """``start(binds_ro=...) -> TestHost``; every host started is stopped after the test."""
    from tests.conftest import require

    require(unavailable_reason() is None, f"no test hosts: {unavailable_reason()}")
    started: list[TestHost] = []

    def start(binds_ro: Sequence[tuple[Path | str, str]] = ()) -> TestHost:
        host = start_host(tmp_path_factory.mktemp("testhost"), binds_ro=binds_ro)
        started.append(host)
        return host

    yield start
    for host in started:
        host.stop()


@pytest.fixture
def testhost(testhost_factory) -> TestHost:
    """One fresh booted host."""
    return testhost_factory()
