"""The SpecCache server's tenancy options, enforced where a client can be told: vLLM's API server.

    vllm serve MODEL --kv-transfer-config '{…"require_salt": true…}' --middleware speccache_rag.vllm.tenancy.enforce

(``python -m speccache_rag.vllm.serve`` adds the middleware itself.) With ``require_salt`` a chat or completion
request without a ``cache_salt`` is refused with HTTP 400; with ``client_precompute`` off, a request asking the
server to store chunks (``op="precompute"``) with HTTP 403. The connector applies the same options to whatever
reaches it (no reuse, no store), so the middleware is the clear error, not the only guard. Each refusal is
counted on the server's ``/metrics`` as ``vllm:speccache_rejected_requests_total{reason=…}``.
"""
from __future__ import annotations

import functools
import json

from .deployment import Options

_ROUTES = ("/v1/chat/completions", "/v1/completions")


@functools.cache
def _rejected():
    from prometheus_client import Counter

    return Counter("vllm:speccache_rejected_requests", "Requests the SpecCache tenancy policy refused with an HTTP "
                   "error (reason: require_salt or client_precompute).", ["reason"])


def _options(app) -> Options:
    options = getattr(app.state, "speccache_options", None)
    if options is None:
        config = getattr(getattr(app.state, "vllm_config", None), "kv_transfer_config", None)
        options = Options.from_sources(getattr(config, "kv_connector_extra_config", None) or {})
        app.state.speccache_options = options
    return options


async def enforce(request, call_next):
    """ASGI ``http`` middleware: refuse what the deployment's tenancy options forbid, before vLLM sees it."""
    if request.method != "POST" or not request.url.path.endswith(_ROUTES):
        return await call_next(request)
    options = _options(request.app)
    if not (options.require_salt or not options.client_precompute):
        return await call_next(request)
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        return await call_next(request)                # vLLM answers malformed JSON itself
    body = body if isinstance(body, dict) else {}
    transfer = body.get("kv_transfer_params")
    params = transfer.get("speccache") if isinstance(transfer, dict) else None
    refused = options.refusal(params.get("op") if isinstance(params, dict) else None, body.get("cache_salt"))
    if refused is None:
        return await call_next(request)
    from fastapi.responses import JSONResponse

    status = 400 if "cache_salt" in refused else 403
    _rejected().labels(reason="require_salt" if status == 400 else "client_precompute").inc()
    return JSONResponse(status_code=status, content={"error": {"message": refused, "type": "BadRequestError"
                                                               if status == 400 else "PermissionDeniedError",
                                                               "code": status}})
