"""The request side of tool calling and structured outputs, without a server: checking `tools`,
`tool_choice`, `response_format` and the constraint keys (http/openai/tool_requests.py, http/openai/constraints.py),
and rendering conversations with tools, calls and results for a template that knows no tools (the
default model's ChatML) and for one that does."""

from __future__ import annotations

import copy
import json

import pytest

from radixserve.front.types import InvalidRequest
from radixserve.http.openai.constraints import body_constraint
from radixserve.http.openai.tool_call_parser import HERMES, LLAMA3, parse_tool_calls
from radixserve.http.openai.tool_requests import (
    parse_tool_request,
    prompt_chars,
    render_chat,
    structural_tag,
)
from radixserve.tokenizer import load_tokenizer, normalize_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
NOOP = {"type": "function", "function": {"name": "noop"}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "3 C"},
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def _error(fn, *args) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        fn(*args)
    return err.value


# ---------------------------------------------------------------------- tools, tool_choice


def test_tool_request_defaults_and_choices():
    assert parse_tool_request({}) is None and parse_tool_request({"tools": [], "tool_choice": "none"}) is None
    req = parse_tool_request({"tools": [WEATHER, NOOP]})
    assert req.choice == "auto" and req.parallel and req.names == {"get_weather", "noop"} and req.shown
    req = parse_tool_request({"tools": [WEATHER], "tool_choice": "none", "parallel_tool_calls": False})
    assert req.shown is None and not req.parallel and not req.constrained
    named = parse_tool_request({"tools": [WEATHER, NOOP], "tool_choice": {"type": "function", "function": {"name": "noop"}}})
    assert named.choice == "named" and named.forced == "noop" and named.constrained


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "letters"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools", "64"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools", "schema"),
    ({"tools": {"a": 1}}, "tools", "list"),
    ({"tools": [NOOP] * 129}, "tools", "128"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in"),
    ({"tool_choice": "required"}, "tool_choice", "needs"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"functions": [{"name": "f"}]}, "functions", "tools"),
])
def test_bad_tool_requests(body, param, words):
    err = _error(parse_tool_request, body)
    assert err.param == param and words in err.message


# ---------------------------------------------------------------------- response_format and keys


@pytest.mark.parametrize("body, kind, text", [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, "json_schema", {"type": "object"}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array"}, "strict": True}}},
     "json_schema", {"type": "array"}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "json_schema", {"type": "object"}),
    ({"regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"json_schema": {"type": "integer"}}, "json_schema", {"type": "integer"}),
    ({"ebnf": 'root ::= "a"'}, "ebnf", 'root ::= "a"'),
    ({"guided_regex": "a|b"}, "regex", "a|b"),
    ({"guided_choice": ["yes", 'no "way"']}, "ebnf", 'root ::= "yes" | "no \\"way\\""'),
])
def test_body_constraints(body, kind, text):
    got = body_constraint(body)
    if kind is None:
        assert got is None
        return
    assert got.kind == kind
    assert (json.loads(got.text) if isinstance(text, dict) else got.text) == text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"regex": 5}, "regex"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_bad_constraints(body, param):
    assert _error(body_constraint, body).param == param


def test_structural_tags_compile_and_accept_what_the_parser_reads():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    for fmt in (HERMES, LLAMA3):
        call = fmt.render_call("get_weather", '{"city": "Rome"}')
        required = parse_tool_request({"tools": [WEATHER, NOOP], "tool_choice": "required", "parallel_tool_calls": False})
        grammar = xgr.Grammar.from_structural_tag(structural_tag(required, fmt))
        assert _is_grammar_accept_string(grammar, call)
        assert not _is_grammar_accept_string(grammar, "It is sunny.")
        assert not _is_grammar_accept_string(grammar, call + call)  # parallel_tool_calls false
        assert parse_tool_calls(fmt, required.names, call).tool_calls[0].arguments == '{"city": "Rome"}'
        noop = fmt.render_call("noop", "{}")
        assert _is_grammar_accept_string(grammar, noop)  # no parameters: an empty object
        assert not _is_grammar_accept_string(grammar, fmt.render_call("noop", "[1]"))
        auto = parse_tool_request({"tools": [WEATHER]})
        either = xgr.Grammar.from_structural_tag(structural_tag(auto, fmt, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
        assert _is_grammar_accept_string(either, call) and _is_grammar_accept_string(either, '{"a": 1}')
        assert not _is_grammar_accept_string(either, "plain words")


# ---------------------------------------------------------------------- rendering


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def test_chatml_without_tools_renders_as_before(tokenizer):
    from radixserve.tokenizer import apply_chat_template

    chat = normalize_messages([{"role": "user", "content": "hi"}])
    assert render_chat(tokenizer, chat, None, HERMES, True) == apply_chat_template(tokenizer, chat, True)
    none = parse_tool_request({"tools": [WEATHER], "tool_choice": "none"})
    assert render_chat(tokenizer, chat, none, HERMES, True) == apply_chat_template(tokenizer, chat, True)


def test_chatml_renders_tools_calls_and_results_in_hermes(tokenizer):
    req = parse_tool_request({"tools": [WEATHER, NOOP]})
    chat = normalize_messages(CONVERSATION)
    text = _text(tokenizer, render_chat(tokenizer, chat, req, HERMES, True))
    system = text[: text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in system and json.dumps(NOOP) in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    calls = parse_tool_calls(HERMES, req.names, assistant)
    assert [(c.name, c.arguments) for c in calls.tool_calls] == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')]
    assert calls.content is None
    results = text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
    assert results == "<tool_response>\n12 C\n</tool_response>\n<tool_response>\n3 C\n</tool_response>"
    assert text.endswith("<|im_start|>assistant\n")
    # without a system message, the tools' one comes first (and SmolLM's default one is not added)
    text = _text(tokenizer, render_chat(tokenizer, chat[1:], req, HERMES, True))
    assert text.startswith("<|im_start|>system\n# Tools") and "SmolLM" not in text


def test_history_with_calls_renders_even_without_tools(tokenizer):
    text = _text(tokenizer, render_chat(tokenizer, normalize_messages(CONVERSATION), None, HERMES, True))
    assert "# Tools" not in text and '"arguments": {"city": "Oslo"}' in text and "<tool_response>" in text


def test_prompt_chars_counts_what_the_tools_add(tokenizer):
    req = parse_tool_request({"tools": [WEATHER, NOOP]})
    chat = normalize_messages(CONVERSATION[:2])
    bare = _text(tokenizer, render_chat(tokenizer, chat, None, HERMES, True))
    full = _text(tokenizer, render_chat(tokenizer, chat, req, HERMES, True))
    assert 0 < len(full) - len(bare) <= prompt_chars(chat, req)


def test_a_template_that_knows_tools_gets_them(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}\n"
        "{% endfor %}"
    )
    req = parse_tool_request({"tools": [WEATHER, NOOP]})
    text = _text(tok, render_chat(tok, normalize_messages(CONVERSATION), req, HERMES, False))
    assert text.startswith("TOOL get_weather\nTOOL noop\n[system]Be brief.")
    assert 'CALL get_weather {"city": "Paris"}' in text  # arguments as an object, quoted once
    assert "[tool]12 C" in text


def test_bad_tool_calls_in_history(tokenizer):
    bad = [*CONVERSATION[:2], {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]
    err = _error(render_chat, tokenizer, normalize_messages(bad), None, HERMES, True)
    assert err.param == "messages" and "tool_calls[0]" in err.message
