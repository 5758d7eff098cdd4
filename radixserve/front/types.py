"""What the engine client hands its callers, and how it fails: the request it submits and the
error types that every entry point (HTTP, `Engine`, `frontend_lang`) maps to its own answers."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.config import ServerConfig
from radixserve.protocol import SamplingParams

_JSON_TYPES = {
    bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
    type(None): "null",
}


def json_type(value: Any) -> str:
    """The JSON name of a value's type, as the client wrote it, for error messages."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


MAX_ERROR_CHARS = 500  # of a validation message, which may quote a client's value (`shown`)


def shown(value: str, limit: int = 200) -> str:
    """A client's value as an error message quotes it: whole when short, else its start and its
    length. A message names what was wrong; echoing a 4,000-character path or a 4,000-digit id
    back makes the answer, and every log line of it, that long."""
    return value if len(value) <= limit else f"{value[:limit]}... (cut from {len(value)} characters)"


class InvalidRequest(ValueError):
    """A client error; ``param`` names the offending field for OpenAI-shaped error bodies. A
    message past `MAX_ERROR_CHARS` (one quoting a huge value) is cut, saying how long it was."""

    def __init__(self, message: str, param: str | None = None) -> None:
        message = shown(message, MAX_ERROR_CHARS)
        super().__init__(message)
        self.message = message
        self.param = param


class RequestFailed(RuntimeError):
    """A request could not be served. `retryable` (queue full) maps to HTTP 503."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable


class EngineDead(RequestFailed):
    """The scheduler or worker process is gone (or restarting, for the admin routes that ask
    it something now); HTTP 503."""


class RequestCrashedEngine(RequestFailed):
    """This request was in the failing step of two engines in a row (a poison request): it is
    not tried again, and the others go on (HTTP 500, naming it)."""

    def __init__(self, rid: str, failure: str) -> None:
        super().__init__(
            f"request {rid!r} made the engine fail twice ({failure}); it was not retried, and the "
            "engine serves the other requests"
        )


class TooManyPinsInFlight(RequestFailed):
    """The caller's tenant already has its bound of pins being made (--max-pins-in-flight-per-tenant;
    HTTP 429): it may pin again once one is answered."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


class RidInUse(RequestFailed):
    """The caller's rid labels a request still in flight (HTTP 409): rids name requests for
    `abort`, so two live ones cannot share one."""

    def __init__(self, rid: str) -> None:
        super().__init__(
            f"request id {rid!r} is in use by a request in flight; pick another, or wait for it to finish"
        )
        self.rid = rid


@dataclass
class GenerateRequest:
    """A validated, tokenized request as the front submits it.

    `rid` is the caller's label: echoed as `meta_info.id`, unique among this front's requests in
    flight, and what `abort` takes. It never leaves the front: each submission travels under an
    internal id of its own (`TokenizedRequest.rid`), so a label can be reused the moment its
    request ends, and can never name a sample or another request inside the runtime.
    """

    input_ids: list[int]
    sampling: SamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    cache_salt: str | None = None
    tenant: str | None = None  # from the API key (--api-key-file); only the front's metrics read it
    # reusable segments: token spans [start, end) of input_ids (`TokenizedRequest.segments`),
    # and the share of their tokens to recompute, resolved (the request's, else the server's)
    segments: list[tuple[int, int]] = field(default_factory=list)
    segment_recompute_ratio: float = ServerConfig.segment_recompute_ratio
