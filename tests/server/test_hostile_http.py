"""The hostile-input sweep's requests against a real server on a tiny model: each is a 400 that
names the field, before any work (nothing reaches the scheduler), and the server logs no
traceback. The parser's side (model output that is not a call) is tests/test_hostile_tool_output.py."""

from __future__ import annotations

import httpx
import pytest
from http_helpers import TINY_OPTIONS, metric_samples, running_server
from runtime_helpers import make_tiny_chat_model

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _chat(**fields) -> dict:
    return {"messages": USER, "max_tokens": 4, **fields}


def _rf(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# name -> (path, body as JSON or raw bytes, the param the 400 names, a word of its message)
CASES = {
    "tool_choice name a list": (
        "/v1/chat/completions",
        _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": ["get_weather"]}}),
        "tool_choice", "string",
    ),
    "pin ttl of 400 digits": ("/cache/pin", b'{"input_ids": [1, 2, 3, 4, 5], "ttl": 1' + b"0" * 400 + b"}", "ttl", "ttl"),
    "tool parameters 250 deep, required": (
        "/v1/chat/completions", _chat(tools=[_tool(_nested(250))], tool_choice="required"), "tools", "nested",
    ),
    "response_format 250 deep": ("/v1/chat/completions", _chat(response_format=_rf(_nested(250))), "response_format", "nested"),
    "response_format remote $ref": (
        "/v1/chat/completions", _chat(response_format=_rf({"$ref": "http://example.com/s.json"})), "response_format", "$ref",
    ),
    "response_format file $ref": (
        "/v1/chat/completions", _chat(response_format=_rf({"$ref": "file:///etc/passwd"})), "response_format", "$ref",
    ),
    "response_format not": ("/v1/chat/completions", _chat(response_format=_rf({"not": {}})), "response_format", "not"),
    "response_format allOf": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 4, "response_format": _rf({"allOf": [{"type": "string"}, {"type": "integer"}]})},
        "response_format", "allOf",
    ),
    "sglang json_schema not": (
        "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "json_schema": '{"not": {}}'}}, "json_schema", "not",
    ),
    "body json_schema remote $ref": (
        "/v1/chat/completions", _chat(json_schema={"$ref": "http://example.com/s.json"}), "json_schema", "$ref",
    ),
    "guided_json allOf": (
        "/v1/chat/completions", _chat(guided_json={"allOf": [{"type": "string"}, {"type": "integer"}]}), "guided_json", "allOf",
    ),
    "tool parameters not, required": (
        "/v1/chat/completions", _chat(tools=[_tool({"type": "object", "properties": {"a": {"not": {}}}})], tool_choice="required"),
        "tools", "not",
    ),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_chat_model(tmp_path_factory.mktemp("hostile_tiny") / "model")
    with running_server(model, *TINY_OPTIONS, "--served-model-name", "tiny", log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv


def test_hostile_requests_are_400s_naming_the_field_before_any_work(server):
    failures = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        before = metric_samples(client.get("/metrics").text)["radixserve_prompt_tokens_total"]
        for name, (path, body, param, word) in CASES.items():
            if isinstance(body, bytes):
                r = client.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = client.post(path, json=body)
            try:
                error = r.json()["error"]
                ok = r.status_code == 400 and error["param"] == param and word.lower() in error["message"].lower()
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                failures.append(f"{name}: {r.status_code} {r.text[:300]}")
        assert not failures, "\n".join(failures)
        assert metric_samples(client.get("/metrics").text)["radixserve_prompt_tokens_total"] == before
        assert client.get("/health").status_code == 200
    log = server.log()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]
