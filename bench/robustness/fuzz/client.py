"""Sending one request the way its client behaves: through httpx, or over a plain socket to hang
up early, send slowly or chunked, or send past the body limit and still read the answer."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.robustness.fuzz.request import FuzzRequest


@dataclass
class Answer:
    """What the client got: a status (None: the connection ended without one), the body, and
    for an event stream its `data:` payloads and whether it ended with [DONE]."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    events: list[str] | None = None
    done: bool = False
    left: bool = False  # the client hung up on purpose
    error: str | None = None  # how the connection failed


async def send(client: httpx.AsyncClient, req: FuzzRequest, timeout: float = 60.0) -> Answer:
    """Send one request the way its `mode` says; transport failures become `Answer.error`."""
    if req.mode in ("plain", "leave-stream"):
        return await _send_httpx(client, req, timeout)
    return await _send_raw(urlsplit(str(client.base_url)), req)


async def _send_httpx(client: httpx.AsyncClient, req: FuzzRequest, timeout: float) -> Answer:
    content = None if req.body is None else req.payload()
    headers = {**_content_type(req), **req.headers} if content is not None else req.headers
    try:
        async with client.stream(req.method, req.path, content=content, headers=headers, timeout=timeout) as r:
            ans = Answer(r.status_code, dict(r.headers))
            if not (r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream")):
                ans.body = await r.aread()
                return ans
            ans.events = []
            async for line in r.aiter_lines():
                if req.mode == "leave-stream" and len(ans.events) >= req.leave_after:
                    ans.left = True
                    return ans  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    ans.done = True
                elif line.startswith("data: "):
                    ans.events.append(line[6:])
            return ans
    except httpx.TransportError as exc:
        return Answer(error=f"{type(exc).__name__}: {exc}")


async def _send_raw(url: Any, req: FuzzRequest) -> Answer:
    """Over a plain socket: hang up early (`leave`), send the body slowly (`slow`) or chunked
    (`chunked`), or send a body past the limit (`big`) and still read the 413."""
    payload = req.payload()
    # Host names the port too (RFC 9110: without one it means port 80), as real clients send it
    head = [f"{req.method} {req.path} HTTP/1.1", f"Host: {url.netloc}", "Connection: close"]
    sent = {**_content_type(req), **req.headers} if req.body is not None else req.headers  # as _send_httpx
    head += [f"{k}: {v}" for k, v in sent.items()]
    pieces = [payload]
    if req.mode in ("slow", "chunked"):
        step = -(-len(payload) // req.pieces) or 1
        pieces = [payload[i : i + step] for i in range(0, len(payload), step)] or [b""]
    if req.mode == "chunked":
        head.append("Transfer-Encoding: chunked")
        pieces = [f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces if p] + [b"0\r\n\r\n"]
    else:
        head.append(f"Content-Length: {len(payload)}")
    try:
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
    except OSError as exc:
        return Answer(error=f"connect: {exc}")
    try:
        sent_error = None
        try:
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
            for i, piece in enumerate(pieces):
                if i and req.mode == "slow":
                    await asyncio.sleep(0.3)
                writer.write(piece)
                await writer.drain()
        except OSError as exc:
            sent_error = f"{type(exc).__name__} while sending: {exc}"
        if req.mode == "leave":
            await asyncio.sleep(req.leave_after / 1000)
            return Answer(left=True)
        buf = bytearray()
        with contextlib.suppress(OSError):
            while chunk := await reader.read(1 << 16):
                buf += chunk
        ans = _parse_http(bytes(buf))
        if ans.status is None:
            ans.error = sent_error or "the connection closed without an answer"
        return ans
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def _content_type(req: FuzzRequest) -> dict[str, str]:
    return {} if req.content_type is None else {"Content-Type": req.content_type}


def _parse_http(raw: bytes) -> Answer:
    head, sep, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if not sep or len(parts) < 2 or not parts[1].isdigit():
        return Answer()
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        rest = _dechunk(rest)
    ans = Answer(int(parts[1]), headers, rest)
    if ans.status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
        datas = [line[6:] for line in rest.decode("utf-8", "replace").split("\n") if line.startswith("data: ")]
        ans.done = bool(datas) and datas[-1] == "[DONE]"
        ans.events = [d for d in datas if d != "[DONE]"]
    return ans


def _dechunk(data: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            return bytes(out)
        size = int(data[pos:end].split(b";")[0] or b"0", 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2 : end + 2 + size]
        pos = end + 4 + size
