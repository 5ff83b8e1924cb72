"""Deploy sync vs ``rsync -a`` over ssh, to a real test host, in the same run.

Ships an extracted sglang 0.5.23 wheel (``pip download --no-deps sglang==0.5.23``) to a
systemd-nspawn test host (tests/testhosts.py) and times, alternating the two tools:

- first deploy into an empty folder: ``ddtree`` (connect + hash + sync + switch) vs
  ``rsync -a -e ssh`` (ssh connect + transfer);
- a re-deploy with nothing changed, for both.

Bytes are counted on the wire by a TCP forwarder in front of the host's sshd, both
directions, for both tools. Needs root, debootstrap, systemd-nspawn and rsync.

    sudo .venv/bin/python benchmarks/sync.py [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_cli.deploy.sync import Releases, scan, sync  # noqa: E402
from ddtree_cli.patching.fetch import download_wheel, extract_wheel  # noqa: E402
from ddtree_cli.remote.ssh import connect  # noqa: E402
from tests.testhosts import start_host  # noqa: E402

VERSION = "0.5.23"
WHEEL = f"sglang=={VERSION}"


class CountingProxy:
    """Forwards TCP to sshd and counts the bytes in both directions."""

    def __init__(self, port: int):
        self.target = port
        self.bytes = 0
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            client, _ = self.server.accept()
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 18):
                with self.lock:
                    self.bytes += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def take(self) -> int:
        time.sleep(0.2)  # let the pumps finish counting the last packets
        with self.lock:
            n, self.bytes = self.bytes, 0
        return n


def snapshot(workdir: Path) -> Path:
    """The extracted sglang 0.5.23 wheel (downloaded once into the shared wheel cache)."""
    return extract_wheel(download_wheel(VERSION), workdir / f"sglang-{VERSION}")


def timed_ddtree(host, port: int, known: Path, key: Path, source: Path, base: str) -> dict:
    t0 = time.perf_counter()
    with connect(f"root@127.0.0.1:{port}", identity=key, known_hosts=known) as conn:
        manifest = scan(source)
        releases = Releases(conn, base)
        result = sync(conn, releases, source, manifest)
        releases.switch(result.release, 5)
    return {
        "seconds": time.perf_counter() - t0,
        "files": result.uploaded_files,
        "payload_bytes": result.uploaded_bytes,
    }


def timed_rsync(port: int, key: Path, source: Path, dest: str) -> dict:
    ssh = (
        f"ssh -p {port} -i {key} -o StrictHostKeyChecking=no "
        "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
    )
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["rsync", "-a", "--stats", "-e", ssh, f"{source}/", f"root@127.0.0.1:{dest}/"],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = time.perf_counter() - t0
    files = next(
        (
            int(line.split(":")[1].split()[0].replace(",", ""))
            for line in proc.stdout.splitlines()
            if line.startswith("Number of regular files transferred")
        ),
        -1,
    )
    return {"seconds": seconds, "files": files}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ddtree-syncbench-"))
    source = snapshot(work)
    files = sum(1 for p in source.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    host = start_host(work / "host")
    try:
        proxy = CountingProxy(host.ssh_port)
        known = work / "known_hosts"
        known.write_text(host.known_hosts_line.replace(f"]:{host.ssh_port} ", f"]:{proxy.port} "))
        direct = work / "known_direct"
        direct.write_text(host.known_hosts_line)
        # Bytes: one pass through the counting forwarder (it costs time, so it is not timed).
        wire: dict[str, int] = {}
        host.ssh(["sh", "-c", "rm -rf /opt/bench && mkdir -p /opt/bench"])
        for kind in ("first", "nochange"):
            proxy.take()
            timed_rsync(proxy.port, host.client_key, source, "/opt/bench/rsync")
            wire[f"rsync_{kind}"] = proxy.take()
            timed_ddtree(host, proxy.port, known, host.client_key, source, "/opt/bench/ddtree")
            wire[f"ddtree_{kind}"] = proxy.take()
        # Time: direct connections, the two tools alternating which goes first.
        runs: dict[str, list[dict]] = {k: [] for k in wire}
        for rep in range(args.repeats):
            host.ssh(["sh", "-c", "rm -rf /opt/bench && mkdir -p /opt/bench && sync"])
            order = ("rsync", "ddtree") if rep % 2 == 0 else ("ddtree", "rsync")
            for kind in ("first", "nochange"):
                for tool in order:
                    if tool == "rsync":
                        run = timed_rsync(
                            host.ssh_port, host.client_key, source, "/opt/bench/rsync"
                        )
                    else:
                        run = timed_ddtree(
                            host,
                            host.ssh_port,
                            direct,
                            host.client_key,
                            source,
                            "/opt/bench/ddtree",
                        )
                    run["wire_bytes"] = wire[f"{tool}_{kind}"]
                    runs[f"{tool}_{kind}"].append(run)
        summary = {}
        for name, values in runs.items():
            summary[name] = {
                "seconds_median": round(statistics.median(r["seconds"] for r in values), 3),
                "seconds_all": [round(r["seconds"], 3) for r in values],
                "wire_bytes_median": int(statistics.median(r["wire_bytes"] for r in values)),
                "files_sent": values[-1]["files"],
            }
        first_bytes = summary["ddtree_first"]["wire_bytes_median"]
        result = {
            "snapshot": {"name": WHEEL, "files": files, "bytes": size},
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(),
                "python": platform.python_version(),
            },
            "repeats": args.repeats,
            "runs": summary,
            "first_deploy_ratio_vs_rsync": round(
                summary["ddtree_first"]["seconds_median"]
                / summary["rsync_first"]["seconds_median"],
                2,
            ),
            "nochange_bytes_fraction": round(
                summary["ddtree_nochange"]["wire_bytes_median"] / first_bytes, 5
            ),
        }
    finally:
        host.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"snapshot: {WHEEL}, {files} files, {size / 1e6:.1f} MB; {args.repeats} repeats (median)")
    print(f"{'run':<18}{'seconds':>10}{'wire MB':>10}{'files sent':>12}")
    for name, row in summary.items():
        print(
            f"{name:<18}{row['seconds_median']:>10.2f}{row['wire_bytes_median'] / 1e6:>10.2f}"
            f"{row['files_sent']:>12}"
        )
    print(
        f"first deploy / rsync: {result['first_deploy_ratio_vs_rsync']:.2f}x; no-change "
        f"re-deploy bytes: {result['nochange_bytes_fraction'] * 100:.2f}% of a first deploy"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
