"""The HTTP middlewares, outermost first: every answer counted by route and status, a draining
server's refusals, the Host and Origin rules (and CORS), and the API key (or the tenant keys of
--api-key-file)."""

from __future__ import annotations

from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.http.common import HTTPError, JSONResponse
from radixserve.http.metrics import ServerMetrics
from radixserve.http.origins import CORS_HEADERS, CORS_MAX_AGE, CORS_METHODS, OriginPolicy
from radixserve.http.state import ServerState
from radixserve.http.tenants import ADMIN_SCOPE_KEY, SCOPE_KEY, KeyHolder, Tenants


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every route except the `public` paths (/health, the chat
    page's files), compared in constant time (digests of equal length, so not even the key's
    length leaks). /health_generate, which may run a one-token request, needs the key.

    `keys` holds the single --api-key, or the keys of --api-key-file; with `per_tenant` (the
    file) the key's tenant is left in the scope (`tenants.SCOPE_KEY`) for the routes to derive
    the request's cache namespace, and whether it is an admin key (`tenants.ADMIN_SCOPE_KEY`)."""

    def __init__(self, app: ASGIApp, keys: Tenants, per_tenant: bool, public: frozenset[str]) -> None:
        self.app = app
        self._keys = keys
        self._per_tenant = per_tenant
        self._public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._public:
            await self.app(scope, receive, send)
            return
        holder = self._authorize(scope)
        if holder is not None:
            if self._per_tenant:
                scope[SCOPE_KEY] = holder.tenant
                scope[ADMIN_SCOPE_KEY] = holder.admin
            await self.app(scope, receive, send)
            return
        error = HTTPError(401, "a valid API key is required: send `Authorization: Bearer <key>`", code="invalid_api_key")
        response = error.response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _authorize(self, scope: Scope) -> KeyHolder | None:
        """Who holds the request's key (tenant "" for the single --api-key), or None: refused."""
        value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        holder = self._keys.identify(token.strip())
        return holder if scheme.lower() == b"bearer" else None


class ResponseCountMiddleware:
    """Counts every HTTP answer by route and status (radixserve_http_responses_total), from the
    outside, so that answers given before any route runs (a 401, a draining server's 503) count
    too. The route label is the declared path of the route the request's path matches, whatever
    the method (a 405 counts under its route), else `other`: a bounded set of values, whatever
    paths clients send. A request whose client left before any answer started counts nowhere."""

    def __init__(self, app: ASGIApp, routes: list[BaseRoute], metrics: ServerMetrics) -> None:
        self.app = app
        self._routes = [r for r in routes if isinstance(r, Route)]
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if status is not None:
                self._metrics.observe_response(self._route(scope), status)

    def _route(self, scope: Scope) -> str:
        for route in self._routes:
            if route.matches(scope)[0] is not Match.NONE:
                return route.path
        return "other"


class DrainMiddleware:
    """Counts the HTTP requests in progress (`ServerState.in_flight`, what a graceful drain waits
    for) and, once the server drains (`ServerState.draining`, set on SIGTERM), answers every new
    request with 503 + Retry-After instead of starting it: the listener stays open meanwhile, so
    a client or load balancer is told to go elsewhere rather than refused a connection."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            headers = {"Retry-After": "1"}
            if scope["path"] == "/health":
                response = JSONResponse({"status": "unhealthy", "reason": "the server is shutting down"},
                                        status_code=503, headers=headers)
            else:
                response = HTTPError(503, "the server is shutting down; retry on another replica or later",
                                     code="shutting_down", headers=headers).response()
            await response(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


class OriginMiddleware:
    """The rules of `http/origins.py`, before the API key (a CORS preflight carries no key) and
    any route: a `Host` that does not name the server gets 421, a foreign `Origin` not in
    --allowed-origins 403; an allowed one gets its preflight answered and
    `Access-Control-Allow-Origin` on every answer. Requests without `Origin` (every
    non-browser client) pass as before."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hosts = _header_values(scope, b"host")
        host = hosts[0] if hosts else None
        if len(set(hosts)) > 1 or not self.policy.host_ok(host):
            shown = repr(host[:100]) if host is not None else "none"
            error = HTTPError(421, f"the Host header {shown} does not name this server; start it with "
                              "--allowed-hosts NAME to accept that name", code="bad_host")
            await error.response()(scope, receive, send)
            return
        origins = _header_values(scope, b"origin")
        if not origins:
            await self.app(scope, receive, send)
            return
        origin = origins[0]
        if len(set(origins)) == 1 and self.policy.same_origin(origin, host):
            await self.app(scope, receive, send)
            return
        if len(set(origins)) > 1 or not self.policy.cross_origin_allowed(origin):
            error = HTTPError(403, f"cross-origin requests from {origin[:100]!r} are not allowed; start the "
                              "server with --allowed-origins to allow that origin", code="origin_not_allowed")
            await error.response()(scope, receive, send)
            return
        cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if scope["method"] == "OPTIONS" and _header_values(scope, b"access-control-request-method"):
            preflight = {**cors, "Access-Control-Allow-Methods": CORS_METHODS,
                         "Access-Control-Allow-Headers": CORS_HEADERS, "Access-Control-Max-Age": CORS_MAX_AGE}
            await Response(status_code=204, headers=preflight)(scope, receive, send)
            return

        async def cors_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(raw=list(message.get("headers", [])))
                headers["Access-Control-Allow-Origin"] = origin
                headers.append("Vary", "Origin")
                message = {**message, "headers": headers.raw}
            await send(message)

        await self.app(scope, receive, cors_send)


def _header_values(scope: Scope, name: bytes) -> list[str]:
    return [v.decode("latin-1") for k, v in scope["headers"] if k == name]
