"""A minimal server that streams SGLang-format ``/generate`` SSE as fast as it is asked to.

It runs no model. It exists to measure benchmark *clients* (their CPU per streamed token)
and to test the client's protocol handling, against the exact wire format of SGLang 0.5.23
(``srt/entrypoints/http_server.py`` and ``srt/managers/tokenizer_manager.py``): chunked
``text/event-stream``, ``data: {json}\\n\\n`` per output with cumulative ``text`` and
``output_ids`` and a cumulative ``meta_info.completion_tokens``, the speculative fields
(``spec_verify_ct``, ``spec_accept_length``) only on the finished chunk, then
``data: [DONE]\\n\\n``. It is a stand-in for a server that cannot run here, never the thing
under test: ``ddtree bench`` itself is tested against the embedded engine.

Run it on its own: ``python -m ddtree_cli.bench.emitter --port 0 --tokens-per-chunk 1``
(prints the port it bound to).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from dataclasses import dataclass

_WORDS = [f" w{i}" for i in range(1000)]


@dataclass(frozen=True)
class EmitterConfig:
    tokens_per_chunk: int = 1  # >1 mimics speculative decoding's multi-token chunks
    chunk_interval: float = 0.0  # seconds between chunks; 0 yields to the loop only
    default_max_new_tokens: int = 128
    algorithm: str | None = "DFLASH"
    model_path: str = "emitter/no-model"
    seed: int = 0  # changes the emitted tokens: a "different model"


class Emitter:
    def __init__(self, config: EmitterConfig):
        self.config = config
        self._frames: dict[tuple[str, int], list[bytes]] = {}
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    # The response for a prompt is a pure function of (seed, prompt, max_new_tokens), so
    # frames are built once and replayed: the emitter's own cost stays far below a
    # client's, and equal prompts get equal outputs, as at temperature 0.
    def frames(self, prompt_key: str, max_new: int, prompt_tokens: int) -> list[bytes]:
        key = (prompt_key, max_new)
        cached = self._frames.get(key)
        if cached is not None:
            return cached
        digest = hashlib.sha256(f"{self.config.seed}:{prompt_key}".encode()).digest()
        ids = [(digest[i % 32] * 31 + i * 7) % 1000 for i in range(max_new)]
        step = max(1, self.config.tokens_per_chunk)
        frames = []
        for verify, stop in enumerate(range(step, max_new + step, step), 1):
            end = min(stop, max_new)
            done = end == max_new
            meta = {
                "id": "emitter",
                "finish_reason": {"type": "length", "length": max_new} if done else None,
                "prompt_tokens": prompt_tokens,
                "weight_version": "default",
                "total_retractions": 0,
                "completion_tokens": end,
                "cached_tokens": 0,
            }
            if done:
                meta["e2e_latency"] = 0.0
                if self.config.algorithm:
                    meta["spec_verify_ct"] = verify
                    meta["spec_accept_length"] = end / verify
            out = {
                "text": "".join(_WORDS[t] for t in ids[:end]),
                "output_ids": ids[:end],
                "meta_info": meta,
            }
            frames.append(_chunk(b"data: " + json.dumps(out).encode() + b"\n\n"))
        frames.append(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        self._frames[key] = frames
        return frames

    def server_info(self) -> dict:
        return {
            "model_path": self.config.model_path,
            "speculative_algorithm": self.config.algorithm,
            "random_seed": self.config.seed,
            "version": "emitter",
            "internal_states": [{"avg_spec_accept_length": float(self.config.tokens_per_chunk)}],
        }

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, path = lines[0].split(b" ")[:2]
                length = 0
                for line in lines[1:]:
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                await self._route(method, path, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _route(self, method: bytes, path: bytes, body: bytes, writer) -> None:
        if path in (b"/health", b"/health_generate"):
            _json(writer, 200, {})
        elif path in (b"/server_info", b"/get_server_info"):
            _json(writer, 200, self.server_info())
        elif path == b"/v1/models":
            _json(writer, 200, {"object": "list", "data": [{"id": self.config.model_path}]})
        elif path == b"/generate" and method == b"POST":
            await self._generate(body, writer)
        else:
            _json(writer, 404, {"detail": "Not Found"})
        await writer.drain()

    async def _generate(self, body: bytes, writer: asyncio.StreamWriter) -> None:
        try:
            req = json.loads(body)
            params = req.get("sampling_params") or {}
            max_new = int(params.get("max_new_tokens", self.config.default_max_new_tokens))
            prompt = req.get("text") if "text" in req else req.get("input_ids")
            prompt_key = json.dumps(prompt)
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        except (ValueError, TypeError, AttributeError) as exc:
            _json(writer, 400, {"error": {"message": f"bad request: {exc}"}})
            return
        if max_new < 1:
            _json(writer, 400, {"error": {"message": "max_new_tokens must be >= 1"}})
            return
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self._stream(self.frames(prompt_key, max_new, prompt_tokens), writer)
        finally:
            self.in_flight -= 1

    async def _stream(self, frames: list[bytes], writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        interval = self.config.chunk_interval
        for frame in frames:
            writer.write(frame)
            if interval > 0:
                await asyncio.sleep(interval)
            else:
                await writer.drain()
                await asyncio.sleep(0)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._server = await asyncio.start_server(self.handle, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _json(writer: asyncio.StreamWriter, status: int, obj: object) -> None:
    body = json.dumps(obj).encode()
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}.get(status, b"")
    writer.write(
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        % (status, reason, len(body))
        + body
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--chunk-interval", type=float, default=0.0)
    ap.add_argument("--algorithm", default="DFLASH")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    config = EmitterConfig(
        tokens_per_chunk=args.tokens_per_chunk,
        chunk_interval=args.chunk_interval,
        algorithm=args.algorithm or None,
        seed=args.seed,
    )

    async def serve() -> None:
        emitter = Emitter(config)
        port = await emitter.start(args.host, args.port)
        print(port, flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
