"""A minimal stdlib HTTP client for the engine tests (real sockets on 127.0.0.1)."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit


def request(url: str, method: str, path: str, body=None, raw: bytes | None = None, timeout=60):
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"} if data is not None else {}
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    ctype = resp.getheader("Content-Type", "")
    parsed = json.loads(payload) if "json" in ctype and payload else payload.decode()
    return resp.status, parsed


def get(url, path):
    return request(url, "GET", path)


def post(url, path, body=None, raw=None):
    return request(url, "POST", path, body, raw)


def stream(url: str, path: str, body: dict) -> tuple[list, list[str]]:
    """POST with stream=true; returns the decoded events and the raw SSE lines."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request(
        "POST",
        path,
        body=json.dumps({**body, "stream": True}),
        headers={"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type") == "text/event-stream"
    text = resp.read().decode()
    conn.close()
    lines = text.split("\n")
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events, lines
