"""The interface a program runs on: one /generate-shaped call, its streaming form, and the
chat template. `select`'s scoring is built on these, so every backend scores the same way."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from frontend_lang.chat_template import ChatTemplate
from frontend_lang.scoring import Scores, score_choices


class BackendError(RuntimeError):
    """A call the runtime refused or could not serve: its message, and the HTTP status when there is one."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message if status is None else f"{message} (status {status})")
        self.message = message
        self.status = status


class Backend(ABC):
    """Where a program's calls go. Implementations must be safe to call from many threads."""

    @abstractmethod
    def generate(self, request: dict[str, Any]) -> Any:
        """One /generate call: `request` has /generate's fields (`text`, or `segments` with
        `segment_reuse`; `sampling_params`, `return_logprob`, `logprob_start_len`, ...) but not
        `stream`. Returns /generate's answer:
        a result dict, or a list for a batch of texts or `n > 1`. Raises BackendError."""

    @abstractmethod
    def generate_stream(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The same call streamed (one text, n = 1): cumulative results, the last with
        `meta_info.finish_reason`. Closing the iterator early aborts the request."""

    @property
    @abstractmethod
    def chat_template(self) -> ChatTemplate:
        """How role blocks render for this backend's model. Raises ValueError when unknown."""

    def score(self, prompt: str, choices: Sequence[str]) -> Scores:
        """Log probability of each choice's tokens after `prompt` (see scoring.py)."""
        return score_choices(self.generate, prompt, choices)

    def pin(self, text: str, *, tier: str = "memory", ttl: float | None = None,
            cache_salt: str | None = None) -> dict[str, Any]:
        """Keep `text`'s prefix cached on the server (``POST /cache/pin``); the pin back."""
        raise BackendError(f"{type(self).__name__} cannot pin prefixes")

    def unpin(self, pin_id: int) -> list[dict[str, Any]]:
        """End a pin (``POST /cache/unpin``); the pins ended."""
        raise BackendError(f"{type(self).__name__} cannot pin prefixes")

    def close(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """Release connections; the backend is not used afterwards."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
