"""`EngineBackend`: programs on an in-process `radixserve.Engine`, no HTTP in between."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import closing
from typing import Any

from frontend_lang.backends.base import Backend, BackendError
from frontend_lang.chat_template import ChatTemplate


class EngineBackend(Backend):
    """Calls `engine.generate` directly. The chat template is the engine's tokenizer's unless
    `chat_template` is given. Errors become BackendError with the status HTTP would give."""

    def __init__(self, engine: Any, chat_template: ChatTemplate | None = None) -> None:
        self.engine = engine
        self._template = chat_template
        self._lock = threading.Lock()

    def generate(self, request: dict[str, Any]) -> Any:
        try:
            return self.engine.generate(**_engine_kwargs(request))
        except Exception as exc:
            error = _backend_error(exc)
            if error is None:
                raise
            raise error from exc

    def generate_stream(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        try:
            # closing: a consumer that stops early aborts the request and frees its pages
            with closing(self.engine.generate(stream=True, **_engine_kwargs(request))) as stream:
                yield from stream
        except Exception as exc:
            error = _backend_error(exc)
            if error is None:
                raise
            raise error from exc

    def pin(self, text: str, *, tier: str = "memory", ttl: float | None = None,
            cache_salt: str | None = None) -> dict[str, Any]:
        try:
            return self.engine.pin(text, tier=tier, ttl=ttl, cache_salt=cache_salt)
        except Exception as exc:
            error = _backend_error(exc)
            if error is None:
                raise
            raise error from exc

    def unpin(self, pin_id: int) -> list[dict[str, Any]]:
        return self.engine.unpin(pin_id)

    @property
    def chat_template(self) -> ChatTemplate:
        with self._lock:
            if self._template is None:
                self._template = ChatTemplate.from_tokenizer(self.engine.tokenizer)
            return self._template


def _engine_kwargs(request: dict[str, Any]) -> dict[str, Any]:
    kwargs = {k: v for k, v in request.items() if k != "text"}
    if "text" in request:
        kwargs["prompt"] = request["text"]
    return kwargs


def _backend_error(exc: Exception) -> BackendError | None:
    """The runtime's exceptions as BackendError, with the HTTP server's status for each."""
    from radixserve.front.types import EngineDead, InvalidRequest, RequestFailed

    if isinstance(exc, InvalidRequest):
        return BackendError(exc.message, 400)
    if isinstance(exc, EngineDead):
        return BackendError(f"the server cannot serve requests: {exc.message}", 503)
    if isinstance(exc, RequestFailed):
        return BackendError(exc.message, 503 if exc.retryable else 400)
    return None
