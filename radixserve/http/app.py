"""The ASGI app: its routes, middlewares and lifespan over a started `Backend` (scheduler and
worker processes). The `TokenizerManager` is created in the server's own event loop (lifespan).
Routes are thin: parse, call the engine client (`radixserve.front`), shape the answer.

    GET  /                 the chat page (http/web_ui.py; no API key needed); off with --disable-web-ui
    GET  /health           200 only when the scheduler and worker answer (no API key needed)
    GET  /metrics          Prometheus text
    GET  /health_generate  the same check (SGLang's name for it; needs the API key)
    GET  /server_info      options, model, CPU placement, KV pages (total, free, cached, in use), pids
                           (also /get_server_info, SGLang's older name)
    GET  /model_info       SGLang's model card: model_path, tokenizer_path, is_generation
                           (also /get_model_info)
    POST /flush_cache      drop every unlocked cached prefix (POST only: a GET is what any web page
                           can make a browser send; /reset_prefix_cache is vLLM's name for it)
    POST /abort_request    abort a request by its caller's `rid` (or every one with `abort_all`)
    POST /cache/pin, /cache/unpin, GET /cache/pins   keep prefixes cached on purpose (http/cache_api.py)
    POST /generate         SGLang's native API (text or input_ids, one or a batch; SSE streaming)
    GET  /v1/models        the one served model
    POST /v1/completions, /v1/chat/completions   see http/openai/routes.py
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixserve.config import ServerConfig
from radixserve.front.manager import TokenizerManager
from radixserve.front.recovery import BackendEvents
from radixserve.front.types import shown
from radixserve.http import cache_api, native, web_ui
from radixserve.http.common import HTTPError
from radixserve.http.middleware import (
    APIKeyMiddleware,
    DrainMiddleware,
    OriginMiddleware,
    ResponseCountMiddleware,
)
from radixserve.http.openai import routes as openai_api
from radixserve.http.origins import OriginPolicy
from radixserve.http.state import ServerState
from radixserve.http.tenants import Tenants, load_api_key_file
from radixserve.launch import Backend
from radixserve.protocol import WorkerInfo


def create_app(config: ServerConfig, backend: Backend, ready: WorkerInfo, tokenizer: Any) -> Starlette:
    """The ASGI app over a started backend. The API key (or the keys of --api-key-file), if any,
    guards every route but /health and the chat page's files (which hold no secret); the Host
    and Origin rules (http/origins.py) guard every route, those included."""
    state = ServerState(config=config, backend=backend, ready=ready, tokenizer=tokenizer)
    routes = [
        Route("/health", native.health, methods=["GET"]),
        Route("/health_generate", native.health, methods=["GET"]),
        Route("/metrics", native.metrics, methods=["GET"]),
        Route("/server_info", native.server_info, methods=["GET"]),
        Route("/get_server_info", native.server_info, methods=["GET"]),
        Route("/model_info", native.model_info, methods=["GET"]),
        Route("/get_model_info", native.model_info, methods=["GET"]),
        Route("/flush_cache", native.flush_cache, methods=["POST"]),
        Route("/reset_prefix_cache", native.flush_cache, methods=["POST"]),
        Route("/abort_request", native.abort_request, methods=["POST"]),
        Route("/generate", native.generate, methods=["POST"]),
        Route("/v1/models", native.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", native.get_model, methods=["GET"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        *cache_api.routes(),
    ]
    public = frozenset({"/health"})
    if not config.disable_web_ui:
        routes += web_ui.routes()
        public |= web_ui.PUBLIC_PATHS
    app = Starlette(
        routes=routes, lifespan=_lifespan,
        exception_handlers={HTTPException: _http_exception},  # 404, 405 as JSON too
    )
    app.router.redirect_slashes = False  # `/generate/` is a JSON 404, not an empty 307
    app.state.server = state
    if config.api_key_file is not None:
        tenants = load_api_key_file(config.api_key_file)
        state.metrics.add_tenants(tenants.names)
        app.add_middleware(APIKeyMiddleware, keys=tenants, per_tenant=True, public=public)
        state.tenants_on = True
    elif config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, keys=Tenants.single(config.api_key), per_tenant=False, public=public)
    policy = OriginPolicy(config.host, config.port, config.allowed_origins, config.allowed_hosts)
    app.add_middleware(OriginMiddleware, policy=policy)  # before the key: a CORS preflight carries none
    app.add_middleware(DrainMiddleware, state=state)  # refuses before anything else runs
    app.add_middleware(ResponseCountMiddleware, routes=routes, metrics=state.metrics)  # outermost: sees every answer
    return app


@asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    manager = TokenizerManager(state.backend.endpoints, state.ready, state.tokenizer)
    manager.start(state.backend.receiver)
    state.manager = manager

    def on_lost(reason: str) -> None:
        state.engine_lost = reason  # the server exits non-zero, for a supervisor to act on

    state.backend.watch(BackendEvents(manager, asyncio.get_running_loop(), on_lost))
    try:
        yield
    finally:
        state.close()
        await manager.shutdown()


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    path = shown(request.url.path)
    message = {404: f"no route {path}", 405: f"{shown(request.method)} is not allowed on {path}"}
    return HTTPError(exc.status_code, message.get(exc.status_code, str(exc.detail))).response()
