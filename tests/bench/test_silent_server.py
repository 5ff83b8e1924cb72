"""`ddtree bench --url` against real sockets on 127.0.0.1 that do not behave like servers."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

pytestmark = [pytest.mark.http]


class SilentServer:
    """Accepts every connection and never sends a byte (a server stuck before its first
    answer)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent():
    server = SilentServer()
    yield server
    server.close()


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddtree_cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_server_that_never_answers_is_named_with_the_option_to_wait_longer(silent, tmp_path):
    res = bench(
        "--url",
        f"ddtree={silent.url}",
        "--algo",
        "ddtree",
        "--baseline",
        "none",
        "--server-timeout",
        "3",
        "--output",
        str(tmp_path / "run"),
    )
    assert res.returncode != 0
    assert silent.accepted, "the bench never connected"
    assert f"arm 'ddtree' at {silent.url} is not healthy after" in res.stderr
    assert "accepted the connection but sent no answer to GET /health within" in res.stderr
    assert "--server-timeout (now 3 s)" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()


def test_a_refused_connection_is_still_a_wrong_url(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # closed again below: nothing listens there
    res = bench(
        "--url",
        f"ddtree=http://127.0.0.1:{port}",
        "--algo",
        "ddtree",
        "--baseline",
        "none",
        "--server-timeout",
        "60",
        "--output",
        str(tmp_path / "r"),
    )
    assert res.returncode != 0
    assert "is not reachable after" in res.stderr
    assert "check the URL" in res.stderr
