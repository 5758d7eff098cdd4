"""What is fuzzed (the server, as it describes itself) and one request of a plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.robustness.fuzz.encoding import encode, json_or_none

GENERATING = ("/generate", "/v1/completions", "/v1/chat/completions")
KEEP_BYTES = 1 << 20  # a body up to this size stays encoded for the whole run (`FuzzRequest.forget`)
_UNREAD = object()  # `FuzzRequest.sent_json` not decoded yet


@dataclass(frozen=True)
class Target:
    """What the strategies need to know about the server (read from /server_info)."""

    model_name: str
    vocab_size: int
    context_len: int
    max_body_bytes: int
    max_new_tokens: int = 4  # valid requests ask for at most this many tokens
    leaver_tokens: int = 64  # ... and clients that leave before the end for at most this many
    # the browser rules hold for the plan's foreign names (*.example): no --allowed-origins or
    # --allowed-hosts, not bound to every interface (docs/server.md, "Browsers")
    browser_rules: bool = True
    disk_tier: bool = False  # --kv-disk-dir given: pins may take tier "disk"

    @classmethod
    def from_server(cls, url: str, **caps: int) -> Target:
        return cls.from_info(httpx.get(url + "/server_info", timeout=60).raise_for_status().json(), **caps)

    @classmethod
    def from_info(cls, info: dict[str, Any], **caps: int) -> Target:
        model, options = info["model"], info["options"]
        wildcard = options["host"] in ("", "0.0.0.0", "::", "[::]")
        return cls(
            model_name=model["name"], vocab_size=model["vocab_size"], context_len=model["context_len"],
            max_body_bytes=options["max_body_bytes"],
            browser_rules=not options["allowed_origins"] and not options["allowed_hosts"] and not wildcard,
            disk_tier=options["kv_disk_dir"] is not None, **caps,
        )


@dataclass
class FuzzRequest:
    """One request of the plan and how its client behaves.

    `mode`: `plain` (read the whole answer, a stream too), `leave-stream` (hang up after
    `leave_after` events), `leave` (send, wait `leave_after` ms, hang up), `slow` (the body in
    `pieces` pieces, 0.3 s apart), `chunked` (chunked transfer encoding, no Content-Length).
    """

    method: str
    path: str
    route: str  # the route's name in the figures (a path template)
    body: Any = None  # None: no body; bytes: sent as they are; else a JSON value (with Raw, Pairs, Pad)
    ascii_only: bool = True
    mode: str = "plain"
    leave_after: int = 0
    pieces: int = 1
    content_type: str | None = "application/json"  # sent with a body (None: no Content-Type header)
    headers: dict[str, str] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    _payload: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _sent_json: Any = field(default=_UNREAD, init=False, repr=False, compare=False)
    _size: int | None = field(default=None, init=False, repr=False, compare=False)

    def payload(self) -> bytes:
        """The body's bytes, encoded once and kept (until `forget`): the client and the oracle
        read them several times, and encoding a megabyte body again at each look would load the
        cores the server and the probe share."""
        if self.body is None:
            return b""
        if isinstance(self.body, bytes):
            return self.body
        if self._payload is None:
            self._payload = encode(self.body, self.ascii_only)
            self._size = len(self._payload)
        return self._payload

    def size(self) -> int:
        """The body's length in bytes (remembered after `forget`)."""
        return self._size if self._size is not None else len(self.payload())

    def sent_json(self) -> Any:
        """The body as JSON, as the server reads it (None: no body, or none that is JSON),
        decoded once and kept (until `forget`)."""
        if self._sent_json is _UNREAD:
            self._sent_json = None if self.body is None else json_or_none(self.payload())
        return self._sent_json

    def forget(self) -> None:
        """Drop a big body's bytes and JSON once its answer is judged: a plan sends a hundred
        bodies of 32-64 MiB. Small ones stay (the report reads them)."""
        if self.size() > KEEP_BYTES:
            self._payload, self._sent_json = None, _UNREAD

    def describe(self, limit: int = 2000) -> dict[str, Any]:
        """The request for a report: everything but a long body's middle."""
        raw = self.payload()
        text = raw.decode("utf-8", "backslashreplace")
        if len(text) > limit:
            text = f"{text[: limit // 2]}...<{len(text) - limit} characters>...{text[-limit // 2 :]}"
        return {"method": self.method, "path": self.path, "mode": self.mode, "leave_after": self.leave_after,
                "pieces": self.pieces, "content_type": self.content_type, "headers": self.headers, "body_bytes": len(raw), "body": text,
                "tags": list(self.tags)}
