"""The SSE client against SGLang's wire format (served by the protocol-faithful emitter,
a stand-in for an SGLang server, which cannot run here) and against hand-made byte streams."""

from __future__ import annotations

import asyncio
import json
import socket

from ddtree_cli.bench.client import Endpoint, StreamResult, _Conn, _Sink
from ddtree_cli.bench.emitter import Emitter, EmitterConfig
from ddtree_cli.bench.metrics import request_record


def _run(coro):
    return asyncio.run(coro)


async def _with_emitter(config: EmitterConfig, fn):
    emitter = Emitter(config)
    port = await emitter.start()
    try:
        return await fn(Endpoint(f"http://127.0.0.1:{port}"), emitter)
    finally:
        await emitter.stop()


def test_stream_counts_tokens_per_chunk_and_reads_the_final_meta_info():
    async def go(ep, emitter):
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 10}}
        return await ep.stream_generate(body, timeout=5), emitter

    res, emitter = _run(_with_emitter(EmitterConfig(tokens_per_chunk=3), go))
    assert res.ok and res.error is None
    assert res.chunk_counts == [3, 6, 9, 10]
    ids = emitter.frames(json.dumps("hello"), 10, 1)
    assert len(ids) == 5  # four data chunks and [DONE]
    assert res.final["meta_info"]["spec_verify_ct"] == 4
    assert len(res.output_ids) == 10
    rec = request_record(
        res, arm="a", concurrency=1, trial=1, prompt_id="p", index=0, pass_start=res.start
    )
    assert rec["chunk_tokens"] == [3, 3, 3, 1]
    assert rec["accept_length"] == 2.5
    assert len(rec["itl_ms"]) == 3


def test_keep_alive_connection_is_reused():
    async def go(ep, emitter):
        body = {"text": "x", "sampling_params": {"max_new_tokens": 4}}
        for _ in range(5):
            assert (await ep.stream_generate(body, timeout=5)).ok
        return len(ep._idle)

    assert _run(_with_emitter(EmitterConfig(), go)) == 1


def test_http_error_and_refused_connection_are_results_not_exceptions():
    async def go(ep, emitter):
        return await ep.stream_generate(
            {"text": "x", "sampling_params": {"max_new_tokens": 0}}, timeout=5
        )

    res = _run(_with_emitter(EmitterConfig(), go))
    assert not res.ok and res.error.startswith("HTTP 400")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = _run(Endpoint(f"http://127.0.0.1:{port}").stream_generate({"text": "x"}, timeout=5))
    assert not res.ok and "cannot connect" in res.error


class _Transport:
    def close(self):
        pass

    def write(self, data):
        pass


def _sse_response(events: list[bytes], crlf: bool = False, per_event: bool = False) -> bytes:
    sep = b"\r\n\r\n" if crlf else b"\n\n"
    body = b"".join(e + sep for e in events)
    # One chunk per event (as SGLang sends), or odd sizes so that frames and events
    # straddle chunk boundaries.
    pieces = (
        [e + sep for e in events]
        if per_event
        else [body[i : i + 7] for i in range(0, len(body), 7)]
    )
    chunks = b""
    for piece in pieces:
        chunks += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    )


def _feed_bytewise(
    raw: bytes, incremental: bool = False, step: int = 1
) -> tuple[StreamResult, _Sink]:
    async def go():
        conn = _Conn()
        conn.connection_made(_Transport())
        result = StreamResult()
        sink = _Sink(result, incremental)
        task = asyncio.ensure_future(conn.exchange(b"", sink))
        await asyncio.sleep(0)
        for i in range(0, len(raw), step):
            conn.data_received(raw[i : i + step])
        await task
        return result, sink

    return asyncio.run(go())


def _event(ids, ct, **meta):
    return (
        b"data: "
        + json.dumps(
            {"text": "t" * ct, "output_ids": ids, "meta_info": {"completion_tokens": ct, **meta}}
        ).encode()
    )


def test_parser_survives_one_byte_reads_and_crlf_events():
    events = [
        _event([1], 1),
        _event([1, 2, 3], 3),
        _event([1, 2, 3, 4], 4, spec_verify_ct=2),
        b"data: [DONE]",
    ]
    for crlf in (False, True):
        result, sink = _feed_bytewise(_sse_response(events, crlf))
        assert result.chunk_counts == [1, 3, 4]
        assert json.loads(sink.last)["output_ids"] == [1, 2, 3, 4]


def test_whole_responses_in_one_read_take_the_one_event_per_chunk_path():
    events = [
        _event([1], 1),
        _event([1, 2, 3], 3),
        b"data: a\ndata: b",
        _event([1, 2], 4),
        b"data: [DONE]",
    ]
    raw = _sse_response(events, per_event=True)
    for step in (len(raw), 50):
        result, sink = _feed_bytewise(raw, step=step)
        assert result.chunk_counts == [1, 3, 4]
        assert json.loads(sink.last)["output_ids"] == [1, 2]


def test_completion_tokens_inside_generated_text_is_not_mistaken_for_the_field():
    text = 'he wrote "completion_tokens": 999 in the text'
    payload = json.dumps(
        {"text": text, "output_ids": [5], "meta_info": {"completion_tokens": 1}}
    ).encode()
    result, _ = _feed_bytewise(_sse_response([b"data: " + payload, b"data: [DONE]"]))
    assert result.chunk_counts == [1]


def test_incremental_streaming_concatenates_output_ids():
    events = [_event([7], 1), _event([8, 9], 3), b"data: [DONE]"]
    _, sink = _feed_bytewise(_sse_response(events), incremental=True)
    assert sink.ids == [7, 8, 9]


def test_error_event_in_the_stream_is_reported():
    events = [b'data: {"error": {"message": "boom", "code": 400}}', b"data: [DONE]"]
    _, sink = _feed_bytewise(_sse_response(events))
    assert sink.error == "boom"


def test_an_idle_connection_the_server_closed_is_not_reused():
    async def go(ep, emitter):
        body = {"text": "x", "sampling_params": {"max_new_tokens": 4}}
        assert (await ep.stream_generate(body, timeout=5)).ok
        # The server drops its idle connections (a keep-alive timeout).
        for writer in list(emitter._writers):
            writer.transport.abort()
        await asyncio.sleep(0.05)
        assert ep._idle and ep._idle[0].closed
        return await ep.stream_generate(body, timeout=5)

    assert _run(_with_emitter(EmitterConfig(), go)).ok
