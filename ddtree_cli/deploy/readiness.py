"""Is the new service ready? ``/health`` until 200, then a canary ``/generate``, asked from the
host itself through SSH (a server bound to the host's loopback needs no open port)."""

from __future__ import annotations

import http.client
import json
import time

from ddtree_cli.deploy.config import DeployConfig
from ddtree_cli.deploy.systemd import unit_state
from ddtree_cli.deploy.units import service_port
from ddtree_cli.errors import RemoteError
from ddtree_cli.remote.hostspec import HostSpec
from ddtree_cli.remote.ssh import Connection


class NotReady(Exception):
    """The service did not become ready; the message says why (one line)."""


def http_request(
    conn: Connection,
    host: str,
    port: int,
    method: str,
    path: str,
    body: dict | None = None,
    timeout: float = 60,
) -> tuple[int, str]:
    """An HTTP request made from the host itself (through an SSH direct-tcpip channel), so a
    server bound to the host's loopback is reachable without opening a port."""
    target = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    channel = conn.open_tunnel(target, port, timeout=timeout)
    channel.settimeout(timeout)
    try:
        client = http.client.HTTPConnection(target, port, timeout=timeout)
        client.sock = channel  # paramiko channels offer sendall/makefile like a socket
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload else {}
        client.request(method, path, body=payload, headers=headers)
        response = client.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        channel.close()


def wait_ready(
    conn: Connection,
    cfg: DeployConfig,
    host: HostSpec,
    unit: str,
    *,
    timeout: float | None = None,
    note=lambda _msg: None,
) -> dict:
    """Poll /health until 200 (503 means still starting), then run the canary /generate.

    Fails fast when the unit dies or restarts instead of waiting out the timeout.
    Returns the canary's ``meta_info``.
    """
    port = service_port(cfg, host)
    deadline = time.monotonic() + (timeout or cfg.ready_timeout_s)
    last = "no answer yet"
    delay = 0.25
    while True:
        state = unit_state(conn, unit)
        if (
            state.get("ActiveState") == "failed"
            or state.get("SubState") == "auto-restart"
            or int(state.get("NRestarts", "0") or 0) > 0
        ):
            raise NotReady(
                f"{unit} exited (state {state.get('ActiveState')}/"
                f"{state.get('SubState')}, exit status {state.get('ExecMainStatus')})"
            )
        if state.get("ActiveState") not in ("active", "activating", "reloading", "deactivating"):
            raise NotReady(f"{unit} is {state.get('ActiveState')}")
        try:
            status, _ = http_request(conn, cfg.service_host, port, "GET", "/health", timeout=30)
            if status == 200:
                break
            last = f"/health answered {status}"
            note(f"starting ({last})")
        except (ConnectionRefusedError, OSError, http.client.HTTPException) as exc:
            last = f"port {port} not answering ({type(exc).__name__})"
        except RemoteError:
            raise
        if time.monotonic() > deadline:
            raise NotReady(f"not ready after {timeout or cfg.ready_timeout_s:.0f} s: {last}")
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)
    return canary(conn, cfg, host)


def canary(conn: Connection, cfg: DeployConfig, host: HostSpec) -> dict:
    body = {
        "text": cfg.canary_prompt,
        "sampling_params": {
            "max_new_tokens": cfg.canary_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    }
    try:
        status, text = http_request(
            conn,
            cfg.service_host,
            service_port(cfg, host),
            "POST",
            "/generate",
            body,
            timeout=max(60.0, cfg.ready_timeout_s),
        )
    except (OSError, http.client.HTTPException) as exc:
        raise NotReady(f"canary /generate failed: {exc}") from exc
    if status != 200:
        raise NotReady(f"canary /generate answered {status}: {text[:200]}")
    try:
        answer = json.loads(text)
        meta = answer["meta_info"]
    except (ValueError, KeyError, TypeError) as exc:
        raise NotReady(
            f"canary /generate answered something that is not SGLang's format: {text[:200]}"
        ) from exc
    tokens = meta.get("completion_tokens", 0)
    if tokens < min(16, cfg.canary_tokens):
        raise NotReady(f"canary generated {tokens} tokens, expected {cfg.canary_tokens}")
    if cfg.speculative and not meta.get("spec_verify_ct"):
        raise NotReady(
            "canary ran without speculative decoding (meta_info.spec_verify_ct is "
            f"{meta.get('spec_verify_ct')!r})"
        )
    return meta
