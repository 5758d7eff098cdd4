"""Pinning prefixes over HTTP: keep a document or a system prompt cached on purpose.

    POST /cache/pin     {"text" | "input_ids", "cache_salt"?, "tier"?: "memory" | "disk", "ttl"?}
                        computes the prefix if it is not cached and keeps its pages (the
                        scheduler's scheduler/pins.py); answers with the pin, or at once 409
                        (a budget), 429 (the tenant's pins in flight) or 503 (the queue)
                        {"segments": [...], ...}: each a segment, computed alone and kept in the
                        segment cache (docs/cache.md), one pin each, all or none
    POST /cache/unpin   {"pin_id"} or {"text" | "input_ids" | "segments", "cache_salt"?}: ends those pins
    GET  /cache/pins    the pins (with --api-key-file: the caller's tenant's only)

A tenant's pins live in its own cache namespace, like its requests, so it can neither pin into,
see nor unpin another tenant's. Pins belong to the engine: after an engine restart they must be
made again (the disk tier still holds the pages of tier "disk" pins, unpinned).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixserve.front.types import InvalidRequest, shown
from radixserve.front.validation.inputs import (
    build_prefix,
    build_segment_prefixes,
    check_pin_options,
)
from radixserve.http.common import HTTPError, JSONResponse, handles_errors, read_json
from radixserve.http.state import ServerState
from radixserve.http.tenants import SCOPE_KEY, namespace, salt_in
from radixserve.protocol import PinInfo

_PIN_FIELDS = frozenset({"text", "input_ids", "segments", "cache_salt", "tier", "ttl"})
_UNPIN_FIELDS = frozenset({"pin_id", "text", "input_ids", "segments", "cache_salt"})


def routes() -> list[Route]:
    return [
        Route("/cache/pin", pin, methods=["POST"]),
        Route("/cache/unpin", unpin, methods=["POST"]),
        Route("/cache/pins", list_pins, methods=["GET"]),
    ]


@handles_errors
async def pin(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await _body(request, state, _PIN_FIELDS)
    tier, ttl = check_pin_options(body.get("tier", "memory"), body.get("ttl"), bool(state.config.kv_disk_dir))
    if "segments" in body:
        return await _pin_segments(request, state, body, tier, ttl)
    ids, ns = await _prefix(request, state, body)
    done = await state.get_manager().pin(ids, ns, tier, ttl, tenant=request.scope.get(SCOPE_KEY))
    if done.pin is None:
        raise HTTPError(409, done.error or "the prefix could not be pinned", code="pin_refused")
    return JSONResponse({**_describe(request, done.pin), "cached_tokens": done.cached_tokens})


@handles_errors
async def unpin(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await _body(request, state, _UNPIN_FIELDS)
    manager = state.get_manager()
    if "pin_id" in body:
        if len(body) > 1:
            raise InvalidRequest("give `pin_id`, or the prefix (`text` or `input_ids`), not both", param="pin_id")
        pin_id = body["pin_id"]
        if type(pin_id) is not int:
            raise InvalidRequest("`pin_id` must be an integer", param="pin_id")
        mine = [p.pin_id for p in (await manager.pins()).pins if _visible(request, p)]
        released = (await manager.unpin([pin_id], [], None)).pins if pin_id in mine else []
        what = f"no pin {shown(str(pin_id))}"
    elif "segments" in body:
        prefixes, ns = await _segment_prefixes(request, state, body)
        released = [p for ids in prefixes for p in (await manager.unpin([], ids, ns, segment=True)).pins]
        what = "no pin of those segments"
    else:
        ids, ns = await _prefix(request, state, body)
        released = (await manager.unpin([], ids, ns)).pins
        what = "no pin of that prefix"
    if not released:
        raise HTTPError(404, what, code="pin_not_found")
    return JSONResponse({"unpinned": [_describe(request, p) for p in released]})


@handles_errors
async def list_pins(request: Request) -> Response:
    state: ServerState = request.app.state.server
    pins = (await state.get_manager().pins()).pins
    return JSONResponse({"pins": [_describe(request, p) for p in pins if _visible(request, p)]})


async def _body(request: Request, state: ServerState, known: frozenset[str]) -> dict[str, Any]:
    body = await read_json(request, state.config.max_body_bytes)
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidRequest(f"unknown field `{unknown[0]}`; known: {', '.join(sorted(known))}", param=unknown[0])
    return body


async def _pin_segments(request: Request, state: ServerState, body: dict[str, Any], tier: str,
                        ttl: float | None) -> Response:
    """Pin each segment in the segment cache, one after the other; if one cannot be pinned,
    the ones just made are released again and the call fails as a single pin would."""
    prefixes, ns = await _segment_prefixes(request, state, body)
    manager = state.get_manager()
    made = []
    try:
        for ids in prefixes:
            done = await manager.pin(ids, ns, tier, ttl, tenant=request.scope.get(SCOPE_KEY), segment=True)
            if done.pin is None:
                raise HTTPError(409, done.error or "the segment could not be pinned", code="pin_refused")
            made.append(done)
    except BaseException:
        if made:
            await manager.unpin([d.pin.pin_id for d in made], [], None)
        raise
    return JSONResponse({"pins": [{**_describe(request, d.pin), "cached_tokens": d.cached_tokens} for d in made]})


async def _segment_prefixes(request: Request, state: ServerState,
                            body: dict[str, Any]) -> tuple[list[list[int]], str | None]:
    """The segments' token ids (tokenized in the prepare threads) and their namespace."""
    for other in ("text", "input_ids"):
        if other in body:
            raise InvalidRequest(f"`segments` cannot be combined with `{other}`", param="segments")
    prefixes, salt = await state.prepare(
        build_segment_prefixes, state.tokenizer, state.ready, state.limits, segments=body["segments"],
        cache_salt=body.get("cache_salt"),
    )
    tenant = request.scope.get(SCOPE_KEY)
    return prefixes, salt if tenant is None else namespace(tenant, salt)


async def _prefix(request: Request, state: ServerState, body: dict[str, Any]) -> tuple[list[int], str | None]:
    """The prefix's token ids and its namespace: the caller's tenant's, narrowed by its salt.
    Tokenized in the prepare threads, as /generate's prompts are: a long text tokenized on the
    event loop would hold up every route, /health included."""
    ids, salt = await state.prepare(
        build_prefix, state.tokenizer, state.ready, state.limits, text=body.get("text"),
        input_ids=body.get("input_ids"), cache_salt=body.get("cache_salt"),
    )
    tenant = request.scope.get(SCOPE_KEY)
    return ids, salt if tenant is None else namespace(tenant, salt)


def _visible(request: Request, info: PinInfo) -> bool:
    return salt_in(request.scope.get(SCOPE_KEY), info.cache_salt)[0]


def _describe(request: Request, info: PinInfo) -> dict[str, Any]:
    """A pin as its owner sees it: its own salt, not the tenant's namespace around it."""
    return {
        "pin_id": info.pin_id, "tokens": info.tokens, "tier": info.tier, "segment": info.segment,
        "cache_salt": salt_in(request.scope.get(SCOPE_KEY), info.cache_salt)[1],
        "created": info.created, "expires_at": info.expires_at,
    }
