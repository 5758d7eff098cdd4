"""What the front resubmits to a restarted engine (front/recovery.py), without processes: the
`TokenizedRequest` is rebuilt from the request the caller made, so every field of it must come
back unchanged."""

from __future__ import annotations

import asyncio

from radixserve.front.recovery import LiveRequest
from radixserve.front.types import GenerateRequest
from radixserve.protocol import RequestOutput, SamplingParams


def test_a_resubmitted_request_keeps_its_segments_and_recompute_ratio() -> None:
    req = GenerateRequest(
        input_ids=list(range(1, 40)), sampling=SamplingParams(max_new_tokens=8, n=2),
        segments=[(0, 12), (12, 30)], segment_recompute_ratio=0.4, cache_salt="s",
    )
    live = LiveRequest(7, req, asyncio.Queue())
    first = live.submission()
    assert first.segments == [(0, 12), (12, 30)] and first.segment_recompute_ratio == 0.4
    assert first.resume == []
    live.sent = True
    live.record(RequestOutput(rid=7, index=1, new_token_ids=[5, 6], prompt_tokens=39, cached_tokens=30,
                              segment_tokens=18, recomputed_tokens=3))
    again = live.submission()
    assert again.rid == 7 and again.input_ids == req.input_ids and again.cache_salt == "s"
    assert again.segments == first.segments and again.segment_recompute_ratio == 0.4
    assert [(s.index, s.output_groups) for s in again.resume] == [(0, []), (1, [[5, 6]])]
    # the figures the first engine reported go with the resumed sample, for the caller to keep
    resumed = again.resume[1]
    assert (resumed.cached_tokens, resumed.segment_tokens, resumed.recomputed_tokens) == (30, 18, 3)


def test_a_request_without_segments_is_submitted_as_before() -> None:
    import msgspec

    req = GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams())
    submitted = LiveRequest(0, req, asyncio.Queue()).submission()
    assert submitted.segments == []
    assert b"segments" not in msgspec.msgpack.encode(submitted)  # a default: omitted on the wire
