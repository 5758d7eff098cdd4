"""`fl.pin`: keep a document or a system prompt cached on the server on purpose.

A RAG program that asks many questions about one document, or an agent whose every call starts
with the same system prompt and tool descriptions, pays for that prefix once; pinning it keeps
it from being evicted by other traffic in between (``POST /cache/pin``):

    doc = open("manual.txt").read() + "\\n"
    pin = fl.pin(doc)                 # computed now if need be, kept until unpinned
    state = ask.run(doc=doc, question="...")   # a program whose text starts with `doc`
    fl.unpin(pin["pin_id"])

The pinned text is tokenized as the server tokenizes a prompt, so it matches the start of a
program's text token for token when the program's text begins with it and it ends where the
tokenization cannot merge across (a newline does).
"""

from __future__ import annotations

from typing import Any

from frontend_lang.backends import Backend
from frontend_lang.program import get_default_backend


def pin(text: str, *, tier: str = "memory", ttl: float | None = None, cache_salt: str | None = None,
        backend: Backend | None = None) -> dict[str, Any]:
    """Pin `text`'s prefix in the KV pool (tier "memory") or in the disk tier ("disk", a server
    with --kv-disk-dir), until `unpin` or `ttl` seconds. Returns the pin: ``pin_id``,
    ``tokens`` (pinned), ``cached_tokens`` (already cached before). Raises BackendError."""
    return _backend(backend).pin(text, tier=tier, ttl=ttl, cache_salt=cache_salt)


def unpin(pin_id: int, *, backend: Backend | None = None) -> list[dict[str, Any]]:
    """End a pin; returns the pins ended."""
    return _backend(backend).unpin(pin_id)


def _backend(backend: Backend | None) -> Backend:
    chosen = backend or get_default_backend()
    if chosen is None:
        raise ValueError("no backend: pass backend= or call fl.set_default_backend first")
    return chosen
