"""JSON beyond what json.dumps writes: numbers as raw text, objects with repeated keys, filler
sized to make a body exactly so many bytes; and JSON read back leniently (`json_or_none`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Raw:
    """JSON text written as it is: numbers json.dumps cannot write (5,000 digits, 1e400, -0)."""

    text: str


@dataclass(frozen=True)
class Pairs:
    """A JSON object written from (key, value) pairs, so that a key may repeat."""

    items: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Pad:
    """Filler text, sized when the body is encoded so that the whole body has `size` bytes."""

    size: int


_PAD_MARK = "\x00pad\x00"


def encode(value: Any, ascii_only: bool = True) -> bytes:
    """`value` as JSON bytes; lone surrogates are kept (as invalid UTF-8 unless `ascii_only`)."""
    out: list[str] = []
    _write(value, out, ascii_only)
    text = "".join(out)
    pad = next((v for v in _walk(value) if isinstance(v, Pad)), None)
    if pad is not None:
        mark = json.dumps(_PAD_MARK)
        room = pad.size - (len(text.encode("utf-8", "surrogatepass")) - len(mark)) - 2  # 2: the quotes
        text = text.replace(mark, json.dumps(("ab " * (pad.size // 3 + 1))[: max(0, room)]))
    return text.encode("utf-8", "surrogatepass")


def _write(v: Any, out: list[str], ascii_only: bool) -> None:
    if isinstance(v, Raw):
        out.append(v.text)
    elif isinstance(v, Pad):
        out.append(json.dumps(_PAD_MARK))
    elif isinstance(v, (dict, Pairs)):
        items = v.items if isinstance(v, Pairs) else v.items()
        out.append("{")
        for i, (k, item) in enumerate(items):
            out.append(("," if i else "") + json.dumps(k, ensure_ascii=ascii_only) + ":")
            _write(item, out, ascii_only)
        out.append("}")
    elif isinstance(v, (list, tuple)):
        out.append("[")
        for i, item in enumerate(v):
            out.append("," if i else "")
            _write(item, out, ascii_only)
        out.append("]")
    else:  # str, int, float (NaN and Infinity as Python writes them: not JSON), bool, None
        out.append(json.dumps(v, ensure_ascii=ascii_only))


def _walk(v: Any) -> Iterator[Any]:
    yield v
    if isinstance(v, dict):
        v = list(v.values())
    elif isinstance(v, Pairs):
        v = [item for _, item in v.items]
    if isinstance(v, (list, tuple)):
        for item in v:
            yield from _walk(item)


def json_or_none(raw: bytes) -> Any:
    """`raw` as JSON, or None when it is none (or more than Python reads)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, more digits than Python parses, or too deep
        return None
