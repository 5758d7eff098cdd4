"""The OpenAI-compatible API through the official `openai` client (sync and async, streaming),
against the real server; greedy outputs must equal the in-process Engine's."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from http_helpers import TINY_OPTIONS

from radixserve import Engine
from radixserve.tokenizer import apply_chat_template

MODEL = "tiny-chat"
PROMPT = "The quick brown fox jumps over the lazy dog"
SYSTEM = " ".join(["You are a careful assistant who answers briefly and never invents facts."] * 4)


@pytest.fixture(scope="module")
def server(start_server, tiny_dir):
    return start_server(tiny_dir, *TINY_OPTIONS, "--served-model-name", MODEL)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    with Engine(model=str(tiny_dir), dtype="float32", page_size=4, kv_pages=1024, chunk_size=64) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _chat_ref(engine: Engine, messages: list[dict], max_new_tokens: int) -> dict:
    ids = apply_chat_template(engine.tokenizer, messages)
    return engine.generate(input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens})


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_matches_engine_with_usage(client, engine):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    ref = engine.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 8})
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].text == ref["text"] and out.choices[0].index == 0
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"] and out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_completion_batch_and_token_prompts_keep_order(client, engine):
    prompts = [PROMPT, "Seven wizards judge", "Hello"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    refs = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": 5})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [r["text"] for r in refs]
    ids = [engine.tokenizer(p).input_ids for p in prompts]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert [c.text for c in by_ids.choices] == [r["text"] for r in refs]
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=5, temperature=0)
    assert one.choices[0].text == refs[0]["text"]


def test_completion_streaming_deltas_and_usage_chunk(client, engine):
    ref = engine.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 10})
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref["text"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_matches_engine_and_repeats_hit_the_cache(client, engine):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    ref = _chat_ref(engine, messages, 6)
    assert first.id.startswith("chatcmpl-") and first.object == "chat.completion"
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content == ref["text"]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6, temperature=0)
    assert second.choices[0].message.content == ref["text"]
    assert second.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_streaming_with_the_async_client(server, engine):
    messages = [{"role": "user", "content": "Tell me about foxes."}]
    ref = _chat_ref(engine, messages, 8)

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as aclient:
            stream = await aclient.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ref["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_n_and_seed(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=1.0, n=3, seed=7)
    out = client.chat.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    assert 3 <= out.usage.completion_tokens <= 15


def test_chat_logprobs_match_generate(client, server, engine):
    messages = [{"role": "user", "content": "Count to three."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 4
    ids = apply_chat_template(engine.tokenizer, messages)
    ref = engine.generate(input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": 4}, return_logprob=True)
    for entry, (lp, _, _) in zip(content, ref["meta_info"]["output_token_logprobs"]):
        assert abs(entry.logprob - lp) < 1e-4
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy
        assert bytes(entry.bytes) == entry.token.encode()
    assert "".join(e.token for e in content) == out.choices[0].message.content


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == out.choices[0].text
    # lm-eval's loglikelihood call: echo the prompt with its logprobs, generate nothing
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    elp = echo.choices[0].logprobs
    assert echo.choices[0].text == PROMPT
    assert elp.token_logprobs[0] is None and all(x is not None for x in elp.token_logprobs[1:])
    assert "".join(elp.tokens) == PROMPT and len(elp.tokens) == echo.usage.prompt_tokens


def test_stop_strings_and_extensions(client, engine):
    base = engine.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True})
    stop = base["text"][6:9]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == base["text"][: base["text"].index(stop)]
    ext = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True, "top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 2,
                    "stop_token_ids": [base["output_ids"][4]], "skip_special_tokens": True},
    )
    assert ext.choices[0].finish_reason == "stop" and ext.usage.completion_tokens == 5
    assert ext.choices[0].model_extra["matched_stop"] == base["output_ids"][4]


def test_unknown_fields_are_ignored(client):
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"some_future_field": {"x": 1}}, user="u1")
    assert out.usage.completion_tokens <= 2


def test_errors_have_openai_shape(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert err.value.status_code == 404 and err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, suffix="end")
    assert "not supported yet" in err.value.message and err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10**9)
    assert "max_tokens" in err.value.message and err.value.body["param"] == "max_tokens"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


DOCS = ["Document 1: the river runs north past the mill.\n", "Document 2: the hill behind the mill is green.\n"]


def test_segments_through_the_openai_client(client, engine):
    """`segments` in place of `prompt`, and chat text parts with `"segment": true`, sent as a
    client sends extensions; usage carries the segment counts next to cached_tokens."""
    from radixserve.tokenizer import encode, encode_continuation

    segments = [*DOCS, "Question: which way does the river run?"]
    out = client.completions.create(model=MODEL, prompt=None, max_tokens=4, temperature=0,
                                    extra_body={"segments": segments, "segment_recompute_ratio": 0.2, "ignore_eos": True})
    ids = encode(engine.tokenizer, segments[0]) + [t for s in segments[1:] for t in encode_continuation(engine.tokenizer, s)]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 4
    details = out.usage.prompt_tokens_details
    assert 0 <= details.recomputed_tokens <= details.segment_tokens <= details.cached_tokens

    parts = [{"type": "text", "text": d, "segment": True} for d in DOCS]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "Which way does the river run?"}]}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"segment_recompute_ratio": 0.2})
    details = chat.usage.prompt_tokens_details
    assert chat.choices[0].message.content is not None and details.segment_tokens >= 0
    # a part list without segment flags is the joined text, exactly as before
    plain = [{"role": "user", "content": [{"type": "text", "text": d} for d in DOCS]}]
    joined = [{"role": "user", "content": "\n".join(DOCS)}]
    assert client.chat.completions.create(model=MODEL, messages=plain, max_tokens=6, temperature=0).choices[0].message.content == \
        _chat_ref(engine, joined, 6)["text"]
