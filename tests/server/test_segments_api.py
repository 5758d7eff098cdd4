"""The segments API over HTTP on a server started with --disable-segment-cache: it still accepts
`segments` (on /generate and /v1/completions) and chat content parts with `"segment": true`,
and serves them as the concatenated prompt, so each answer must equal the plain request's with
the same token ids, and report no segment tokens.

The segment cache's own effects (reuse, recompute) are the scheduler's: the routes' shapes and
the span arithmetic are checked here and in tests/unit (test_validation.py,
test_front_tokenizer.py)."""

from __future__ import annotations

import httpx
import pytest
from http_helpers import TINY_OPTIONS, metric_samples, sse_events

from radixserve.tokenizer import (
    ChatSegments,
    apply_chat_template,
    apply_chat_template_segments,
    encode,
    encode_continuation,
    load_tokenizer,
    normalize_messages,
)

GREEDY = {"temperature": 0.0, "ignore_eos": True}
SEGMENTS = [
    "Document 1: The Loire is the longest river in France, and it flows west.\n",
    "Document 2: The Seine flows through Paris and reaches the sea at Le Havre.\n",
    "Question: which river flows through Paris? Answer:",
]


@pytest.fixture(scope="module")
def server(start_server, tiny_dir):
    return start_server(tiny_dir, *TINY_OPTIONS, "--disable-segment-cache", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir)


def concatenated(tokenizer, segments: list[str]) -> list[int]:
    return encode(tokenizer, segments[0]) + [t for s in segments[1:] for t in encode_continuation(tokenizer, s)]


def test_generate_with_segments_equals_the_concatenated_input_ids(client, tokenizer):
    params = {**GREEDY, "max_new_tokens": 10}
    r = client.post("/generate", json={"segments": SEGMENTS, "segment_recompute_ratio": 0.3, "sampling_params": params})
    assert r.status_code == 200, r.text
    out = r.json()
    plain = client.post("/generate", json={"input_ids": concatenated(tokenizer, SEGMENTS), "sampling_params": params}).json()
    assert out["output_ids"] == plain["output_ids"] and out["text"] == plain["text"]
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == plain["meta_info"]["prompt_tokens"] == len(concatenated(tokenizer, SEGMENTS))
    assert meta["segment_tokens"] == meta["recomputed_tokens"] == 0 == plain["meta_info"]["segment_tokens"]
    assert meta["completion_tokens"] == 10


def test_generate_with_segments_streams(client):
    body = {"segments": SEGMENTS, "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 4}}
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        events, done = sse_events(list(r.iter_lines()))
    whole = client.post("/generate", json={**body, "stream": False}).json()
    assert done and events[-1]["text"] == whole["text"]
    assert {"segment_tokens", "recomputed_tokens"} <= set(events[-1]["meta_info"])


def test_completions_with_segments_equal_the_plain_prompt(client, tokenizer):
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json={**body, "segments": SEGMENTS, "segment_recompute_ratio": 0, "echo": True})
    assert r.status_code == 200, r.text
    out = r.json()
    plain = client.post("/v1/completions", json={**body, "prompt": concatenated(tokenizer, SEGMENTS)}).json()
    assert out["choices"][0]["text"] == "".join(SEGMENTS) + plain["choices"][0]["text"]
    details = out["usage"]["prompt_tokens_details"]
    assert details == {"cached_tokens": details["cached_tokens"], "segment_tokens": 0, "recomputed_tokens": 0}
    assert out["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def _chat(documents: list[str], question: str, segment: bool) -> list[dict]:
    parts = [{"type": "text", "text": d, **({"segment": True} if segment else {})} for d in documents]
    return [{"role": "system", "content": "Answer from the documents."},
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def test_chat_segment_parts_equal_the_same_tokens_sent_plainly(client, tokenizer):
    docs = [s.strip() for s in SEGMENTS[:2]]
    segments = ChatSegments()
    ids, spans = apply_chat_template_segments(tokenizer, normalize_messages(_chat(docs, "Which river?", True), segments), segments)
    assert [tokenizer.decode(ids[a:b]) for a, b in spans] == docs
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/chat/completions", json={**body, "messages": _chat(docs, "Which river?", True),
                                                  "segment_recompute_ratio": 0.5, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events, done = sse_events(r.text.splitlines())
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    usage = events[-1]["usage"]
    plain = client.post("/v1/completions", json={**body, "prompt": ids}).json()
    assert done and text == plain["choices"][0]["text"] and usage["prompt_tokens"] == len(ids)
    assert usage["prompt_tokens_details"]["segment_tokens"] == 0
    # for this tokenizer the cuts fall at newlines: the same tokens as the unflagged conversation
    assert ids == apply_chat_template(tokenizer, _chat(docs, "Which river?", False))


def test_the_segment_counters_are_exported(client):
    samples = metric_samples(client.get("/metrics").text)
    assert samples["radixserve_segment_reused_tokens_total"] == 0
    assert samples["radixserve_segment_recomputed_tokens_total"] == 0
