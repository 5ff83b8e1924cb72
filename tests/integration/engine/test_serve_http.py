"""``ddtree serve`` over real HTTP on 127.0.0.1: SGLang's fields, SSE, errors, batching."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from ddtree_cli.bench import fingerprint
from ddtree_cli.engine.server import EngineServer, ServeOptions
from ddtree_cli.engine.tokenizer import ByteTokenizer
from ddtree_cli.engine.weights import EMBEDDED_ORIGIN, load_embedded_pair
from tests.integration.engine.client import get, post, stream

pytestmark = pytest.mark.http

TRAINED_SHA256 = load_embedded_pair().weights_sha256
PROMPTS = ["Hello", "The quick brown fox", "a", "DDTree verifies a tree in one pass " * 3]


def start(algo: str, **kw) -> EngineServer:
    server = EngineServer(ServeOptions(algo=algo, port=0, context_length=512, **kw))
    server.start()
    server.wait_ready(timeout=120)
    return server


@pytest.fixture(scope="module")
def servers():
    running = {algo: start(algo) for algo in ("ar", "dflash", "ddtree")}
    yield {algo: s.url for algo, s in running.items()}
    for s in running.values():
        s.shutdown()


def greedy(url, text, max_new=24, **params):
    status, body = post(
        url,
        "/generate",
        {
            "text": text,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new, **params},
        },
    )
    assert status == 200, body
    return body


def test_health_is_503_until_the_engine_is_ready():
    server = EngineServer(ServeOptions(algo="ddtree", port=0, context_length=256))
    gate = threading.Event()
    real_build = server.scheduler._build_engine

    def slow_build():  # hold the start-up open so the test can look at it
        gate.wait(60)
        return real_build()

    server.scheduler._build_engine = slow_build
    server.start()
    try:
        assert get(server.url, "/health")[0] == 503
        assert get(server.url, "/health_generate")[0] == 503
        assert post(server.url, "/generate", {"text": "x"})[0] == 503
        gate.set()
        server.wait_ready(timeout=60)
        assert get(server.url, "/health")[0] == 200
        assert get(server.url, "/health_generate")[0] == 200
    finally:
        gate.set()
        server.shutdown()


def test_generate_fields_and_speculative_statistics(servers):
    tok = ByteTokenizer()
    for algo, url in servers.items():
        body = greedy(url, "Hello", max_new=20)
        meta = body["meta_info"]
        assert body["text"] == tok.decode(body["output_ids"])
        assert meta["prompt_tokens"] == 5
        assert meta["completion_tokens"] == len(body["output_ids"])
        if meta["finish_reason"]["type"] == "length":
            assert meta["finish_reason"] == {"type": "length", "length": 20}
            assert len(body["output_ids"]) == 20
        if algo == "ar":
            assert "spec_verify_ct" not in meta
        else:
            assert meta["spec_verify_ct"] >= 1
            assert meta["spec_accept_length"] == pytest.approx(
                meta["completion_tokens"] / meta["spec_verify_ct"]
            )
            assert meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"] * 15


def test_all_algorithms_return_ar_tokens_at_temperature_zero(servers):
    for text in PROMPTS:
        outs = {algo: greedy(url, text, max_new=40)["output_ids"] for algo, url in servers.items()}
        assert outs["dflash"] == outs["ar"] == outs["ddtree"]


def test_input_ids_and_stop_token_ids(servers):
    url = servers["ddtree"]
    full = post(
        url,
        "/generate",
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True},
        },
    )[1]["output_ids"]
    stop = full[10]
    cut = full.index(stop) + 1
    body = post(
        url,
        "/generate",
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {"temperature": 0, "max_new_tokens": 30, "stop_token_ids": [stop]},
        },
    )[1]
    assert body["output_ids"] == full[:cut]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_batch_of_prompts_in_one_request(servers):
    url = servers["dflash"]
    status, body = post(
        url,
        "/generate",
        {"text": PROMPTS[:3], "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
    )
    assert status == 200 and isinstance(body, list) and len(body) == 3
    assert [b["output_ids"] for b in body] == [greedy(url, p, 8)["output_ids"] for p in PROMPTS[:3]]


def test_stream_is_sglang_sse(servers):
    url = servers["ddtree"]
    request = {"text": "Hello", "sampling_params": {"temperature": 0, "max_new_tokens": 30}}
    events, lines = stream(url, "/generate", request)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    # Every event is one "data: ..." line followed by a blank line.
    data_lines = [i for i, line in enumerate(lines) if line.startswith("data: ")]
    assert all(lines[i + 1] == "" for i in data_lines)
    for prev, cur in zip(chunks, chunks[1:], strict=False):
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]  # cumulative
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"] is not None
    assert last["meta_info"]["spec_verify_ct"] >= 1
    assert last["output_ids"] == greedy(url, "Hello", 30)["output_ids"]


def test_openai_completions(servers):
    url = servers["ddtree"]
    status, body = post(
        url, "/v1/completions", {"model": "x", "prompt": "Hi", "max_tokens": 12, "temperature": 0}
    )
    assert status == 200
    choice = body["choices"][0]
    assert body["object"] == "text_completion"
    assert body["usage"]["prompt_tokens"] == 2
    assert body["usage"]["completion_tokens"] <= 12
    assert choice["finish_reason"] in ("length", "stop")
    events, _ = stream(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 12, "temperature": 0})
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == choice["text"]
    assert events[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]


BAD = [
    ("/generate", None, b"{not json"),
    ("/generate", {"text": "a", "input_ids": [1]}, None),
    ("/generate", {}, None),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -1}}, None),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": "ten"}}, None),
    ("/generate", {"text": "a", "sampling_params": {"frobnicate": 1}}, None),
    ("/generate", {"text": "a", "sampling_params": {"top_p": 0.9}}, None),
    ("/generate", {"input_ids": [1, 99999]}, None),
    ("/generate", {"input_ids": []}, None),
    ("/generate", {"text": "a" * 600}, None),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 10_000}}, None),
    ("/generate", {"text": ["a", "b"], "stream": True}, None),
    ("/generate", [1, 2], None),
    ("/generate", {"text": "a", "return_logprob": True}, None),
    ("/v1/completions", {"max_tokens": 3}, None),
    ("/v1/completions", {"prompt": "a", "stop": ["\n"]}, None),
]


@pytest.mark.parametrize(("path", "body", "raw"), BAD)
def test_bad_requests_get_400_and_the_server_keeps_serving(servers, path, body, raw):
    url = servers["ddtree"]
    status, resp = post(url, path, body, raw)
    assert status == 400
    assert resp["error"]["message"]
    assert greedy(url, "ok", 3)["meta_info"]["completion_tokens"] >= 1


def test_unknown_route_is_404(servers):
    assert get(servers["ar"], "/nope")[0] == 404
    assert post(servers["ar"], "/nope", {})[0] == 404


def test_concurrent_requests_are_batched_and_exact():
    server = start("ddtree", max_running_requests=8)
    try:
        prompts = [("x" * n) + str(n) for n in (1, 5, 9, 40, 3, 77, 12, 20)]
        expected = {p: greedy(server.url, p, 32)["output_ids"] for p in prompts}
        results: dict[str, list[int]] = {}

        def one(p):
            results[p] = greedy(server.url, p, 32)["output_ids"]

        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == expected
        info = get(server.url, "/server_info")[1]
        assert info["internal_states"][0]["max_running_reqs_seen"] > 1
    finally:
        server.shutdown()


def test_server_info_and_metrics(servers):
    url = servers["ddtree"]
    greedy(url, "metrics", 10)
    for path in ("/server_info", "/get_server_info"):
        status, info = get(url, path)
        assert status == 200
        assert info["speculative_algorithm"] == "DDTREE"
        assert info["speculative_ddtree_budget"] == 15
        # SGLang's conventions (patched 0.5.13 on an H200): DDTREE verifies budget + 1 and
        # keeps the drafter's block in speculative_dflash_block_size ...
        assert info["speculative_num_draft_tokens"] == 16
        assert info["speculative_dflash_block_size"] == 16
        assert info["internal_states"][0]["avg_spec_accept_length"] >= 1.0
        # The default model is the embedded trained pair, identified by its hash.
        assert info["model"]["random_init"] is False
        assert info["model"]["origin"] == EMBEDDED_ORIGIN
        assert info["model"]["weights_sha256"] == TRAINED_SHA256
        assert info["served_model_name"] == "ddtree-embedded-trained"
        assert len(info["model"]["weights_sha256"]) == 64
        assert info["device"] == "cpu"
        assert info["disable_cuda_graph"] is True  # graphs are CUDA-only
    # ... DFLASH resolves its block into speculative_num_draft_tokens, block size null.
    dflash = get(servers["dflash"], "/server_info")[1]
    assert (dflash["speculative_num_draft_tokens"], dflash["speculative_dflash_block_size"]) == (
        16,
        None,
    )
    assert dflash["speculative_ddtree_budget"] is None
    assert get(servers["ar"], "/server_info")[1]["speculative_algorithm"] is None
    status, text = get(url, "/metrics")
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    assert values["sglang:num_requests_total"] >= 1
    assert values["sglang:spec_accept_length"] >= 1.0
    assert values["sglang:spec_verify_calls_total"] >= 1
    assert values["sglang:generation_tokens_total"] >= 10
    assert "sglang:time_to_first_token_seconds_bucket" in values


def test_budget_auto_serves_ar_tokens_and_shows_its_choices(servers):
    auto = start("ddtree", budget="auto")
    try:
        for text in PROMPTS:
            assert greedy(auto.url, text, 32)["text"] == greedy(servers["ar"], text, 32)["text"]
        info = get(auto.url, "/server_info")[1]
        assert info["speculative_ddtree_budget"] == "auto"
        assert info["speculative_ddtree_budget_candidates"] == [15, 32, 64]
        assert info["speculative_ddtree_max_budget"] == 64
        # The widest verify (what sizes the buffers), the drafter's block beside it.
        assert info["speculative_num_draft_tokens"] == 65
        assert info["speculative_dflash_block_size"] == 16
        policy = info["internal_states"][0]["speculative_ddtree_budget_policy"]
        assert policy["candidates"] == [15, 32, 64]
        bucket = policy["buckets"]["1"]  # one request at a time
        assert bucket["budget"] in (15, 32, 64)
        assert set(bucket["round_ms"]) == {"15", "32", "64"}
        assert all(ms > 0 for ms in bucket["round_ms"].values())
        assert set(policy["calibration"]) == {"15", "32", "64"}
        assert policy["value_per_request"]["64"] > policy["value_per_request"]["15"] > 0
        assert policy["budget_changes"] >= 1 and policy["recent_changes"]
        text = get(auto.url, "/metrics")[1]
        lines = [x for x in text.splitlines() if x.startswith("sglang:spec_ddtree_budget{")]
        assert any('batch_bucket="1"' in x and x.endswith(f" {bucket['budget']}") for x in lines)
        # The confound guard counts "auto" and its candidates as the algorithm's settings.
        fps = {
            name: fingerprint.fingerprint(get(url, "/server_info")[1])
            for name, url in (("auto", auto.url), ("b15", servers["ddtree"]))
        }
        fps["dflash"] = fingerprint.fingerprint(get(servers["dflash"], "/server_info")[1])
        assert fps["auto"]["speculative_ddtree_budget"] == "auto"
        assert fingerprint.compare(fps) == []
    finally:
        auto.shutdown()


def test_client_disconnect_mid_stream_aborts_and_serving_continues(servers):
    url = servers["ar"]
    host, port = url.rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(
        "POST",
        "/generate",
        body=json.dumps(
            {
                "text": "long",
                "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
            }
        ),
    )
    resp = conn.getresponse()
    assert resp.readline().startswith(b"")  # the stream has started
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 30
    aborted = 0.0
    while time.monotonic() < deadline and not aborted:
        text = get(url, "/metrics")[1]
        line = next(x for x in text.splitlines() if x.startswith("sglang:num_aborted"))
        aborted = float(line.rsplit(" ", 1)[1])
        time.sleep(0.2)
    assert aborted >= 1
    assert greedy(url, "still here", 5)["meta_info"]["completion_tokens"] >= 1
