"""Tool calling and structured outputs on the OpenAI API, through the clients people use: the
official `openai` package, langchain-openai (`bind_tools`, `with_structured_output`) and the
OpenAI Agents SDK (its chat-completions model, unchanged), against a real server.

The tiny model has random weights: what it writes is noise, so a call whose arguments validate
against the tool's schema, or JSON that validates against a response format, can only come from
the grammar the server built from the request, and the parser reading the calls back. The last
test runs the Agents SDK against the default model (SmolLM2-135M-Instruct), whose prompt radixserve
renders in the hermes format since its template knows no tools."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from http_helpers import TINY_OPTIONS, running_server, sse_events
from pydantic import BaseModel, Field

MODEL = "tiny-chat"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"], "additionalProperties": False,
}
SEARCH_SCHEMA = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 16},
        "filters": {"type": "array", "items": {"enum": ["news", "images", "video"]}, "maxItems": 3},
        "options": {"type": "object", "properties": {"safe": {"type": "boolean"}, "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
                    "required": ["safe"], "additionalProperties": False},
    },
    "required": ["query"], "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "web-search", "description": "Search the web", "parameters": SEARCH_SCHEMA}},
    {"type": "function", "function": {"name": "now", "description": "The current time"}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False} for t in TOOLS}
MAX_TOKENS = 400  # every schema here has bounded outputs; the grammar ends the answer long before


@pytest.fixture(scope="module")
def server(start_server, tiny_dir):
    return start_server(tiny_dir, *TINY_OPTIONS, "--served-model-name", MODEL)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def _streamed_calls(chunks: list[Any]) -> tuple[str, list[dict[str, str]], str | None]:
    """Content, calls (id, name, arguments) and finish reason of a streamed choice 0, put together
    as a client does: by each call's index, arguments concatenated."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id:
                    assert not call["id"], "a call's id comes once"
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    call["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


# ---------------------------------------------------------------------- tool_choice


@pytest.mark.parametrize("seed", range(4))
def test_required_single_call_validates(client, seed):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, set(SCHEMAS))


def test_required_parallel_calls_validate(client):
    """Parallel calls allowed: after the first call the grammar lets the model write text or
    more calls, and the noise runs on until max_tokens, so only the last call may be cut."""
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS,
        temperature=1.0, seed=3, n=3,
    )
    for choice in out.choices:
        calls = choice.message.tool_calls
        assert choice.finish_reason in ("tool_calls", "length") and calls
        _check_calls(calls if choice.finish_reason == "tool_calls" else calls[:-1] or calls[:1], set(SCHEMAS))


@pytest.mark.parametrize("name", ["web-search", "now"])
def test_named_function(client, name):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0.9, seed=7,
        tool_choice={"type": "function", "function": {"name": name}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and [c.function.name for c in choice.message.tool_calls] == [name]
    _check_calls(choice.message.tool_calls, {name})


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_equal_the_whole_answer(client, tool_choice):
    kwargs = dict(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
        max_tokens=MAX_TOKENS, temperature=1.0, seed=11,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    content, calls, reason = _streamed_calls(chunks)
    assert content == "" and reason == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls)
    assert chunks[-1].usage.completion_tokens > 0
    # the official client's own accumulation agrees
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]


def test_auto_and_none_answer_in_text(client):
    """The tiny model writes noise, which is not a call: content, finish reason stop or length."""
    for tool_choice in ("auto", "none"):
        out = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=12, temperature=0,
        )
        choice = out.choices[0]
        assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")


def test_a_conversation_with_calls_and_results(client):
    first = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS, temperature=0,
    ).choices[0].message
    history = [
        *MESSAGES, first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "Sunny, 21 degrees"},
    ]
    assert history[1]["role"] == "assistant" and "content" not in history[1]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens > 0 and out.choices[0].finish_reason in ("stop", "length")
    history[1]["content"] = None  # as the Agents SDK sends it
    client.chat.completions.create(model=MODEL, messages=history, max_tokens=2)


def test_bad_tool_requests_are_400(client, server):
    cases = [
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "regex"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
          "tool_choice": "required"}, "tools"),
    ]
    for extra, param in cases:
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.text)


# ---------------------------------------------------------------------- response_format

RESPONSE_SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -10, "maximum": 10}, "ok": {"type": "boolean"}},
     "required": ["n", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "shade": {"enum": [1, 2, 3]}}, "required": ["color"]},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["p"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}}, "required": ["person"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 5}},
     "required": ["items"]},
    {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"k": {"type": "string", "maxLength": 4}, "v": {"type": "boolean"}}, "required": ["k", "v"]}}},
     "required": ["rows"]},
    {"type": "object", "properties": {"opt": {"type": "string", "maxLength": 5}, "req": {"const": "yes"}}, "required": ["req"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "null"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, "required": ["date"]},
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
]


@pytest.mark.parametrize("index", range(len(RESPONSE_SCHEMAS)))
def test_response_format_json_schema_validates(client, index):
    schema = RESPONSE_SCHEMAS[index]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=MAX_TOKENS,
        temperature=1.0, seed=index,
        response_format={"type": "json_schema", "json_schema": {"name": f"schema_{index}", "schema": schema, "strict": True}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_completions(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, response_format={"type": "json_object"}, seed=1, temperature=1.0)
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    schema = RESPONSE_SCHEMAS[1]
    comp = client.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=MAX_TOKENS, temperature=1.0, seed=2,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
    )
    jsonschema.validate(json.loads(comp.choices[0].text), schema)
    # SGLang's and vLLM's keys in the body
    regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, extra_body={"regex": "[A-Z]{3}-[0-9]{3}"})
    assert len(regex.choices[0].text) == 7 and regex.choices[0].text[3] == "-"
    choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")


def test_streamed_json_is_the_whole_answer(client):
    schema = RESPONSE_SCHEMAS[4]
    kwargs = dict(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), schema)


def test_openai_parse_with_pydantic(client):
    class Weather(BaseModel):
        city: str = Field(max_length=10)
        temperature: int = Field(ge=-50, le=50)
        kind: Literal["sun", "rain", "snow"]

    out = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Weather, max_tokens=MAX_TOKENS, seed=3)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Weather) and -50 <= parsed.temperature <= 50


def test_tools_auto_with_a_response_format_may_call_or_answer(client):
    schema = RESPONSE_SCHEMAS[0]
    for seed in range(6):  # which of the two the noise picks is its business; both must be well formed
        out = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        ).choices[0]
        if out.message.tool_calls:
            _check_calls(out.message.tool_calls, set(SCHEMAS))
        else:
            jsonschema.validate(json.loads(out.message.content), schema)


def test_raw_stream_shape(server):
    """The chunks on the wire, as OpenAI sends them: the role first, the call's first piece with
    id, type and name, later pieces with the index and arguments only, the reason alone last."""
    body = {
        "messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        events, done = sse_events(list(r.iter_lines()))
    assert done
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    first = deltas[1]["tool_calls"][0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"]["name"] == "get_weather"
    rest = [d["tool_calls"][0] for d in deltas[2:-1]]
    assert rest and all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in rest)
    assert deltas[-1] == {} and events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    arguments = first["function"]["arguments"] + "".join(p["function"]["arguments"] for p in rest)
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)


# ---------------------------------------------------------------------- langchain


def test_langchain_bind_tools_and_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0.8, max_tokens=MAX_TOKENS,
        max_retries=0, seed=4,
    )
    for choice in ("required", "get_weather"):
        reply = llm.bind_tools(TOOLS, tool_choice=choice).invoke("Weather in Paris?")
        assert reply.tool_calls and all(c["name"] in SCHEMAS for c in reply.tool_calls)
        for call in reply.tool_calls:
            jsonschema.validate(call["args"], SCHEMAS[call["name"]])
        if choice == "get_weather":
            assert [c["name"] for c in reply.tool_calls] == ["get_weather"]
    streamed = None
    for piece in llm.bind_tools(TOOLS, tool_choice="get_weather").stream("Weather in Paris?"):
        streamed = piece if streamed is None else streamed + piece
    assert streamed.tool_calls and streamed.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(streamed.tool_calls[0]["args"], WEATHER_SCHEMA)

    class Person(BaseModel):
        """A person."""

        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=120)

    # (not json_mode: any JSON object, which noise may never close within max_tokens)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Describe a person.")
        assert isinstance(person, Person) and 0 <= person.age <= 120


# ---------------------------------------------------------------------- the Agents SDK


def _agent_run(base_url: str, model: str, stream: bool, max_tokens: int) -> tuple[Any, list[tuple[str, dict]]]:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # nothing may leave the machine
    called: list[tuple[str, dict]] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in a city."""
        called.append(("get_weather", {"city": city, "unit": unit}))
        return f"Sunny and 21 degrees in {city}."

    @agents.function_tool
    def add(a: Annotated[int, Field(ge=0, le=1000)], b: Annotated[int, Field(ge=0, le=1000)]) -> int:
        """Add two numbers."""
        called.append(("add", {"a": a, "b": b}))
        return a + b

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
            agent = agents.Agent(
                name="assistant", instructions="You are a helpful assistant. Use the tools.",
                tools=[get_weather, add],
                model=agents.OpenAIChatCompletionsModel(model=model, openai_client=client),
                # required: the first turn calls a tool (the SDK then resets the choice to auto);
                # one call per turn, so the grammar ends the turn after it
                model_settings=agents.ModelSettings(
                    tool_choice="required", parallel_tool_calls=False, max_tokens=max_tokens, temperature=0,
                ),
            )
            if stream:
                result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
                async for _ in result.stream_events():
                    pass
                return result
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    return asyncio.run(run()), called


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_calls_a_tool_then_answers(server, stream):
    result, called = _agent_run(server.url + "/v1", MODEL, stream, max_tokens=MAX_TOKENS)
    assert called, "the first turn must call a tool"
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


@pytest.mark.slow
def test_agents_sdk_on_the_default_model(tmp_path):
    with running_server("default", "--dtype", "float32", log_dir=tmp_path) as srv:
        result, called = _agent_run(srv.url + "/v1", "default", stream=False, max_tokens=128)
    assert called and called[0][0] in ("get_weather", "add")
    assert isinstance(result.final_output, str) and result.final_output.strip()

