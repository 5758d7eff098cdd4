"""HTTP plumbing shared by the native and OpenAI routes: bounded JSON bodies, one error shape,
server-sent events, merging the streams of several requests, and aborting on disconnect.

Every error body has OpenAI's shape, on every route:
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.front.types import (
    EngineDead,
    InvalidRequest,
    RequestCrashedEngine,
    RequestFailed,
    RidInUse,
    TooManyPinsInFlight,
    json_type,
)

log = logging.getLogger("radixserve.http")

T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"
RETRY_AFTER_S = "1"
_encoder = msgspec.json.Encoder()
_PROMOTE_AFTER_BYTES = 1 << 20  # see _decode


class HTTPError(Exception):
    """An error answer: status, a message for the client, and the OpenAI error fields."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client closed the connection (or the server closed it, see `connection.py`); the
    request was aborted and nobody reads an answer. Routine, so never logged as an error."""


class JSONResponse(Response):
    """JSON via msgspec: fast, and non-finite floats (a -inf logprob) become null, never a 500."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _encoder.encode(content)


def to_http_error(exc: BaseException) -> HTTPError:
    """What the client is told for an exception of the front or the runtime."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, InvalidRequest):
        return HTTPError(400, exc.message, param=exc.param)
    if isinstance(exc, EngineDead):
        return HTTPError(503, f"the server cannot serve requests: {exc.message}", code="engine_dead")
    if isinstance(exc, RequestCrashedEngine):
        return HTTPError(500, exc.message, code="request_crashed_engine")
    if isinstance(exc, RidInUse):
        return HTTPError(409, exc.message, param="rid", code="rid_in_use")
    if isinstance(exc, TooManyPinsInFlight):
        return HTTPError(429, exc.message, code="too_many_pins_in_flight", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, RecursionError):  # a JSON walker (dumps, a schema check) met the client's nesting
        return HTTPError(400, "the request is nested too deeply to process")
    if isinstance(exc, RequestFailed):
        if exc.retryable:
            return HTTPError(503, exc.message, code="overloaded", headers={"Retry-After": RETRY_AFTER_S})
        return HTTPError(400, exc.message)
    log.exception("unexpected error while serving a request", exc_info=exc)
    return HTTPError(500, f"internal error: {type(exc).__name__}")


def handles_errors(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Coroutine[Any, Any, Response]]:
    """Wrap a route so that every failure becomes a JSON error answer."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ClientGone:
            log.debug("%s %s: the client disconnected", request.method, request.url.path)
            return Response(status_code=499)  # nobody is listening; uvicorn drops it
        except Exception as exc:  # noqa: BLE001 - every error becomes an answer, never a crash
            return to_http_error(exc).response()

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 past `max_bytes` (checked while reading), 415
    unless it is declared `application/json`.
    A client that hangs up mid-body is `ClientGone`; one too slow to send it is cut off by the
    connection's body deadline (`connection.py`), which reads here as a hang-up too."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPError(413, f"the request body ({declared} bytes) exceeds the limit of {max_bytes} bytes", code="body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise HTTPError(413, f"the request body exceeds the limit of {max_bytes} bytes", code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    raw = b"".join(chunks)
    _check_json_content_type(request)  # after the size limit: a body too big is a 413 whatever its type
    if not raw.strip():
        raise HTTPError(400, "the request body is empty; send a JSON object")
    try:
        body = _decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise HTTPError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise HTTPError(400, "the request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise HTTPError(400, f"the request body must be a JSON object, got {json_type(body)}")
    return body


def _check_json_content_type(request: Request) -> None:
    """415 unless the body is declared `application/json` (parameters such as `; charset=utf-8`
    allowed). A web page can send `text/plain` or a form to any site without a CORS preflight;
    it cannot send `application/json` cross-origin without one, so a JSON route that insists on
    it is out of reach of a foreign page even before the Origin check (`http/origins.py`)."""
    declared = request.headers.get("content-type", "")
    if declared.split(";", 1)[0].strip().lower() != "application/json":
        shown = repr(declared[:100]) if declared else "none"
        raise HTTPError(415, f"the request body must be sent as `Content-Type: application/json` (got {shown})",
                        code="unsupported_media_type")


def _decode(raw: bytes) -> Any:
    """JSON with the garbage collector paused. A body of millions of small arrays sets off
    collection after collection while they are built: 5.8 s for 32 MB of `[],` against 1 s
    paused, on the event loop (a thread would not help: msgspec holds the GIL throughout).

    After a big body, every object tracked so far moves to the oldest generation (freeze, then
    unfreeze): else the next young collection, a few hundred allocations later, would walk the
    millions of new objects once more (1.2 s). A body is freed with its request, by refcount."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        body = msgspec.json.decode(raw)
        if len(raw) > _PROMOTE_AFTER_BYTES:
            gc.freeze()
            gc.unfreeze()
        return body
    finally:
        if enabled:
            gc.enable()


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work` unless the client goes away first; then cancel it (which aborts the request
    in the scheduler and frees its pages) and raise ClientGone.

    Starlette cancels nothing when a client leaves during a non-streaming answer, so the body
    must have been read already: what `receive` gives next is the disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        task.cancel()
        watcher.cancel()


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def sse(obj: Any) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream answer that closes its generator however the stream ends.

    Starlette stops iterating when the client disconnects but leaves the generator suspended;
    closing it runs its cleanup now, which aborts the requests behind it.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], **kwargs: Any) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, headers=headers, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's position.

    The first error of any stream is raised; closing the merged stream (or an error) cancels
    the others, which aborts their requests.
    """
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, end))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
