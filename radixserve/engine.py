"""`radixserve.Engine`: the runtime in-process, for Python programs.

    with Engine(model="default", page_size=16) as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
        print(out["text"], out["meta_info"]["cached_tokens"])

The scheduler and worker run in their own processes; the front (tokenizer, detokenizer) runs
in a background thread's event loop, so `generate` works from plain code and `async_generate`
from any event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec

from radixserve.config import ServerConfig
from radixserve.front.manager import TokenizerManager
from radixserve.front.recovery import BackendEvents
from radixserve.front.types import GenerateRequest, RequestFailed
from radixserve.front.validation.inputs import build_prefix, build_requests, check_pin_options
from radixserve.front.validation.limits import request_limits
from radixserve.launch import Backend
from radixserve.tokenizer import import_in_background, load_tokenizer

_DONE = object()


class Engine:
    """Starts the scheduler and worker; options are the CLI's flags with underscores."""

    def __init__(self, model: str = "default", **options: Any) -> None:
        self.config = ServerConfig.from_kwargs(model=model, **options)
        self._backend = Backend(self.config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="radixserve-front", daemon=True)
        self._closed = False
        importing = import_in_background()
        self.ready = self._backend.start()
        importing.join()
        try:
            self.tokenizer = load_tokenizer(self.ready.model_path)
            self.limits = request_limits(self.config, self.ready, self.tokenizer)
            self._thread.start()
            self.manager = TokenizerManager(self._backend.endpoints, self.ready, self.tokenizer)
            self._call(self._start_manager())
            # a crashed engine restarts and its requests resume (front/recovery.py); past
            # --max-restarts they fail with RequestFailed
            self._backend.watch(BackendEvents(self.manager, self._loop))
        except BaseException:
            self.shutdown()
            raise

    async def _start_manager(self) -> None:
        self.manager.start(self._backend.receiver)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        *,
        segments: list[str] | None = None,
        segment_recompute_ratio: float | None = None,
        **kwargs: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict back) or a list (a list back, n results per prompt).

        `segments` instead of `prompt` / `input_ids`: one prompt as pieces, whose pieces but the
        last (the question) may reuse cached KV wherever they sit; `segment_recompute_ratio`
        overrides the engine's share of their tokens recomputed (docs/engine.md).
        kwargs: return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs,
        rid, cache_salt, segment_reuse. With `stream=True` (one prompt), an iterator of cumulative
        results. Raises `InvalidRequest` for bad input and `RequestFailed` when a request cannot
        be served.
        """
        kwargs.update(segments=segments, segment_recompute_ratio=segment_recompute_ratio)
        requests, is_batch = self._build(prompt, input_ids, sampling_params, kwargs)
        if stream:
            return self._stream_sync(requests)
        return self._call(self._collect(requests, is_batch))

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        *,
        segments: list[str] | None = None,
        segment_recompute_ratio: float | None = None,
        **kwargs: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """`generate` for asyncio callers; with `stream=True` an async iterator."""
        kwargs.update(segments=segments, segment_recompute_ratio=segment_recompute_ratio)
        requests, is_batch = self._build(prompt, input_ids, sampling_params, kwargs)
        if stream:
            return self._stream_async(requests)
        fut = asyncio.run_coroutine_threadsafe(self._collect(requests, is_batch), self._loop)
        return await asyncio.wrap_future(fut)

    def _build(self, prompt: Any, input_ids: Any, sampling_params: Any, kwargs: dict[str, Any]) -> tuple[list[GenerateRequest], bool]:
        return build_requests(
            self.tokenizer, self.ready, self.limits, text=prompt, input_ids=input_ids,
            sampling_params=sampling_params, default_recompute_ratio=self.config.segment_recompute_ratio, **kwargs,
        )

    async def _collect(self, requests: list[GenerateRequest], is_batch: bool) -> Any:
        async def one(req: GenerateRequest) -> list[dict[str, Any]]:
            final: dict[int, dict[str, Any]] = {}
            async for out in self.manager.generate(req):
                final[out["index"]] = out
            return [final[i] for i in range(req.sampling.n)]

        self.manager.check_rids_free([r.rid for r in requests])
        per_request = await asyncio.gather(*(one(r) for r in requests))
        flat = [item for outs in per_request for item in outs]
        if not is_batch and len(flat) == 1:
            return flat[0]
        return flat

    def _stream_sync(self, requests: list[GenerateRequest]) -> Iterator[dict[str, Any]]:
        if len(requests) != 1:
            raise RequestFailed("streaming takes one prompt at a time")
        agen = self.manager.generate(requests[0])
        try:
            while True:
                item = self._call(_next_or_done(agen))
                if item is _DONE:
                    return
                yield item
        finally:
            self._call(agen.aclose())

    async def _stream_async(self, requests: list[GenerateRequest]) -> AsyncIterator[dict[str, Any]]:
        if len(requests) != 1:
            raise RequestFailed("streaming takes one prompt at a time")
        agen = self.manager.generate(requests[0])
        try:
            while True:
                fut = asyncio.run_coroutine_threadsafe(_next_or_done(agen), self._loop)
                item = await asyncio.wrap_future(fut)
                if item is _DONE:
                    return
                yield item
        finally:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop))

    # ------------------------------------------------------------------ pins

    def pin(self, prompt: str | None = None, input_ids: list[int] | None = None, *, tier: str = "memory",
            ttl: float | None = None, cache_salt: str | None = None) -> dict[str, Any]:
        """Keep a prefix cached on purpose (computed first if need be), as ``POST /cache/pin``:
        in the KV pool (tier "memory") or the disk tier ("disk"), until `unpin` or `ttl` seconds.
        Returns the pin (``pin_id``, ``tokens``, ``cached_tokens``, ...); raises `InvalidRequest`
        for bad input and `RequestFailed` when its budget (--max-pinned-fraction) is full, or,
        retryable, when the waiting queue is full or max_pins_in_flight_per_tenant pins are
        being made (`TooManyPinsInFlight`)."""
        tier, ttl = check_pin_options(tier, ttl, bool(self.config.kv_disk_dir))
        ids, salt = build_prefix(self.tokenizer, self.ready, self.limits, text=prompt, input_ids=input_ids,
                                 cache_salt=cache_salt)
        done = self._call(self.manager.pin(ids, salt, tier, ttl))
        if done.pin is None:
            raise RequestFailed(done.error or "the prefix could not be pinned")
        return {**msgspec.structs.asdict(done.pin), "cached_tokens": done.cached_tokens}

    def unpin(self, pin_id: int | None = None, prompt: str | None = None, input_ids: list[int] | None = None,
              cache_salt: str | None = None) -> list[dict[str, Any]]:
        """End the pin `pin_id`, or the pins of exactly this prefix; returns those ended."""
        if pin_id is not None:
            released = self._call(self.manager.unpin([pin_id], [], None)).pins
        else:
            ids, salt = build_prefix(self.tokenizer, self.ready, self.limits, text=prompt, input_ids=input_ids,
                                     cache_salt=cache_salt)
            released = self._call(self.manager.unpin([], ids, salt)).pins
        return [msgspec.structs.asdict(p) for p in released]

    def pins(self) -> list[dict[str, Any]]:
        return [msgspec.structs.asdict(p) for p in self._call(self.manager.pins()).pins]

    # ------------------------------------------------------------------ admin

    def flush_cache(self) -> bool:
        return self._call(self.manager.flush_cache()).ok

    def get_stats(self) -> dict[str, Any]:
        stats = self._call(self.manager.stats())
        return {f: getattr(stats, f) for f in stats.__struct_fields__ if f != "req_id"}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            if hasattr(self, "manager"):
                self._call(self.manager.shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._backend.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.shutdown()


async def _next_or_done(agen: AsyncIterator[dict[str, Any]]) -> Any:
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return _DONE
