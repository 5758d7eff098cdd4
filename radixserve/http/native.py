"""SGLang-style native routes: /generate, health, metrics, server and model info, abort, flush,
and the OpenAI-shaped /v1/models (the routes are listed in `http/app.py`)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixserve.front.manager import TokenizerManager
from radixserve.front.types import EngineDead, GenerateRequest, InvalidRequest
from radixserve.front.validation.inputs import build_requests
from radixserve.http.common import (
    SSE_DONE,
    HTTPError,
    JSONResponse,
    SSEResponse,
    handles_errors,
    read_json,
    sse,
    to_http_error,
    until_disconnect,
)
from radixserve.http.metrics import CONTENT_TYPE
from radixserve.http.state import ServerState
from radixserve.http.tenants import SCOPE_KEY, scope_requests, sees_everything
from radixserve.protocol import SamplingParams
from radixserve.version import __version__

PROBE_WHEN_IDLE_FOR_S = 5.0  # /health runs a one-token request when no step ran for this long

_GENERATE_FIELDS = frozenset({
    "text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "rid", "cache_salt",
    "segments", "segment_reuse", "segment_recompute_ratio",
})
# SGLang fields we do not implement: accepted only when null, false or empty (never 0: a
# typo'd or unknown field is an error whatever its value)
_GENERATE_UNSUPPORTED = frozenset({
    "image_data", "video_data", "audio_data", "input_embeds", "lora_path", "lora_id",
    "session_params", "custom_logit_processor", "return_hidden_states", "return_routed_experts",
    "token_ids_logprob", "bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank",
    "modalities", "background", "return_bytes", "return_entropy",
})
# SGLang flags about the server's own logging, which change nothing in the answer; SGLang's
# router sends them (and `model`) with every /generate it forwards, so they must be accepted
_GENERATE_LOGGING_FLAGS = frozenset({"log_metrics", "no_logs"})


def _state(request: Request) -> ServerState:
    return request.app.state.server


# ---------------------------------------------------------------------- health, metrics, admin


async def health(request: Request) -> Response:
    problem = await _health_problem(_state(request))
    if problem is not None:
        return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _health_problem(state: ServerState) -> str | None:
    """None when the scheduler answers and the worker has completed a step recently (or
    completes a one-token probe now); otherwise why not."""
    manager = state.manager
    if manager is None:
        return "the server is starting"
    if manager.dead_reason:
        return manager.dead_reason
    if manager.restarting_reason:
        return f"the engine is restarting after a crash ({manager.restarting_reason}); requests in flight resume after it"
    for p in state.backend.processes:
        if not p.is_alive():
            return f"the {p.name.split('-')[-1]} process is not running"
    timeout = state.config.health_timeout
    try:
        stats = await manager.stats(timeout=timeout)
    except asyncio.TimeoutError:
        return f"the scheduler did not answer within {timeout:g} s (a step may be stuck in the worker)"
    except EngineDead as exc:
        return exc.message
    if stats.num_running == 0 and time.time() - stats.last_step_time > PROBE_WHEN_IDLE_FOR_S:
        return await _probe(state, manager, timeout)
    return None


async def _probe(state: ServerState, manager: TokenizerManager, timeout: float) -> str | None:
    """One greedy token through the whole runtime: proves the worker still computes. Concurrent
    health checks share one probe."""
    if state.health_probe is None or state.health_probe.done():
        state.health_probe = asyncio.ensure_future(_run_probe(state, manager, timeout))
    return await asyncio.shield(state.health_probe)


async def _run_probe(state: ServerState, manager: TokenizerManager, timeout: float) -> str | None:
    token = state.ready.eos_token_ids[0] if state.ready.eos_token_ids else 0
    req = GenerateRequest(
        input_ids=[token], sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
        rid=f"health-{uuid.uuid4().hex}",
    )

    async def run() -> None:
        async for _ in manager.generate(req):
            pass

    try:
        await asyncio.wait_for(run(), timeout)
    except asyncio.TimeoutError:
        return f"the worker did not complete a one-token request within {timeout:g} s"
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return f"a one-token probe failed: {exc}"
    return None


@handles_errors
async def metrics(request: Request) -> Response:
    """Prometheus text: everything, or with a tenant's key only that tenant's series."""
    state = _state(request)
    if not sees_everything(request.scope):
        return Response(state.metrics.render_tenant(request.scope[SCOPE_KEY]), media_type=CONTENT_TYPE)
    try:
        stats = await state.get_manager().stats()
    except (asyncio.TimeoutError, EngineDead):
        stats = None  # the histograms still answer; the scheduler's numbers are left out
    manager = state.get_manager()
    return Response(state.metrics.render(stats, manager.restarts, manager.recovered), media_type=CONTENT_TYPE)


@handles_errors
async def server_info(request: Request) -> Response:
    """The server's options, model, placement, pages, queue and pids; with a tenant's key only
    the version, the model and the options without file paths (the rest moves with, or tells
    about, what other tenants do)."""
    state = _state(request)
    if not sees_everything(request.scope):
        return JSONResponse({
            "version": __version__, "model": _model_description(state),
            "options": state.config.to_dict(hide_paths=True), "tenant": request.scope[SCOPE_KEY],
        })
    manager = state.get_manager()
    try:
        stats = await manager.stats()
    except (asyncio.TimeoutError, EngineDead):
        stats = None  # dead, restarting or stuck: `pages` and `requests` are null
    ready = state.ready
    pages = None
    if stats is not None:
        pages = {
            "total": stats.total_pages, "free": stats.free_pages, "cached": stats.cached_pages,
            "evictable": stats.evictable_pages, "in_use": stats.running_pages,
            "tokens": stats.total_pages * ready.page_size,
        }
    return JSONResponse({
        "version": __version__,
        "model": _model_description(state),
        "cpu_isa": ready.cpu_isa,
        "placement": state.backend.placement.to_dict(),
        "options": state.config.to_dict(),
        "pages": pages,
        "requests": None if stats is None else {"running": stats.num_running, "waiting": stats.num_waiting},
        "pids": {"server": os.getpid(), "scheduler": state.backend.scheduler.pid, "worker": state.backend.worker.pid},
        "engine": {"restarts": manager.restarts, "requests_recovered": manager.recovered,
                   "restarting": manager.restarting_reason},
    })


def _model_description(state: ServerState) -> dict[str, Any]:
    ready = state.ready
    return {
        "name": state.model_name, "path": ready.model_path, "dtype": ready.dtype, "device": ready.device,
        "context_len": ready.context_len, "vocab_size": ready.vocab_size, "page_size": ready.page_size,
        "kv_cache_dtype": ready.kv_cache_dtype, "kv_pool_tokens": ready.total_pages * ready.page_size,
        "weight_format": ready.weight_format,
    }


@handles_errors
async def model_info(request: Request) -> Response:
    """SGLang's `/model_info`: what `sgl.RuntimeEndpoint` and `bench_serving` read."""
    state = _state(request)
    return JSONResponse({
        "model_path": state.ready.model_path, "tokenizer_path": state.ready.model_path,
        "served_model_name": state.model_name, "is_generation": True,
        "preferred_sampling_params": None, "weight_version": "default",
    })


@handles_errors
async def abort_request(request: Request) -> Response:
    """SGLang's `/abort_request`: `{"rid": ...}` (the rid the caller gave; every sample of
    that request) or `{"abort_all": true}`. The aborted requests finish with
    `finish_reason.type == "abort"`; `aborted` counts the requests found in flight (0 for an
    unknown or finished rid, which is not an error). With --api-key-file, only the caller's
    tenant's requests."""
    state = _state(request)
    body = await read_json(request, state.config.max_body_bytes)
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if type(abort_all) is not bool:
        raise InvalidRequest("`abort_all` must be a boolean", param="abort_all")
    if not abort_all and (not isinstance(rid, str) or not rid):
        raise InvalidRequest("give `rid` (a request id) or `abort_all: true`", param="rid")
    manager = state.get_manager()
    tenant = request.scope.get(SCOPE_KEY)  # --api-key-file: a tenant aborts only its own requests
    aborted = manager.abort_all(tenant) if abort_all else int(manager.abort(rid, tenant))
    return JSONResponse({"aborted": aborted})


@handles_errors
async def flush_cache(request: Request) -> Response:
    done = await _state(request).get_manager().flush_cache()
    if done.ok:
        return JSONResponse({"ok": True, "freed_pages": done.freed_pages, "message": "the prefix cache is empty"})
    raise HTTPError(
        409, f"requests are running: their cached prefixes are locked and stay; the {done.freed_pages} "
        "unlocked pages were dropped", code="requests_running",
    )


# ---------------------------------------------------------------------- /generate


@handles_errors
async def generate(request: Request) -> Response:
    """SGLang's /generate: a result object for one prompt, a list for a batch or n > 1."""
    state = _state(request)
    body = await read_json(request, state.config.max_body_bytes)
    stream = _check_generate_fields(body)
    state.check_model(body.get("model"))  # SGLang's router adds `model` (null unless the client gave one)
    fields = {k: body[k] for k in _GENERATE_FIELDS - {"stream"} if body.get(k) is not None}
    requests, is_batch = await state.prepare(
        build_requests, state.tokenizer, state.ready, state.limits,
        default_recompute_ratio=state.config.segment_recompute_ratio, **fields,
    )
    scope_requests(request.scope, requests)
    many = is_batch or sum(r.sampling.n for r in requests) > 1
    if stream:
        return await _stream_generate(request, state, requests, many)
    results = await until_disconnect(request, state.collect(requests))
    if many:
        return JSONResponse([{**out, "index": pos} for pos, out in enumerate(results)])
    return JSONResponse(results[0])


def _check_generate_fields(body: dict[str, Any]) -> bool:
    """Reject unknown and unsupported fields and wrongly typed flags; returns `stream`."""
    for key, value in body.items():
        if key in _GENERATE_FIELDS or key == "model":
            continue
        if key in _GENERATE_LOGGING_FLAGS:
            if value is not None and type(value) is not bool:
                raise InvalidRequest(f"`{key}` must be a boolean", param=key)
            continue
        if key in _GENERATE_UNSUPPORTED:
            if value is None or value is False or (type(value) in (list, dict, str) and not value):
                continue
            raise InvalidRequest(f"`{key}` is not supported yet", param=key)
        raise InvalidRequest(f"unknown field `{key}`; known fields: {', '.join(sorted(_GENERATE_FIELDS))}", param=key)
    for key in ("stream", "return_text_in_logprobs"):
        if body.get(key) is not None and type(body[key]) is not bool:
            raise InvalidRequest(f"`{key}` must be a boolean", param=key)
    logprob = body.get("return_logprob")
    flags = logprob if isinstance(logprob, list) else [logprob]
    if not all(f is None or type(f) is bool for f in flags):
        raise InvalidRequest("`return_logprob` must be a boolean or a list of booleans", param="return_logprob")
    return bool(body.get("stream"))


async def _stream_generate(request: Request, state: ServerState, requests: list[GenerateRequest], many: bool) -> Response:
    """SSE of cumulative results; waits for the first one so a full queue is still a 503."""
    results = state.results(requests)
    first = await until_disconnect(request, anext(results))
    return SSEResponse(_generate_events(results, first, many))


async def _generate_events(
    results: AsyncIterator[tuple[int, dict[str, Any]]], first: tuple[int, dict[str, Any]], many: bool,
) -> AsyncIterator[bytes]:
    def event(pos: int, out: dict[str, Any]) -> bytes:
        return sse({**out, "index": pos} if many else out)

    async with aclosing(results):
        try:
            yield event(*first)
            async for pos, out in results:
                yield event(pos, out)
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            yield sse(to_http_error(exc).body())
    yield SSE_DONE


# ---------------------------------------------------------------------- /v1/models


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "radixserve",
        "root": state.ready.model_path, "max_model_len": state.ready.context_len,
    }


@handles_errors
async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(_state(request))]})


@handles_errors
async def get_model(request: Request) -> Response:
    state = _state(request)
    state.check_model(request.path_params["model"])
    return JSONResponse(_model_card(state))
