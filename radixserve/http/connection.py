"""Deadlines on what a client sends: a connection that is slow to send a request's head or body
is closed, so slow clients ("slowloris") cannot hold connections, and their memory, for ever.

uvicorn closes idle connections between requests (`timeout_keep_alive`), but nothing else: a
connection that sends nothing, or a header a byte every few seconds, or a body that never ends,
stays open. `deadline_protocol` is uvicorn's h11 protocol with two deadlines, following h11's
view of the client (`their_state`):

    connect, or the first byte of a request --header_timeout--> the head is complete
      (IDLE: owes a head)                                       else closed
    the head is complete --body_timeout--> the body is complete
      (SEND_BODY: owes a body)             else 408 (when no answer was started) and closed

Between requests uvicorn's keep-alive timer is in charge. A route that answers without reading
the whole body (a 413, a 401) still leaves the client `body_timeout` to finish sending it.
The h11 protocol is pinned (not "auto") so the deadlines hold whichever HTTP parsers are installed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from radixserve.http.common import HTTPError

log = logging.getLogger("radixserve.http")

_HEAD, _BODY = "head", "body"


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head and on its body."""

    header_timeout: ClassVar[float] = 10.0
    body_timeout: ClassVar[float] = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None  # what the running deadline is for: _HEAD, _BODY or none
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._expect(_HEAD)  # a new connection owes a request head

    def data_received(self, data: bytes) -> None:
        if self._phase is None and self.conn.their_state is h11.IDLE:
            self._expect(_HEAD)  # the first bytes of the next request's head
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect(None)
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Move the deadline along with the client's state."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._expect(_BODY)
        elif state is h11.IDLE:
            if self._phase == _BODY:  # a body, then part of the next head, in one read
                self._expect(_HEAD)
        else:
            self._expect(None)

    def _expect(self, phase: str | None) -> None:
        """Start the deadline of `phase`; one already running for it keeps its time."""
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            timeout = self.header_timeout if phase == _HEAD else self.body_timeout
            self._deadline = self.loop.call_later(timeout, self._expired)

    def _expired(self) -> None:
        phase, self._phase, self._deadline = self._phase, None, None
        if self.transport.is_closing():
            return
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        if phase == _BODY:
            log.info("%s sent no complete request body within %g s; closing the connection", peer, self.body_timeout)
            self._answer_408()
        else:
            log.debug("%s sent no complete request head within %g s; closing the connection", peer, self.header_timeout)
        self.transport.close()

    def _answer_408(self) -> None:
        """408 when the route has not started an answer; the route then reads a disconnect (and
        its own answer, if it sends one, goes nowhere)."""
        cycle = self.cycle
        if cycle is None or cycle.response_started or self.conn.our_state is not h11.SEND_RESPONSE:
            return
        error = HTTPError(408, f"the request body did not arrive within {self.body_timeout:g} s", code="request_timeout")
        payload = msgspec.json.encode(error.body())
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload)), (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"), h11.Data(data=payload), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event) or b"")
        except h11.LocalProtocolError:
            pass  # h11 will not write it in this state; closing says enough
        cycle.disconnected = True
        cycle.message_event.set()


def deadline_protocol(header_timeout: float, body_timeout: float) -> type[DeadlineH11Protocol]:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`), with these deadlines."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"header_timeout": header_timeout, "body_timeout": body_timeout})
