"""Embedded targets: one ``ddtree serve`` process per arm on a free loopback port.

The server binds port 0 and prints its URL as JSON when ready (``--json``), so there is no
race for a port between picking it and binding it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddtree_cli.errors import DdtreeError

EMBEDDED_ALGOS = ("ddtree", "dflash", "ar")


@dataclass
class ServeProcess:
    arm: str
    algo: str
    log_dir: Path
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    url: str | None = None

    @property
    def stdout_path(self) -> Path:
        return self.log_dir / f"server-{self.arm}.json"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"server-{self.arm}.log"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "ddtree_cli",
            "serve",
            "--algo",
            self.algo,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--json",
            *self.extra_args,
        ]

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.stdout_path, "wb") as out, open(self.log_path, "wb") as err:
            self.proc = subprocess.Popen(
                self.command(), stdout=out, stderr=err, stdin=subprocess.DEVNULL
            )

    def poll_ready(self) -> bool:
        """True once the server printed its URL; raises if it exited first."""
        if self.url is not None:
            return True
        died = self.exit_reason()
        if died:
            raise DdtreeError(f"ddtree serve for arm '{self.arm}' {died}", hint=self.log_hint())
        try:
            info = json.loads(self.stdout_path.read_text())
        except (OSError, ValueError):
            return False
        self.url = str(info["url"])
        return True

    def exit_reason(self, grace_s: float = 0.0) -> str | None:
        """None while running (after waiting up to ``grace_s``), else how it ended."""
        if self.proc is None:
            return "was never started"
        try:
            code = self.proc.wait(timeout=grace_s) if grace_s > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return None
        if code < 0:
            return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def log_hint(self) -> str:
        tail = self.log_tail()
        return f"its log ends with: {tail}" if tail else f"see {self.log_path}"

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(grace)


def wait_all_ready(servers: list[ServeProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(s.poll_ready() for s in servers):
        if time.monotonic() > deadline:
            slow = [s.arm for s in servers if s.url is None]
            raise DdtreeError(
                f"ddtree serve for arm(s) {', '.join(slow)} not ready after {timeout:g} s",
                hint="raise --server-timeout, or look at the server log",
            )
        time.sleep(0.1)
