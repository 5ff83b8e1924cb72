"""``ddtree serve``: the embedded engine behind the subset of SGLang 0.5.23's HTTP API that
``ddtree bench``, ``deploy`` and ``doctor`` use. Standard library HTTP server + torch only.

Endpoints: POST /generate, POST /v1/completions, GET /health, /health_generate,
/server_info (and /get_server_info), /model_info (and /get_model_info), /v1/models,
/metrics. Request threads parse and wait; the scheduler thread batches and decodes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from ddtree_cli import __version__
from ddtree_cli.budget_policy import AUTO, budget_options
from ddtree_cli.engine import protocol
from ddtree_cli.engine.decoding import Engine, RequestState, generate
from ddtree_cli.engine.metrics import render_metrics
from ddtree_cli.engine.scheduler import Request, Scheduler
from ddtree_cli.engine.tokenizer import ByteTokenizer
from ddtree_cli.engine.weights import is_random_model, model_label, pair_for
from ddtree_cli.errors import ConfigError, UsageError

log = logging.getLogger("ddtree.serve")
HEALTH_GENERATE_TIMEOUT_S = 20.0


@dataclass
class ServeOptions:
    algo: str = "ar"
    budget: int | str | None = None  # a number, or "auto" (a policy picks it per round)
    max_budget: int | None = None  # with "auto": the largest candidate (default 4 x block)
    block_size: int | None = None
    model: Path | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    dtype: str = "float32"
    max_running_requests: int = 8
    context_length: int | None = None  # default: what the model's positions allow
    seed: int = 0
    # CPU threads for torch; 1 suits the small default model and several servers sharing a
    # machine (OpenMP spin-waiting makes oversubscribed threads very slow). 0: torch's default.
    threads: int = 1
    # On CUDA the engine replays each round's verify phase from captured graphs; False runs
    # it eagerly (SGLang's --disable-cuda-graph). Ignored on CPU.
    cuda_graphs: bool = True

    def validate(self) -> None:
        """Option values that cannot be served: usage errors (exit 2), like click's own.
        Normalises ``budget`` given as text ("15", "auto")."""
        if self.algo not in ("ar", "dflash", "ddtree"):
            raise UsageError(f"unknown --algo {self.algo!r}", hint="use ar, dflash or ddtree")
        if self.budget is not None and self.algo != "ddtree":
            raise UsageError("--budget applies to --algo ddtree only")
        try:
            self.budget = budget_options(self.budget, self.max_budget, self.block_size)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if self.block_size is not None and self.block_size < 2:
            raise UsageError(f"--block-size must be at least 2, got {self.block_size}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise UsageError(f"unknown --dtype {self.dtype!r}")
        if self.max_running_requests < 1:
            raise UsageError("--max-running-requests must be at least 1")
        if self.context_length is not None and self.context_length < 2:
            raise UsageError(f"--context-length must be at least 2, got {self.context_length}")
        if self.threads < 0:
            raise UsageError(f"--threads must be >= 0, got {self.threads}")
        if not 0 <= self.port < 65536:
            raise UsageError(f"--port {self.port} is not a TCP port")


def build_engine(opts: ServeOptions) -> Engine:

    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {opts.device}: CUDA is not available here")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    pair = pair_for(opts.model, opts.seed)
    engine = Engine(
        pair,
        opts.algo,
        block_size=opts.block_size,
        budget=opts.budget,
        max_budget=opts.max_budget,
        max_batch=opts.max_running_requests,
        context_len=opts.context_length,
        device=opts.device,
        dtype=getattr(torch, opts.dtype),
        seed=opts.seed,
        cuda_graphs=None if opts.cuda_graphs else False,
    )
    generate(engine, [[0, 1, 2, 3]], 4, temperature=0.0)  # warm-up: lazy inits, kernels
    engine.total_rounds = engine.total_accepted = 0
    return engine


class EngineServer:
    def __init__(self, opts: ServeOptions):
        opts.validate()
        self.opts = opts
        self.tokenizer = ByteTokenizer()
        self.scheduler = Scheduler(lambda: build_engine(opts))
        try:
            self.httpd = ThreadingHTTPServer((opts.host, opts.port), _Handler)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {opts.host}:{opts.port}: {exc.strerror}") from None
        self.httpd.daemon_threads = True
        self.httpd.app = self  # type: ignore[attr-defined]
        self.startup_time = time.time()
        self._http_thread = threading.Thread(
            target=self.httpd.serve_forever, name="ddtree-http", daemon=True
        )

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.opts.host}:{self.port}"

    def start(self) -> None:
        self.scheduler.start()
        self._http_thread.start()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the engine is loaded; raise its error if it could not start."""
        self.scheduler.ready.wait(timeout)
        if self.scheduler.failed:
            raise ConfigError(f"engine failed to start: {self.scheduler.failed}")

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.scheduler.stop()

    # ---- views -----------------------------------------------------------------------

    @property
    def engine(self) -> Engine | None:
        return self.scheduler.engine if self.scheduler.ready.is_set() else None

    def limits(self) -> protocol.Limits:
        engine = self.engine
        return protocol.Limits(
            vocab_size=engine.target.config.vocab_size,
            context_length=engine.context_len,
            eos_token_id=self.tokenizer.eos_token_id,
        )

    def spec(self) -> protocol.SpecInfo:
        algo = self.opts.algo
        if algo == "ar":
            return protocol.SpecInfo(None, 0)
        return protocol.SpecInfo(algo.upper(), self.engine.block_size)

    @property
    def served_model_name(self) -> str:
        return model_label(self.opts.model)

    def _speculative_widths(self) -> dict[str, Any]:
        """The widths as (patched) SGLang 0.5.13 reports them: DFLASH resolves the drafter's
        block into speculative_num_draft_tokens and leaves speculative_dflash_block_size null;
        DDTREE keeps the block there and verifies the root plus its budget."""
        algo, engine = self.opts.algo, self.engine
        if algo == "ddtree" and engine.policy is not None:
            # The widest verify sizes the buffers (and SGLang's graphs); the candidates are
            # settings, the live choices are state (internal_states).
            return {
                "speculative_num_draft_tokens": engine.width,
                "speculative_dflash_block_size": engine.block_size,
                "speculative_ddtree_budget": AUTO,
                "speculative_ddtree_max_budget": engine.budgets[-1],
                "speculative_ddtree_budget_candidates": list(engine.budgets),
            }
        if algo == "ddtree":
            return {
                "speculative_num_draft_tokens": engine.budget + 1,
                "speculative_dflash_block_size": engine.block_size,
                "speculative_ddtree_budget": engine.budget,
            }
        block = engine.block_size if algo == "dflash" else None
        return {
            "speculative_num_draft_tokens": block,
            "speculative_dflash_block_size": None,
            "speculative_ddtree_budget": None,
        }

    def server_info(self) -> dict[str, Any]:
        engine = self.engine
        spec = self.spec()
        stats = self.scheduler.stats
        info: dict[str, Any] = {
            "model_path": (
                str(self.opts.model)
                if self.opts.model and not is_random_model(self.opts.model)
                else model_label(self.opts.model)
            ),
            "tokenizer_path": self.tokenizer.name,
            "served_model_name": self.served_model_name,
            "host": self.opts.host,
            "port": self.port,
            "speculative_algorithm": spec.algorithm,
            **self._speculative_widths(),
            "max_running_requests": engine.max_batch,
            "context_length": engine.context_len,
            "device": self.opts.device,
            "device_name": _device_name(engine),
            "dtype": self.opts.dtype,
            "random_seed": self.opts.seed,
            # SGLang's name; true wherever rounds run eagerly (always on CPU).
            "disable_cuda_graph": not engine.cuda_graphs,
            "cpu_threads": torch.get_num_threads(),
            "enable_metrics": True,
            "model": engine.pair.identity(),
            "internal_states": [
                {
                    "avg_spec_accept_length": stats.avg_spec_accept_length,
                    "last_gen_throughput": self.scheduler.last_throughput,
                    "num_running_reqs": self.scheduler.num_running,
                    "num_queue_reqs": self.scheduler.num_waiting,
                    "max_running_reqs_seen": stats.max_running,
                    **(
                        {"speculative_ddtree_budget_policy": engine.policy.snapshot()}
                        if engine.policy is not None
                        else {}
                    ),
                }
            ],
            "version": __version__,
            "engine": "ddtree-embedded",
            "api_compat": "sglang 0.5.23",
            "startup_time": self.startup_time,
        }
        return info


def _device_name(engine: Engine) -> str:
    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    return "cpu"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"ddtree-serve/{__version__}"

    @property
    def app(self) -> EngineServer:
        return self.server.app  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("%s %s", self.address_string(), format % args)

    # ---- plumbing --------------------------------------------------------------------

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": {"message": message, "code": status}})

    def _body(self) -> Any:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise protocol.BadRequest("invalid Content-Length header") from None
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise protocol.BadRequest(f"the request body is not valid JSON: {exc}") from None

    def _start_stream(self) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, obj: Any) -> None:
        self._chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _end_stream(self) -> None:
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    # ---- routes ----------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        app = self.app
        if path in ("/health", "/health_generate"):
            return self._health(generate_probe=path == "/health_generate")
        if app.engine is None:
            return self._error(HTTPStatus.SERVICE_UNAVAILABLE, "the server is starting")
        if path in ("/server_info", "/get_server_info"):
            return self._json(HTTPStatus.OK, app.server_info())
        if path in ("/model_info", "/get_model_info"):
            return self._json(
                HTTPStatus.OK,
                {
                    "model_path": app.server_info()["model_path"],
                    "tokenizer_path": app.tokenizer.name,
                    "is_generation": True,
                    "weight_version": app.engine.pair.weights_sha256[:16],
                },
            )
        if path == "/v1/models":
            return self._json(
                HTTPStatus.OK,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": app.served_model_name,
                            "object": "model",
                            "owned_by": "ddtree",
                            "root": app.served_model_name,
                            "max_model_len": app.engine.context_len,
                        }
                    ],
                },
            )
        if path == "/metrics":
            body = render_metrics(app).encode()
            return self._send(HTTPStatus.OK, body, "text/plain; version=0.0.4; charset=utf-8")
        return self._error(HTTPStatus.NOT_FOUND, f"no route GET {path}")

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path not in ("/generate", "/v1/completions"):
            self._body()
            return self._error(HTTPStatus.NOT_FOUND, f"no route POST {path}")
        try:
            body = self._body()
            if self.app.engine is None:
                return self._error(HTTPStatus.SERVICE_UNAVAILABLE, "the server is starting")
            if path == "/generate":
                return self._generate(body)
            return self._completions(body)
        except protocol.BadRequest as exc:
            return self._error(HTTPStatus.BAD_REQUEST, str(exc))

    def _health(self, generate_probe: bool) -> None:
        app = self.app
        if app.engine is None:
            reason = app.scheduler.failed or "the server is starting"
            return self._error(HTTPStatus.SERVICE_UNAVAILABLE, reason)
        if not generate_probe:
            return self._send(HTTPStatus.OK, b"", "text/plain")
        # SGLang's probe: one token from input_ids=[0] at temperature 0.
        req = app.scheduler.submit(RequestState([0], 1, 0.0, frozenset()))
        deadline = time.monotonic() + HEALTH_GENERATE_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                app.scheduler.abort(req)
                return self._error(HTTPStatus.SERVICE_UNAVAILABLE, "health probe timed out")
            kind = _next_event(req, left)
            if kind in ("done", "tokens"):
                if kind == "tokens":
                    _drain(req)
                return self._send(HTTPStatus.OK, b"", "text/plain")
            if kind == "error":
                return self._error(HTTPStatus.SERVICE_UNAVAILABLE, req.error or "error")

    def _generate(self, body: Any) -> None:
        app = self.app
        items, is_batch, stream = protocol.parse_generate(body, app.tokenizer, app.limits())
        reqs = [app.scheduler.submit(it.seq, it.rid) for it in items]
        spec = app.spec()
        if not stream:
            for req in reqs:
                _drain(req)
            failed = [r for r in reqs if r.error]
            if failed:
                return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, failed[0].error)
            out = [
                protocol.generate_response(
                    r.rid, r.seq, app.tokenizer, spec, r.e2e_latency, it.skip_special_tokens
                )
                for r, it in zip(reqs, items, strict=True)
            ]
            return self._json(HTTPStatus.OK, out if is_batch else out[0])
        req, item = reqs[0], items[0]
        self._start_stream()
        try:
            while True:
                kind = _next_event(req, None)
                if kind == "error":
                    self._event({"error": {"message": req.error}})
                    break
                chunk = protocol.generate_response(
                    req.rid,
                    req.seq,
                    app.tokenizer,
                    spec,
                    req.e2e_latency if kind == "done" else None,
                    item.skip_special_tokens,
                )
                if kind != "done":
                    # The scheduler may finish the request while this chunk is built; only
                    # the last chunk carries the finish reason (and the spec statistics).
                    chunk["meta_info"]["finish_reason"] = None
                self._event(chunk)
                if kind == "done":
                    break
            self._end_stream()
        except (BrokenPipeError, ConnectionResetError):
            app.scheduler.abort(req)
            self.close_connection = True

    def _completions(self, body: Any) -> None:
        app = self.app
        item, stream, model = protocol.parse_completions(body, app.tokenizer, app.limits())
        req = app.scheduler.submit(item.seq)
        if not stream:
            _drain(req)
            if req.error:
                return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, req.error)
            return self._json(
                HTTPStatus.OK, protocol.completion_response(req.rid, req.seq, app.tokenizer, model)
            )
        self._start_stream()
        sent = 0
        created = int(time.time())
        try:
            while True:
                kind = _next_event(req, None)
                if kind == "error":
                    self._event({"error": {"message": req.error}})
                    break
                seq = req.seq
                text = app.tokenizer.decode(seq.output)
                reason, matched = protocol.completion_finish_reason(seq)
                choice = {
                    "index": 0,
                    "text": text[sent:],
                    "logprobs": None,
                    "finish_reason": reason if kind == "done" else None,
                }
                if kind == "done":
                    choice["matched_stop"] = matched
                sent = len(text)
                self._event(
                    {
                        "id": req.rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                )
                if kind == "done":
                    break
            self._end_stream()
        except (BrokenPipeError, ConnectionResetError):
            app.scheduler.abort(req)
            self.close_connection = True


def _next_event(req: Request, timeout: float | None) -> str | None:
    """The next event's kind; consecutive token events are merged (the state is cumulative)."""
    import queue

    try:
        kind, _ = req.events.get(timeout=timeout)
    except queue.Empty:
        return None
    while kind == "tokens":
        try:
            kind, _ = req.events.get_nowait()
        except queue.Empty:
            break
    return kind


def _drain(req: Request) -> None:
    while _next_event(req, None) not in ("done", "error"):
        pass


def run_forever(opts: ServeOptions, on_ready=None) -> None:
    """Serve until SIGINT or SIGTERM; ``on_ready(server)`` runs once the engine is loaded."""
    import signal

    server = EngineServer(opts)
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        server.start()
        server.wait_ready()
        if on_ready is not None:
            on_ready(server)
        stop.wait()
    finally:
        server.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def ready_summary(server: EngineServer) -> dict[str, Any]:
    engine = server.engine
    ident = engine.pair.identity()
    return {
        "url": server.url,
        "algo": server.opts.algo,
        "block_size": engine.block_size if server.opts.algo != "ar" else None,
        "budget": engine.budget if server.opts.algo == "ddtree" else None,
        "budget_candidates": list(engine.budgets) if engine.policy is not None else None,
        "model": ident["origin"],
        "random_init": ident["random_init"],
        "weights_sha256": ident["weights_sha256"],
        "target_params": ident["target_params"],
        "device": _device_name(engine),
    }
