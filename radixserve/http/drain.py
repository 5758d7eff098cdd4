"""Graceful drain on SIGTERM/SIGINT: stop admitting, let what is in flight finish, then exit.

uvicorn's own shutdown closes the listener at the first signal, so a client arriving during the
drain is refused a connection (and a load balancer cannot tell a drain from a crash). Here the
first signal only sets `ServerState.draining`: the listener stays open and `DrainMiddleware`
answers new requests 503 + Retry-After (code `shutting_down`), while the requests in flight run
to the end. uvicorn's shutdown starts once none is left, or when `--shutdown-timeout` passes or a
second signal comes: then the rest fail at once with an error saying so (`fail_all`), rather
than being cut off mid-stream without a word.
"""

from __future__ import annotations

import logging
import time
import types

import uvicorn

from radixserve.http.state import ServerState

log = logging.getLogger("radixserve.http")

ERROR_GRACE_S = 5  # uvicorn's own wait, once the drain ends, for the last answers to be written


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, timeout: float) -> None:
        super().__init__(config)
        self._state = state
        self._timeout = timeout
        self._signals = 0
        self._since = 0.0

    def handle_exit(self, sig: int, frame: types.FrameType | None) -> None:
        """A signal handler: only counts, `on_tick` (in the event loop) acts on it."""
        self._signals += 1
        if self.should_exit:  # already in uvicorn's shutdown: a further signal forces it
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._state.engine_lost is not None and not self.should_exit:
            # every request has failed with the reason (503): exit, non-zero, for a supervisor
            log.error("exiting: the engine is lost (%s)", self._state.engine_lost)
            self.should_exit = True
        if self._signals and not self.should_exit:
            self._drain_step()
        return await super().on_tick(counter)

    def _drain_step(self) -> None:
        state = self._state
        if not state.draining:
            state.draining = True
            self._since = time.monotonic()
            log.info("draining: %d requests in flight get up to %g s to finish; new ones get 503",
                     state.in_flight, self._timeout)
        if state.in_flight == 0:
            log.info("drained")
            self.should_exit = True
        elif self._signals > 1:
            self._abort(f"a second signal stopped the drain with {state.in_flight} requests in flight")
        elif time.monotonic() - self._since >= self._timeout:
            self._abort(f"--shutdown-timeout ({self._timeout:g} s) passed with {state.in_flight} requests in flight")

    def _abort(self, why: str) -> None:
        log.warning("shutting down: %s; they fail", why)
        if self._state.manager is not None:
            self._state.manager.fail_all(f"the server is shutting down ({why}); this request did not finish")
        self.should_exit = True
