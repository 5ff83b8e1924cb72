"""An arm behind SGLang's router: recognise the router, list the replicas behind it.

What SGLang's router (the Rust router of the ``sglang-router`` 0.3.2 wheel,
``python -m sglang_router.launch_router --worker-urls ...``) answers, seen running it in
front of two ``ddtree serve`` replicas on 127.0.0.1:

- ``GET /server_info``: 404; ``GET /get_server_info``: its own summary,
  ``{"router_manager": true, "routers_count": 1, "workers_count": 2}``: nothing about the
  model, the flags or the algorithm of the replicas;
- ``GET /workers``: ``{"workers": [{"id", "url", "model_id", "worker_type", "is_healthy",
  "load", "connection_mode", ...}], "total": 2, "stats": {...}}``, one entry per replica;
- ``GET /list_workers``: 404.

So the confound guard asks the router for its workers and each worker for its own
``/server_info``.
"""

from __future__ import annotations

from typing import Any

from ddtree_cli.errors import DdtreeError

WORKERS_PATH = "/workers"


def is_router(info: Any) -> bool:
    """True for a router's own ``/get_server_info`` summary (not a model server's)."""
    return isinstance(info, dict) and info.get("router_manager") is True


def worker_urls(router_url: str, status: int, body: Any) -> list[str]:
    """The replicas' URLs from the router's ``GET /workers`` answer, in its order, once each;
    raises with the router named when the answer is not such a list or lists none."""
    workers = body.get("workers") if isinstance(body, dict) else None
    if status != 200 or not isinstance(workers, list):
        raise DdtreeError(
            f"the router at {router_url} does not list its workers "
            f"(GET {WORKERS_PATH} answered HTTP {status})",
            hint="bench reads the replicas from SGLang's router (sglang-router 0.3); point "
            "--url at each replica instead",
        )
    urls: list[str] = []
    for worker in workers:
        url = worker.get("url") if isinstance(worker, dict) else None
        if isinstance(url, str) and url.rstrip("/") not in urls:
            urls.append(url.rstrip("/"))
    if not urls:
        raise DdtreeError(
            f"the router at {router_url} lists no workers",
            hint="add the replicas to the router (--worker-urls or POST /workers)",
        )
    return urls
