"""Operating a unit on a host over SSH, as root: its files, systemctl, its state and journal."""

from __future__ import annotations

from ddtree_cli.remote.ssh import Connection


def write_root_file(conn: Connection, path: str, text: str, mode: int = 0o644) -> None:
    """Write a file as root atomically, created with ``mode`` before any content lands."""
    script = (
        "import os,sys;p=sys.argv[1];m=int(sys.argv[2],8);t=p+'.tmp';"
        "os.makedirs(os.path.dirname(p),exist_ok=True);"
        "fd=os.open(t,os.O_WRONLY|os.O_CREAT|os.O_TRUNC,m);os.fchmod(fd,m);"
        "os.write(fd,sys.stdin.buffer.read());os.fsync(fd);os.close(fd);os.replace(t,p)"
    )
    conn.run(
        ["python3", "-c", script, path, oct(mode)[2:]],
        stdin=text,
        timeout=60,
        sudo=True,
        check=True,
    )


def read_root_file(conn: Connection, path: str) -> str | None:
    result = conn.run(["cat", path], timeout=60, sudo=True)
    return result.stdout if result.ok else None


def systemctl(conn: Connection, *args: str, check: bool = True, timeout: float = 120):
    return conn.run(["systemctl", *args], timeout=timeout, sudo=True, check=check)


def unit_state(conn: Connection, unit: str) -> dict[str, str]:
    out = conn.run(
        [
            "systemctl",
            "show",
            unit,
            "--property=ActiveState,SubState,NRestarts,ExecMainStatus,LoadState",
        ],
        timeout=60,
    )
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def journal_tail(
    conn: Connection, unit: str, lines: int = 20, since: str | None = None
) -> list[str]:
    argv = ["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"]
    if since:
        argv += ["--since", since]
    out = conn.run(argv, timeout=60, sudo=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


def host_now(conn: Connection) -> str:
    """The host's clock, for ``journalctl --since`` (local and host clocks may disagree)."""
    return conn.run(["date", "+%Y-%m-%d %H:%M:%S"], timeout=30, check=True).stdout.strip()
