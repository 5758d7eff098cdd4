"""What the HTTP routes share: the server's state, preparing requests off the event loop, and
running a batch of requests through the `TokenizerManager` as one stream of results (with latency
metrics recorded as they finish)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from radixserve.config import ServerConfig
from radixserve.front.manager import TokenizerManager
from radixserve.front.types import EngineDead, GenerateRequest
from radixserve.front.validation.limits import Limits, request_limits
from radixserve.http.common import HTTPError, merge
from radixserve.http.metrics import ServerMetrics
from radixserve.launch import Backend
from radixserve.protocol import WorkerInfo

T = TypeVar("T")
# Threads that tokenize and render chat templates. The tokenizer releases the GIL, so the event
# loop keeps serving while they work; two keep one long prompt from holding up every other
# request, and bound the memory that prompts being tokenized take together.
PREPARE_THREADS = 2


@dataclass
class ServerState:
    """Everything a route needs. `manager` is set once the server's event loop runs."""

    config: ServerConfig
    backend: Backend
    ready: WorkerInfo
    tokenizer: Any
    limits: Limits = field(init=False)  # per-request caps; prompts x n capped at the queue's size
    prepare_pool: ThreadPoolExecutor = field(init=False, repr=False)
    metrics: ServerMetrics = field(init=False)  # labelled with the served model's name
    created: int = field(default_factory=lambda: int(time.time()))
    manager: TokenizerManager | None = None
    health_probe: asyncio.Future[str | None] | None = None  # the one-token probe /health runs when idle
    tenants_on: bool = False  # --api-key-file: every request must carry its key's tenant
    draining: bool = False  # SIGTERM: new requests get 503 while those in flight finish
    in_flight: int = 0  # HTTP requests in progress (DrainMiddleware), what a drain waits for
    engine_lost: str | None = None  # no engine restart is left: the server exits non-zero

    def __post_init__(self) -> None:
        self.limits = request_limits(self.config, self.ready, self.tokenizer)
        self.metrics = ServerMetrics(self.config.model_name)
        self.metrics.describe_pool(self.ready.kv_cache_dtype, self.ready.total_pages * self.ready.page_size)
        self.prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="radixserve-prepare")

    async def prepare(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in the prepare threads: parsing a request means tokenizing it
        (or rendering a chat template), which takes time in proportion to the prompt; on the
        event loop, one big prompt would hold up every route, /health included."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.prepare_pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Stop the prepare threads (a prompt being tokenized finishes; nobody waits for it)."""
        self.prepare_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def get_manager(self) -> TokenizerManager:
        if self.manager is None:
            raise EngineDead("the server is not started yet")
        return self.manager

    def check_model(self, model: Any) -> None:
        """OpenAI's `model` field: absent, or the served model's name (else 404, like vLLM)."""
        if model is None:
            return
        if not isinstance(model, str):
            raise HTTPError(400, "`model` must be a string", param="model")
        if model != self.model_name:
            raise HTTPError(
                404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                param="model", code="model_not_found",
            )

    async def results(self, requests: list[GenerateRequest]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Cumulative results of every sequence as they come, tagged with the sequence's position
        (prompt-major: prompt i's n samples are consecutive). Closing the stream aborts the rest."""
        manager = self.get_manager()
        if self.tenants_on and any(r.tenant is None for r in requests):
            # fail closed: a route that forgot `tenants.scope_requests` would share a namespace
            raise RuntimeError("a request without a tenant on a server with --api-key-file")
        manager.check_rids_free([r.rid for r in requests], requests[0].tenant if requests else None)
        offsets = list(itertools.accumulate((r.sampling.n for r in requests), initial=0))
        streams = [manager.generate(r) for r in requests]
        async with aclosing(merge(streams)) as merged:
            async for i, out in merged:
                if out["meta_info"]["finish_reason"] is not None:
                    self.metrics.observe_finished(out["meta_info"], requests[i].tenant)
                yield offsets[i] + out.pop("index"), out

    async def collect(self, requests: list[GenerateRequest]) -> list[dict[str, Any]]:
        """The final result of every sequence, in order."""
        final: dict[int, dict[str, Any]] = {}
        async for pos, out in self.results(requests):
            final[pos] = out
        return [final[pos] for pos in sorted(final)]
