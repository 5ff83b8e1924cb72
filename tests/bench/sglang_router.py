"""SGLang's real router (the Rust router of the ``sglang-router`` wheel) on 127.0.0.1.

The wheel is fetched once with ``pip download --no-deps sglang-router==0.3.2`` into the
wheel cache (``DDTREE_WHEEL_CACHE``, default ``~/.cache/ddtree/wheels``, as for the SGLang
wheels) and installed, with its Python dependencies from the package index (setproctitle,
aiohttp, orjson, uvicorn, fastapi: its METADATA), into a venv cached like the SGLang CPU
venvs (``DDTREE_VENV_CACHE``). ``launch_router`` is what ``ddtree deploy``'s router unit runs.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ddtree_cli.patching.fetch import wheel_cache_dir
from tests.patch.sglang_venv import build_venv, venv_cache_dir
from tests.testhosts import free_port

VERSION = "0.3.2"


def router_wheel() -> Path:
    """The cached ``sglang_router-0.3.2-*.whl``, downloaded first if absent."""
    cache = wheel_cache_dir()
    found = sorted(cache.glob(f"sglang_router-{VERSION}-*.whl"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "--quiet", "--dest", str(cache),
         f"sglang-router=={VERSION}"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    found = sorted(cache.glob(f"sglang_router-{VERSION}-*.whl"))
    if not found:
        raise RuntimeError(f"pip reported success but no sglang-router {VERSION} wheel in {cache}")
    return found[-1]


def router_python() -> Path:
    """The python of a venv with the router installed from the cached wheel."""
    wheel = router_wheel()
    key = hashlib.sha256(wheel.name.encode()).hexdigest()[:12]
    target = venv_cache_dir() / f"sglang-router-{VERSION}-{key}"
    return build_venv(target, [str(wheel)], f"the sglang-router {VERSION} venv")


@dataclass
class Router:
    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_router(python: Path, workers: list[str], log: Path, timeout: float = 60) -> Router:
    """``launch_router`` over ``workers``; returns once ``GET /workers`` lists them all healthy."""
    port = free_port()
    cmd = [
        str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
        "--port", str(port), "--worker-urls", *workers, "--policy", "round_robin",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    router = Router(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the router exited with {proc.returncode}: {log.read_text()[-500:]}"
            )
        try:
            with urllib.request.urlopen(f"{router.url}/workers", timeout=2) as resp:
                listed = json.loads(resp.read())["workers"]
            if len(listed) == len(workers) and all(w["is_healthy"] for w in listed):
                return router
        except OSError:
            pass
        time.sleep(0.2)
    router.stop()
    raise RuntimeError(f"the router did not list its {len(workers)} workers in {timeout:g} s")
