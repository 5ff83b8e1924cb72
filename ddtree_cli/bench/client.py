"""A lean asyncio HTTP/1.1 client for SGLang's streaming ``/generate`` (SSE) and JSON GETs.

Why not aiohttp: the benchmark client must not be what limits or colours a measurement.
The hot path here is one ``data_received`` per TCP read: de-chunk, split SSE events, and
per event find ``"completion_tokens":`` with ``bytes.rfind`` — no JSON parse of the
(cumulative, growing) chunk. Only the last event of a response is parsed in full, for
``meta_info`` and the output token ids. Connections are kept alive and reused.

SGLang's stream (``srt/entrypoints/http_server.py``): ``data: {json}\\n\\n`` per output,
``data: [DONE]\\n\\n`` at the end, errors as ``data: {"error": {...}}``. Each chunk's
``meta_info.completion_tokens`` is cumulative; ``text``/``output_ids`` are cumulative
unless the server runs with ``--incremental-streaming-output`` (then they are deltas).
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

_CT_KEY = b'"completion_tokens":'
_CT_RE = re.compile(rb'"completion_tokens":\s*(\d+)')
_HEAD_END = b"\r\n\r\n"


class HttpError(Exception):
    """A transport or protocol failure talking to a server (connection refused, reset…)."""


@dataclass
class StreamResult:
    """What one streamed /generate request produced, as seen by the client."""

    ok: bool = False
    error: str | None = None
    status: int = 0
    start: float = 0.0  # perf_counter when the request was written
    end: float = 0.0  # perf_counter when the response ended (or failed)
    # One entry per streamed chunk that carried new tokens: arrival time (perf_counter)
    # and the cumulative completion_tokens after it.
    chunk_times: list[float] = field(default_factory=list)
    chunk_counts: list[int] = field(default_factory=list)
    final: dict[str, Any] | None = None  # the last event's JSON object
    output_ids: list[int] | None = None


class _Sink:
    """Per-request consumer of SSE payloads (the hot path)."""

    __slots__ = ("result", "last", "last_ct", "incremental", "ids", "error")

    def __init__(self, result: StreamResult, incremental: bool):
        self.result = result
        self.last: bytes | None = None
        self.last_ct = 0
        self.incremental = incremental
        self.ids: list[int] = []
        self.error: str | None = None

    def payload(self, data: bytes, now: float) -> None:
        if data == b"[DONE]":
            return
        i = data.rfind(_CT_KEY)
        if i >= 0:
            m = _CT_RE.match(data, i)
            ct = int(m.group(1)) if m else self.last_ct
            if ct != self.last_ct:
                r = self.result
                r.chunk_times.append(now)
                r.chunk_counts.append(ct)
                self.last_ct = ct
            if self.incremental:
                self.ids.extend(json.loads(data).get("output_ids") or ())
            self.last = data
        elif data.startswith(b'{"error"'):
            self.error = _error_message(data)
        else:
            self.last = data


def _error_message(data: bytes) -> str:
    try:
        err = json.loads(data).get("error")
    except ValueError:
        return data[:200].decode("utf-8", "replace")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


class _Conn(asyncio.Protocol):
    """One keep-alive connection; parses exactly one response at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False  # has served a request before (a keep-alive reuse)
        self.got_bytes = False
        self._waiter: asyncio.Future | None = None
        self._reset(None)

    def _reset(self, sink: _Sink | None) -> None:
        self._sink = sink
        self._head = b""
        self._in_body = False
        self._status = 0
        self._chunked = False
        self._length = -1  # -1: read until the connection closes
        self._keep_alive = True
        self._chunk_left = 0  # payload bytes left in the current chunk
        self._skip = 0  # CRLF bytes to skip after a chunk's payload
        self._raw = b""  # undecoded chunked framing carried over between reads
        self._sse = b""  # decoded body bytes not yet split into events
        self._body = bytearray()  # non-SSE bodies (errors, JSON GETs)
        self._sse_mode = False

    # asyncio.Protocol -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        w = self._waiter
        if w is not None and not w.done():
            if self._in_body and self._length == -1 and not self._chunked:
                self._flush_sse(final=True)
                w.set_result(True)
            else:
                reason = f": {exc}" if exc else ""
                w.set_exception(HttpError(f"connection closed by the server{reason}"))

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.got_bytes = True
        if not self._in_body:
            self._head += data
            end = self._head.find(_HEAD_END)
            if end < 0:
                return
            data = self._head[end + 4 :]
            self._parse_head(self._head[:end])
            self._head = b""
            self._in_body = True
        if self._chunked:
            self._dechunk(data, now)
        else:
            self._body_bytes(data, now)
            if self._length >= 0 and self._length <= 0:
                self._finish()

    # parsing ----------------------------------------------------------------------
    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        self._status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            value = value.strip()
            if name == b"content-length":
                self._length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = True
            elif name == b"connection" and value.lower() == b"close":
                self._keep_alive = False
            elif name == b"content-type" and value.lower().startswith(b"text/event-stream"):
                self._sse_mode = True
        if self._chunked:
            self._length = -1
        if self._length == -1 and not self._chunked:
            self._keep_alive = False
        self._sse_mode = self._sse_mode and self._status == 200 and self._sink is not None

    def _body_bytes(self, data: bytes, now: float) -> None:
        if self._length >= 0:
            self._length -= len(data)
        self._take([data], now, final=self._length == 0)

    def _dechunk(self, data: bytes, now: float) -> None:
        buf = self._raw + data if self._raw else data
        pos = 0
        end = len(buf)
        pieces = []  # joined once per read: appending to bytes per chunk is quadratic
        while pos < end:
            if self._skip:
                take = min(self._skip, end - pos)
                self._skip -= take
                pos += take
                continue
            if self._chunk_left:
                take = min(self._chunk_left, end - pos)
                pieces.append(buf[pos : pos + take])
                self._chunk_left -= take
                pos += take
                if not self._chunk_left:
                    self._skip = 2
                continue
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                break
            try:
                size = int(buf[pos:nl], 16)
            except ValueError:  # chunk extensions ("size;name=value"), never sent by SGLang
                size = int(buf[pos:nl].split(b";", 1)[0], 16)
            pos = nl + 2
            if size == 0:
                # Last chunk; trailers are not used by SGLang and are ignored.
                self._raw = b""
                self._take(pieces, now, final=True)
                self._finish()
                return
            stop = pos + size
            # Fast path, SGLang's usual shape: one whole chunk holding exactly one
            # `data: ...\n\n` event, nothing pending: hand the payload over with one copy.
            if (
                stop + 2 <= end
                and not pieces
                and not self._sse
                and self._sse_mode
                and buf.startswith(b"data: ", pos)
                and buf.find(b"\n", pos, stop) == stop - 2
                and buf[stop - 1] == 10
            ):
                self._sink.payload(buf[pos + 6 : stop - 2], now)  # type: ignore[union-attr]
                pos = stop + 2
                continue
            self._chunk_left = size
        self._raw = buf[pos:] if pos < end else b""
        if pieces:
            self._take(pieces, now, final=False)

    def _take(self, pieces: list[bytes], now: float, final: bool) -> None:
        if self._sse_mode:
            self._sse = b"".join([self._sse, *pieces]) if self._sse else b"".join(pieces)
            self._flush_sse(now, final)
        else:
            self._body += b"".join(pieces)

    def _flush_sse(self, now: float | None = None, final: bool = False) -> None:
        sse = self._sse
        if not sse:
            return
        if b"\r" in sse:
            sse = sse.replace(b"\r\n", b"\n")
        if now is None:
            now = time.perf_counter()
        events = sse.split(b"\n\n")
        rest = events.pop()
        sink = self._sink
        payload = sink.payload  # type: ignore[union-attr]
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:
                payload(event[6:], now)
            else:
                _event(event, sink, now)
        if final and rest.strip():
            _event(rest.strip(), sink, now)
            rest = b""
        self._sse = rest

    def _finish(self) -> None:
        w = self._waiter
        self._in_body = False
        if not self._keep_alive and self.transport is not None:
            self.transport.close()
            self.closed = True
        if w is not None and not w.done():
            w.set_result(True)

    # request/response -------------------------------------------------------------
    async def exchange(self, request: bytes, sink: _Sink | None) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        self._reset(sink)
        self.got_bytes = False
        self._waiter = loop.create_future()
        assert self.transport is not None
        self.transport.write(request)
        await self._waiter
        return self._status, bytes(self._body)


def _event(event: bytes, sink: _Sink | None, now: float) -> None:
    if event.startswith(b"data:") and b"\n" not in event:
        sink.payload(event[5:].lstrip(), now)  # type: ignore[union-attr]
        return
    if not event:
        return
    data_lines = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
    if data_lines:
        sink.payload(b"\n".join(data_lines), now)  # type: ignore[union-attr]


class Endpoint:
    """One server base URL with a pool of keep-alive connections."""

    def __init__(self, url: str):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url}")
        self.url = url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.base = parts.path.rstrip("/")
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._host_header = f"{self.host}:{self.port}".encode()
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                _Conn,
                self.host,
                self.port,
                ssl=self._ssl,
                server_hostname=self.host if self._ssl else None,
            )
        except OSError as exc:
            raise HttpError(f"cannot connect to {self.url}: {exc.strerror or exc}") from exc
        return conn

    async def _acquire(self) -> _Conn:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return await self._connect()

    def _release(self, conn: _Conn) -> None:
        conn.used = True
        if not conn.closed:
            self._idle.append(conn)

    def close(self) -> None:
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()

    def _request(self, method: str, path: str, body: bytes | None, accept: bytes) -> bytes:
        head = (
            f"{method} {self.base}{path} HTTP/1.1\r\n".encode()
            + b"Host: "
            + self._host_header
            + b"\r\nAccept: "
            + accept
            + b"\r\n"
        )
        if body is None:
            return head + b"\r\n"
        return (
            head
            + b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )

    async def get_json(self, path: str, timeout: float = 10.0) -> tuple[int, Any]:
        """GET ``path``; returns (status, parsed JSON or the text body)."""
        status, body = await self._roundtrip(self._request("GET", path, None, b"*/*"), timeout)
        try:
            return status, json.loads(body) if body else None
        except ValueError:
            return status, body.decode("utf-8", "replace")

    async def _roundtrip(self, request: bytes, timeout: float) -> tuple[int, bytes]:
        conn = await self._acquire()
        try:
            result = await asyncio.wait_for(conn.exchange(request, None), timeout)
        except BaseException:
            if conn.transport is not None:
                conn.transport.abort()
            raise
        self._release(conn)
        return result

    async def stream_generate(
        self, body: dict[str, Any], *, timeout: float, incremental: bool = False
    ) -> StreamResult:
        """POST /generate with ``stream: true``; never raises for server or network errors."""
        result = StreamResult()
        request = self._request(
            "POST",
            "/generate",
            json.dumps({**body, "stream": True}).encode(),
            b"text/event-stream",
        )
        sink = _Sink(result, incremental)
        result.start = time.perf_counter()
        conn: _Conn | None = None
        try:
            conn = await self._acquire()
            result.start = time.perf_counter()
            try:
                status, raw = await asyncio.wait_for(conn.exchange(request, sink), timeout)
            except HttpError:
                if not conn.used or conn.got_bytes:
                    raise
                # The server closed an idle keep-alive connection just as we reused it:
                # nothing was answered, so sending again on a new connection is safe.
                conn = await self._connect()
                result.start = time.perf_counter()
                status, raw = await asyncio.wait_for(conn.exchange(request, sink), timeout)
        except asyncio.TimeoutError:
            result.error = f"timeout after {timeout:g} s"
        except HttpError as exc:
            result.error = str(exc)
        except OSError as exc:
            result.error = f"network error: {exc}"
        else:
            result.status = status
            if status != 200:
                result.error = f"HTTP {status}: {raw[:200].decode('utf-8', 'replace').strip()}"
            elif sink.error is not None:
                result.error = f"server error: {sink.error}"
            elif sink.last is None:
                result.error = "the stream ended without any output"
            else:
                _complete(result, sink)
        result.end = time.perf_counter()
        if conn is not None:
            if result.error is None:
                self._release(conn)
            elif conn.transport is not None:
                conn.transport.abort()
        return result


def _complete(result: StreamResult, sink: _Sink) -> None:
    try:
        final = json.loads(sink.last)  # type: ignore[arg-type]
    except ValueError:
        result.error = "the last stream event is not JSON"
        return
    if not isinstance(final, dict):
        result.error = "the last stream event is not a JSON object"
        return
    result.final = final
    ids = sink.ids if sink.incremental else final.get("output_ids")
    result.output_ids = list(ids) if isinstance(ids, list) else None
    result.ok = True
