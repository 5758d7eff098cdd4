"""Bad input never crashes or hangs the server: each kind gets a 4xx JSON error that says what is
wrong (OpenAI's error shape on every route), nothing reaches the scheduler, and a good request
still works afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from http_helpers import TINY_OPTIONS, metric_samples

BODY_LIMIT = 100_000
USER = [{"role": "user", "content": "hi"}]


def _gen(**fields):
    return ("POST", "/generate", fields)


def _sp(**params):
    return _gen(text="hi", sampling_params=params)


def _cmpl(**fields):
    return ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", **fields})


def _chat(**fields):
    return ("POST", "/v1/chat/completions", {"model": "tiny", "messages": USER, **fields})


# id -> (method, path, JSON body or raw bytes, expected status, a word the message must contain)
DEEP_SCHEMA = '{"type": "array", "items": ' * 3000 + "{}" + "}" * 3000  # past any JSON walker's recursion limit


def _raw(path: str, prefix: str, suffix: str) -> tuple[str, str, bytes]:
    """A body with DEEP_SCHEMA spliced in, as bytes: the client's own json.dumps could not write it."""
    return ("POST", path, (prefix + DEEP_SCHEMA + suffix).encode())


CASES = {
    "malformed json": ("POST", "/generate", b'{"text": "hi"', 400, "JSON"),
    "generate json_schema object nested too deeply": (
        *_raw("/generate", '{"text": "hi", "sampling_params": {"json_schema": ', "}}"), 400, "nested too deeply"),
    "chat response_format nested too deeply": (
        *_raw("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "response_format": '
              '{"type": "json_schema", "json_schema": {"name": "x", "schema": ', "}}}"), 400, "nested too deeply"),
    "chat tool parameters nested too deeply": (
        *_raw("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
              '"function": {"name": "f", "parameters": ', "}}]}"), 400, "nested too deeply"),
    "empty body": ("POST", "/generate", b"", 400, "empty"),
    "json array body": ("POST", "/generate", b"[1, 2]", 400, "object"),
    "invalid utf-8": ("POST", "/generate", b'{"text": "\xff\xfe"}', 400, "JSON"),
    "deeply nested and over the limit": ("POST", "/generate", b"[" * 100_000 + b"]" * 100_000, 413, "exceeds"),
    "deep but small": ("POST", "/generate", b"[" * 20_000 + b"]" * 20_000, 400, "JSON"),
    "body over the limit": ("POST", "/generate", json.dumps({"text": "x" * BODY_LIMIT}).encode(), 413, "limit"),
    "no prompt": (*_gen(sampling_params={}), 400, "text"),
    "text and input_ids": (*_gen(text="hi", input_ids=[1]), 400, "exactly one"),
    "text is a number": (*_gen(text=5), 400, "text"),
    "empty text": (*_gen(text=""), 400, "empty"),
    "text list with a number": (*_gen(text=["a", 3]), 400, "text"),
    "out-of-vocabulary id": (*_gen(input_ids=[1, 2, 10**9]), 400, "out of range"),
    "negative id": (*_gen(input_ids=[1, -2]), 400, "out of range"),
    "string ids": (*_gen(input_ids=["a", "b"]), 400, "input_ids"),
    "float ids": (*_gen(input_ids=[1.5]), 400, "input_ids"),
    "empty ids": (*_gen(input_ids=[]), 400, "input_ids"),
    "sampling_params not an object": (*_gen(text="hi", sampling_params="hot"), 400, "sampling_params"),
    "negative max_new_tokens": (*_sp(max_new_tokens=-1), 400, "max_new_tokens"),
    "huge max_new_tokens": (*_sp(max_new_tokens=10**12), 400, "max_new_tokens"),
    "string max_new_tokens": (*_sp(max_new_tokens="10"), 400, "max_new_tokens"),
    "negative temperature": (*_sp(temperature=-1), 400, "temperature"),
    "string temperature": (*_sp(temperature="hot"), 400, "temperature"),
    "top_p zero": (*_sp(top_p=0), 400, "top_p"),
    "top_k below -1": (*_sp(top_k=-5), 400, "top_k"),
    "n too large": (*_sp(n=1000), 400, "n"),
    "n zero": (*_sp(n=0), 400, "n"),
    "too many stop strings": (*_sp(stop=[f"s{i}" for i in range(100)]), 400, "stop"),
    "empty stop string": (*_sp(stop=[""]), 400, "stop"),
    "stop is a number": (*_sp(stop=5), 400, "stop"),
    "out-of-vocabulary stop_token_ids": (*_sp(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    "negative seed": (*_sp(seed=-1), 400, "seed"),
    "min above max": (*_sp(max_new_tokens=2, min_new_tokens=5), 400, "min_new_tokens"),
    "unknown sampling parameter": (*_sp(warmth=3), 400, "warmth"),
    "stop regexes": (*_sp(stop_regex=["a+"]), 400, "not supported"),
    "two constraints": (*_sp(regex="[a-z]+", json_schema="{}"), 400, "at most one"),
    "bad regex": (*_sp(regex="(a"), 400, "parenthesis"),
    "unknown field": (*_gen(text="hi", bogus=1), 400, "bogus"),
    "unsupported SGLang field": (*_gen(text="hi", image_data="x.png"), 400, "not supported"),
    "stream not a boolean": (*_gen(text="hi", stream="yes"), 400, "stream"),
    "return_logprob not a boolean": (*_gen(text="hi", return_logprob="yes"), 400, "return_logprob"),
    "prompt longer than the context": (*_gen(input_ids=[5] * 3000), 400, "context length"),
    "prompt plus output over the context": (*_gen(input_ids=[5] * 2000, sampling_params={"max_new_tokens": 100}), 400, "context length"),
    "logprob_start_len past the prompt": (*_gen(text="hi", return_logprob=True, logprob_start_len=10**6), 400, "logprob_start_len"),
    "top_logprobs_num too large": (*_gen(text="hi", return_logprob=True, top_logprobs_num=1000), 400, "top_logprobs_num"),
    "rid not a string": (*_gen(text="hi", rid=5), 400, "rid"),
    "one rid for a batch": (*_gen(text=["a", "b"], rid="same"), 400, "rid"),
    "per-prompt params of the wrong length": (*_gen(text=["a", "b"], sampling_params=[{}]), 400, "sampling_params"),
    "batch larger than the queue": (*_gen(text=["a"] * 10, sampling_params={"n": 10}), 400, "sequences"),
    "a batch of prompts larger than the queue": (*_gen(text=["a"] * 65), 400, "sequences"),
    "duplicate rids in a batch": (*_gen(text=["a", "b"], rid=["r", "r"]), 400, "rid"),
    "rid too long": (*_gen(text="hi", rid="r" * 257), 400, "rid"),
    "empty cache_salt": (*_gen(text="hi", cache_salt=""), 400, "cache_salt"),
    "falsy unknown field": (*_gen(text="hi", foo=0), 400, "foo"),
    "falsy unknown field 0.0": (*_gen(text="hi", bar=0.0), 400, "bar"),
    "logit_bias superscript key": (*_sp(logit_bias={"\u00b2": 1}), 400, "logit_bias"),
    "logit_bias 5000-digit key": (*_sp(logit_bias={"1" * 5000: 1}), 400, "logit_bias"),
    "logit_bias huge integer bias": (*_sp(logit_bias={"1": 10**400}), 400, "logit_bias"),
    "too many stop_token_ids": (*_sp(stop_token_ids=[1] * 1025), 400, "stop_token_ids"),
    "denormal temperature": (*_sp(temperature=1e-45), 400, "temperature"),
    "huge integer temperature": (*_sp(temperature=10**400), 400, "temperature"),
    "tiny repetition_penalty": (*_sp(repetition_penalty=1e-300), 400, "repetition_penalty"),
    # segments
    "segments not a list": (*_gen(segments="a document"), 400, "`segments` must be a list"),
    "empty segments": (*_gen(segments=[]), 400, "`segments` is empty"),
    "too many segments": (*_gen(segments=["a"] * 65), 400, "at most 64"),
    "segment not a string": (*_gen(segments=["a", 5]), 400, "`segments[1]` must be a non-empty string"),
    "empty segment": (*_gen(segments=["a", ""]), 400, "`segments[1]` must be a non-empty string"),
    "segments and text": (*_gen(segments=["a"], text="b"), 400, "cannot be combined with `text`"),
    "segments and input_ids": (*_gen(segments=["a"], input_ids=[1]), 400, "cannot be combined with `input_ids`"),
    "a batch of segment lists": (*_gen(segments=[["a", "b"], ["c"]]), 400, "batch"),
    "segment_recompute_ratio over 1": (*_gen(segments=["a", "b"], segment_recompute_ratio=1.5), 400, "segment_recompute_ratio"),
    "segment_recompute_ratio boolean": (*_gen(segments=["a", "b"], segment_recompute_ratio=True), 400, "segment_recompute_ratio"),
    "segment_reuse of the wrong length": (*_gen(segments=["a", "b"], segment_reuse=[True]), 400, "segment_reuse"),
    "segments longer than the context": (*_gen(segments=["hi " * 1200, "hi " * 1200]), 400, "context length"),
    "completions segments and prompt": (*_cmpl(segments=["a", "b"]), 400, "cannot be combined with `prompt`"),
    "completions segments not a list": ("POST", "/v1/completions", {"model": "tiny", "segments": "a"}, 400, "`segments` must be a list"),
    "completions segment_recompute_ratio": (
        "POST", "/v1/completions", {"model": "tiny", "segments": ["a", "b"], "segment_recompute_ratio": -1}, 400,
        "segment_recompute_ratio"),
    "chat segment flag not a boolean": (
        *_chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "segment": "yes"}]}]), 400, "segment must be a boolean"),
    "chat segment without text": (
        *_chat(messages=[{"role": "user", "content": [{"type": "text", "text": "", "segment": True}]}]), 400, "segment without text"),
    "chat too many segment parts": (
        *_chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "segment": True}] * 65}]), 400, "at most 64"),
    "chat segment_recompute_ratio a string": (*_chat(segment_recompute_ratio="high"), 400, "segment_recompute_ratio"),
    # OpenAI routes
    "completions without prompt": ("POST", "/v1/completions", {"model": "tiny"}, 400, "prompt"),
    "completions prompt is an object": (*_cmpl(prompt={"a": 1}), 400, "prompt"),
    "completions mixed prompt list": (*_cmpl(prompt=[1, "a"]), 400, "prompt"),
    "completions negative max_tokens": (*_cmpl(max_tokens=-5), 400, "max_tokens"),
    "completions logprobs too large": (*_cmpl(logprobs=100), 400, "logprobs"),
    "completions logprobs boolean": (*_cmpl(logprobs=True), 400, "logprobs"),
    "completions unknown model": (*_cmpl(model="gpt-4"), 404, "does not exist"),
    "completions n too large": (*_cmpl(n=100), 400, "n"),
    "completions json_schema not a string": (*_cmpl(json_schema=5), 400, "json_schema"),
    "completions two constraints": (*_cmpl(regex="a", ebnf='root ::= "a"'), 400, "at most one"),
    "completions response_format type": (*_cmpl(response_format={"type": "yaml"}), 400, "response_format"),
    "completions suffix": (*_cmpl(suffix="end"), 400, "suffix"),
    "completions best_of": (*_cmpl(best_of=5), 400, "best_of"),
    "completions logit_bias out of range": (*_cmpl(logit_bias={"1": 500}), 400, "logit_bias"),
    "completions logit_bias double minus": (*_cmpl(logit_bias={"--5": 1}), 400, "logit_bias"),
    "completions huge integer top_p": (*_cmpl(top_p=-(10**400)), 400, "top_p"),
    "completions empty prompt": (*_cmpl(prompt=""), 400, "empty"),
    "completions empty cache_salt": (*_cmpl(cache_salt=""), 400, "cache_salt"),
    "completions echo not a boolean": (*_cmpl(echo="yes"), 400, "echo"),
    "completions stream_options not an object": (*_cmpl(stream=True, stream_options="x"), 400, "stream_options"),
    "completions model not a string": (*_cmpl(model=5), 400, "model"),
    "completions temperature string": (*_cmpl(temperature="hot"), 400, "temperature"),
    "chat without messages": ("POST", "/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    "chat messages is a string": (*_chat(messages="hi"), 400, "messages"),
    "chat bad role": (*_chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    "chat content is a number": (*_chat(messages=[{"role": "user", "content": 5}]), 400, "content"),
    "chat image part": (*_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "text"),
    "chat top_logprobs without logprobs": (*_chat(top_logprobs=2), 400, "logprobs"),
    "chat logprobs a string": (*_chat(logprobs="true"), 400, "logprobs"),
    "chat tool name with a space": (*_chat(tools=[{"type": "function", "function": {"name": "f g"}}]), 400, "tools"),
    "chat tool_choice unknown function": (
        *_chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}),
        400, "not in `tools`"),
    "chat functions": (*_chat(functions=[{"name": "f"}]), 400, "use `tools`"),
    "chat response_format json_schema without a name": (*_chat(response_format={"type": "json_schema", "json_schema": {}}), 400, "name"),
    "chat required tool_choice and a response_format": (
        *_chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required", response_format={"type": "json_object"}),
        400, "cannot be combined"),
    "chat max_completion_tokens string": (*_chat(max_completion_tokens="many"), 400, "max_completion_tokens"),
    # the prose says "prompt" (the rendered conversation), the param names the client's field
    "chat longer than the context": (*_chat(messages=[{"role": "user", "content": "hi " * 3000}]), 400, "the prompt has"),
    "chat huge max_tokens": (*_chat(max_tokens=10**9), 400, "max_tokens"),
    # routes and methods
    "unknown route": ("POST", "/v2/generate", {}, 404, "no route"),
    "trailing slash": ("POST", "/generate/", {"text": "hi"}, 404, "no route"),
    "wrong method": ("GET", "/generate", None, 405, "not allowed"),
    "wrong method on chat": ("PUT", "/v1/chat/completions", {}, 405, "not allowed"),
}


@pytest.fixture(scope="module")
def server(start_server, tiny_dir):
    options = ("--served-model-name", "tiny", "--max-body-bytes", str(BODY_LIMIT), "--max-queued-requests", "64")
    return start_server(tiny_dir, *TINY_OPTIONS, *options)


def _send(client: httpx.Client, method: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return client.request(method, path, content=body, headers={"content-type": "application/json"})
    if body is None:
        return client.request(method, path)
    return client.request(method, path, json=body)


def _prompt_tokens_total(client: httpx.Client) -> float:
    return metric_samples(client.get("/metrics").text)["radixserve_prompt_tokens_total"]


def test_every_kind_of_bad_input_gets_a_4xx_with_a_message(server):
    assert len(CASES) >= 30
    failures = []
    with httpx.Client(base_url=server.url, timeout=30) as client:
        before = _prompt_tokens_total(client)
        for name, (method, path, body, status, word) in CASES.items():
            r = _send(client, method, path, body)
            try:
                error = r.json()["error"]
                ok = (
                    r.status_code == status and set(error) == {"message", "type", "param", "code"}
                    and word.lower() in error["message"].lower() and error["type"] == "invalid_request_error"
                )
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                failures.append(f"{name}: {r.status_code} {r.text[:300]}")
        assert not failures, "\n".join(failures)
        assert _prompt_tokens_total(client) == before, "a bad request reached the scheduler"
        good = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        assert good.status_code == 200 and good.json()["meta_info"]["completion_tokens"] == 3
        assert client.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"text": ""}, "text"),
        ("/generate", {"text": ["a", ""]}, "text"),
        ("/generate", {"text": "hi", "foo": 0}, "foo"),
        ("/generate", {"text": "hi", "cache_salt": ""}, "cache_salt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u00b2": 1}}, "logit_bias"),
        ("/generate", {"segments": ["a", ""]}, "segments"),
        ("/generate", {"segments": ["a", "b"], "segment_recompute_ratio": 2}, "segment_recompute_ratio"),
        ("/v1/completions", {"prompt": "hi", "segments": ["a"]}, "segments"),
        ("/v1/chat/completions", {"messages": USER, "segment_recompute_ratio": False}, "segment_recompute_ratio"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "segment": 1}]}]},
         "messages"),
    ],
)
def test_the_error_names_the_field_the_client_sent(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_bad_input_does_not_crash_the_server(server):
    assert server.proc.poll() is None
    log = server.log()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]


def test_an_error_does_not_echo_a_huge_value(server):
    """A 4,000-character path or a 4,300-digit pin_id (the most msgspec parses) is quoted by its
    start: the fuzzer found both echoed whole, a 4 kB message per request."""
    pin_id = b"9" * 4300
    with httpx.Client(base_url=server.url, timeout=30) as client:
        answers = [
            client.post("/" + "a" * 4000, json={}),
            client.post("/cache/unpin", content=b'{"pin_id": ' + pin_id + b"}", headers={"content-type": "application/json"}),
        ]
    for r, start in zip(answers, ("no route /aaa", "no pin 999")):
        message = r.json()["error"]["message"]
        assert r.status_code == 404 and message.startswith(start) and len(message) < 300, (r.status_code, message[:400])


def test_a_validation_error_quoting_a_huge_number_is_cut(server):
    """The 10,000-request fuzz run found `logprobs` with 4,300 digits quoted whole by the OpenAI
    route (a 4,352-character message); every validation message is cut at its start now."""
    digits = b"1" * 4300
    with httpx.Client(base_url=server.url, timeout=30) as client:
        answers = [
            client.post("/v1/completions", content=b'{"prompt": "hi", "logprobs": ' + digits + b"}",
                        headers={"content-type": "application/json"}),
            client.post("/generate", content=b'{"text": "hi", "sampling_params": {"min_new_tokens": ' + digits + b"}}",
                        headers={"content-type": "application/json"}),
        ]
    for r, field in zip(answers, ("logprobs", "min_new_tokens"), strict=True):
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and field in message and len(message) < 600, (r.status_code, message[:700])
        assert "cut from" in message, message[-100:]

