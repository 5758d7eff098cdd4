"""Contract tests: the OpenAI API details real clients rely on, through the clients users run:
the official `openai` package (sync and async) and `langchain-openai`'s `ChatOpenAI`.
See docs/compatibility.md for the field table."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from http_helpers import TINY_OPTIONS

MODEL = "tiny-chat"
PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Tell me about foxes."}]


@pytest.fixture(scope="module")
def server(start_server, tiny_dir):
    return start_server(tiny_dir, *TINY_OPTIONS, "--served-model-name", MODEL)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _check_usage_stream(chunks: list) -> None:
    """Every chunk carries `usage: null` but the last, which has no choices and the usage."""
    *body, last = chunks
    assert all(c.usage is None for c in body) and all(c.choices for c in body)
    assert last.choices == [] and last.usage is not None
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_sync_stream_include_usage_final_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    _check_usage_stream(chunks)
    assert chunks[-1].usage.completion_tokens == 5
    plain = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, stream=True))
    assert all(getattr(c, "usage", None) is None for c in plain)  # no usage unless asked


def test_async_stream_include_usage_final_chunk(server):
    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as aclient:
            stream = await aclient.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    _check_usage_stream(chunks)
    assert chunks[-1].usage.completion_tokens == 4


def test_max_completion_tokens_and_max_tokens(client):
    for key in ("max_completion_tokens", "max_tokens"):
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}, **{key: 3})
        assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_stop_as_string_and_list(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[4:7]
    for value in (stop, [stop, "never-appears"]):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=value)
        assert out.choices[0].finish_reason == "stop" and out.choices[0].text == text[: text.index(stop)]


def test_n_seed_user(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=1.0, n=2, seed=11, user="alice")
    a, b = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_chat_logprobs_and_completion_integer_logprobs(client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 2 for e in content)
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3 and all(len(t) <= 2 for t in lp.top_logprobs)


def test_echo_uses_prompt_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == out.usage.prompt_tokens + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text


def test_logit_bias_really_biases(client):
    target = 150
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(target): 100},
        extra_body={"ignore_eos": True},
    )
    # the text of three copies of the biased token, as the server detokenizes it
    three = client.completions.create(model=MODEL, prompt=[target] * 3, max_tokens=0, echo=True)
    assert out.choices[0].text == three.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logit_bias={"not-a-token": 1})
    assert err.value.body["param"] == "logit_bias"


def test_vllm_sglang_extensions_in_the_body(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    ids = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    assert ids.choices[0].text == base.choices[0].text
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.7, seed=1,
        extra_body={"ignore_eos": True, "top_k": 1, "min_p": 0.05, "repetition_penalty": 1.0,
                    "skip_special_tokens": True, "spaces_between_special_tokens": True, "min_tokens": 10,
                    "no_stop_trim": False, "stop_token_ids": []},
    )
    assert out.choices[0].text == base.choices[0].text  # top_k 1 is greedy
    assert out.usage.completion_tokens == 10


def test_response_format_json_and_text(client, smol):
    # A random model writes a string that may not end within the budget (finish "length", half
    # an object): a bias towards "}" makes the shortest object the likely one. Unconstrained,
    # the same bias gives "}}}...": only the grammar makes it an object.
    close = {str(smol.convert_tokens_to_ids("}")): 100}
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=200, seed=1, response_format={"type": "json_object"},
        logit_bias=close,
    )
    assert out.choices[0].finish_reason == "stop" and json.loads(out.choices[0].message.content) == {}
    free = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, seed=1, logit_bias=close)
    assert free.choices[0].message.content == "}}}}"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert isinstance(json.loads(out.choices[0].message.content)["ok"], bool)
    text = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, response_format={"type": "text"})
    assert text.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, response_format={"type": "xml"})
    assert err.value.body["param"] == "response_format"


def test_unknown_fields_ignored_wrong_types_rejected(client, server):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"metadata_v9": {"a": 1}, "store": False})
    assert out.usage.completion_tokens <= 2
    for field, value in [("max_tokens", "3"), ("temperature", "hot"), ("stop", 5), ("n", 1.5), ("seed", "x"), ("logprobs", "yes"), ("user", 3)]:
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, field: value}, timeout=60)
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_langchain_chat_openai_invoke_and_stream(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=6, max_retries=0,
    )
    reply = llm.invoke("Tell me about foxes.")
    assert isinstance(reply.content, str) and reply.usage_metadata["output_tokens"] <= 6
    pieces = list(llm.stream("Tell me about foxes."))
    assert "".join(p.content for p in pieces) == reply.content
