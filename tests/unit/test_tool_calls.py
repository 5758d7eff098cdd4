"""Reading tool calls out of generated text (radixserve/http/openai/tool_call_parser.py): whole texts, the
same texts streamed with the chunk boundary at every position, malformed calls that must stay
content, and texts that xgrammar's own structural tags generate (what `tool_choice: required`
constrains a model to), which must parse to calls whose arguments satisfy the tool's schema."""

from __future__ import annotations

import json
import random

import pytest

from radixserve.http.openai.tool_call_parser import (
    HERMES,
    LLAMA3,
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    ParsedMessage,
    ToolCallFormat,
    ToolCallParser,
    parse_tool_calls,
    resolve_format,
)

NAMES = frozenset({"get_weather", "search", "noop"})
WEATHER_ARGS = '{"city": "Paris", "days": [1, {"a": "}\\""}]}'

# (format, text, expected content, expected [(name, arguments)])
WHOLE = {
    "hermes one call": (
        HERMES, f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>',
        None, [("get_weather", WEATHER_ARGS)],
    ),
    "hermes text then two calls": (
        HERMES,
        'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>\n'
        '<tool_call>\n{"name":"noop","arguments":{}}\n</tool_call>\n',
        "Let me look.", [("search", '{"q": "x"}'), ("noop", "{}")],
    ),
    "hermes arguments before name": (
        HERMES, '<tool_call>\n{"arguments": {"q": 1}, "name": "search"}\n</tool_call>',
        None, [("search", '{"q": 1}')],
    ),
    "hermes text after the call": (
        HERMES, '<tool_call>{"name": "noop", "arguments": {}}</tool_call>\n\nDone here. ',
        "Done here.", [("noop", "{}")],
    ),
    "hermes missing closing tag at the end": (
        HERMES, '<tool_call>\n{"name": "noop", "arguments": {"a": [1]}}', None, [("noop", '{"a": [1]}')],
    ),
    "llama python tag and semicolons": (
        LLAMA3,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "search", "parameters": {"q": "a;b"}}',
        None, [("get_weather", '{"city": "Oslo"}'), ("search", '{"q": "a;b"}')],
    ),
    "llama type key first, arguments key": (
        LLAMA3, 'I will call it.\n{"type": "function", "name": "noop", "arguments": {}}',
        "I will call it.", [("noop", "{}")],
    ),
    "plain text keeps its whitespace": (HERMES, "  just text\n", "  just text\n", []),
    "llama prose with braces": (LLAMA3, 'use {x} and {"name": "Bob"}', 'use {x} and {"name": "Bob"}', []),
}

MALFORMED = {
    "unknown tool": (HERMES, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
    "not json": (HERMES, "<tool_call>\nget_weather(city='x')\n</tool_call>"),
    "no arguments key": (HERMES, '<tool_call>\n{"name": "noop"}\n</tool_call>'),
    "cut inside the marker": (HERMES, "Answer: <tool_ca"),
    "cut inside the header": (HERMES, '<tool_call>\n{"name": "get_wea'),
    "name not a string": (HERMES, '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>'),
    "llama unknown tool": (LLAMA3, '{"name": "other", "parameters": {}}'),
    "llama no parameters": (LLAMA3, '{"name": "noop", "value": 1}'),
}


def _fold(events: list) -> tuple[str, list[list[str]]]:
    """Stream events -> (content, [[id, name, arguments], ...])."""
    content, calls = "", []
    for e in events:
        if isinstance(e, ContentDelta):
            content += e.text
        elif isinstance(e, CallStarted):
            assert e.index == len(calls)
            calls.append([e.id, e.name, ""])
        else:
            assert isinstance(e, ArgumentsDelta) and e.index == len(calls) - 1, "arguments of an earlier call"
            calls[e.index][2] += e.text
    return content, calls


def _stream(fmt: ToolCallFormat, text: str, cuts: list[int]) -> tuple[ToolCallParser, str, list[list[str]]]:
    parser = ToolCallParser(fmt, NAMES)
    events = []
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[:cut], final=cut == len(text))
    content, calls = _fold(events)
    return parser, content, calls


def _check_same(fmt: ToolCallFormat, text: str, whole: ParsedMessage, cuts: list[int]) -> None:
    parser, content, calls = _stream(fmt, text, cuts)
    assert (content or None) == whole.content, cuts
    assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in whole.tool_calls], cuts
    assert [i for i, _, _ in calls] == [c.id for c in parser.calls]


@pytest.mark.parametrize("case", list(WHOLE))
def test_whole_text(case):
    fmt, text, content, calls = WHOLE[case]
    msg = parse_tool_calls(fmt, NAMES, text)
    assert msg.content == content
    assert [(c.name, c.arguments) for c in msg.tool_calls] == calls
    assert len({c.id for c in msg.tool_calls}) == len(calls) and all(c.id.startswith("call_") for c in msg.tool_calls)
    for call in msg.tool_calls:
        json.loads(call.arguments)


@pytest.mark.parametrize("case", list(WHOLE) + list(MALFORMED))
def test_streamed_equals_whole_at_every_boundary(case):
    fmt, text = (WHOLE.get(case) or MALFORMED[case])[:2]
    whole = parse_tool_calls(fmt, NAMES, text)
    _check_same(fmt, text, whole, list(range(1, len(text))))  # one character at a time
    for cut in range(1, len(text)):  # two chunks, cut everywhere
        _check_same(fmt, text, whole, [cut])
    rng = random.Random(case)
    for _ in range(20):  # token-like chunks of random sizes
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        _check_same(fmt, text, whole, cuts)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_calls_stay_content(case):
    fmt, text = MALFORMED[case]
    msg = parse_tool_calls(fmt, NAMES, text)
    assert msg.tool_calls == [] and msg.content == text


def test_a_call_cut_off_keeps_what_was_written():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    msg = parse_tool_calls(HERMES, NAMES, text)
    assert msg.content is None and [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", '{"city": "Par')]


def test_streaming_holds_back_only_what_could_open_a_call():
    parser = ToolCallParser(HERMES, NAMES)
    assert _fold(parser.feed("Hello <tool"))[0] == "Hello"  # the space waits with the marker
    assert _fold(parser.feed("Hello <tooling> is "))[0] == " <tooling> is"  # trailing space waits
    assert _fold(parser.feed("Hello <tooling> is fun\n", final=True))[0] == " fun\n"
    parser = ToolCallParser(HERMES, NAMES)
    _, calls = _fold(parser.feed('<tool_call>\n{"name": "search", "arguments": {"q": "ab'))
    assert calls[0][1:] == ["search", '{"q": "ab']  # arguments stream as they are written


def test_text_after_the_arguments_that_is_not_the_closing_is_content():
    text = '{"name": "noop", "parameters": {}, "extra": 1}'
    msg = parse_tool_calls(LLAMA3, NAMES, text)
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("noop", "{}")]
    assert msg.content == ', "extra": 1}'


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3], ids=lambda f: f.name)
def test_render_call_parses_back(fmt):
    args = json.dumps({"city": "Zürich", "when": ["today", None]}, ensure_ascii=False)
    text = fmt.render_call("get_weather", args) + "\n" + fmt.render_call("noop", "{}")
    msg = parse_tool_calls(fmt, NAMES, text)
    assert msg.content is None
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", args), ("noop", "{}")]


def test_resolve_format():
    assert resolve_format("auto", "{{ '<|im_start|>' + message['role'] }}") is HERMES
    assert resolve_format("auto", None) is HERMES
    assert resolve_format("auto", "{%- if message.role == 'ipython' %}") is LLAMA3
    assert resolve_format("auto", "<|python_tag|>{{ x }}") is LLAMA3
    assert resolve_format("qwen", "<|python_tag|>") is HERMES and resolve_format("llama3", "") is LLAMA3


# ---------------------------------------------------------------------- what the grammar writes

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                       "unit": {"enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False,
    }}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object",
        "properties": {"q": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
                       "nested": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
        "required": ["q"],
    }}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]


def _grammar_texts(fmt: ToolCallFormat, tool_choice, parallel: bool, count: int, seed: int) -> list[str]:
    """Random texts the structural tag of `tool_choice` accepts, walked one character at a time
    (a character vocabulary, plus the markers as single tokens as real tokenizers often have)."""
    xgr = pytest.importorskip("xgrammar")
    vocab = [chr(i) for i in range(32, 127)] + ["\n", "<tool_call>", "</tool_call>", "<|python_tag|>", "</s>"]
    stop = len(vocab) - 1
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[stop])
    tag = xgr.get_model_structural_tag(
        fmt.structural_tag_model, tools=TOOLS, tool_choice=tool_choice, reasoning="disabled",
        parallel_tool_calls=parallel, max_whitespace_cnt=2,
    )
    compiled = xgr.GrammarCompiler(info).compile_structural_tag(tag.model_dump_json())
    rng, texts = random.Random(seed), []
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    while len(texts) < count:
        matcher, out = xgr.GrammarMatcher(compiled), []
        for _ in range(600):
            matcher.fill_next_token_bitmask(bitmask)
            row = bitmask[0].tolist()
            allowed = [i for i in range(len(vocab)) if (row[i // 32] >> (i % 32)) & 1]
            if stop in allowed and (len(allowed) == 1 or rng.random() < 0.3):
                texts.append("".join(out))
                break
            token = rng.choice([i for i in allowed if i != stop])
            assert matcher.accept_token(token)
            out.append(vocab[token])
    return texts


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3], ids=lambda f: f.name)
@pytest.mark.parametrize("choice", ["required", "required-single", "named"])
def test_what_the_grammar_writes_parses_to_valid_calls(fmt, choice):
    jsonschema = pytest.importorskip("jsonschema")
    tool_choice = {"type": "function", "function": {"name": "search"}} if choice == "named" else "required"
    parallel = choice == "required"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for i, text in enumerate(_grammar_texts(fmt, tool_choice, parallel, count=12, seed=hash((fmt.name, choice)) & 0xFFFF)):
        msg = parse_tool_calls(fmt, NAMES, text)
        assert msg.tool_calls, text
        if choice != "required":  # exactly one call and nothing else
            assert len(msg.tool_calls) == 1 and msg.content is None, text
        if choice == "named":
            assert msg.tool_calls[0].name == "search"
        for call in msg.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        cuts = sorted(random.Random(i).sample(range(1, len(text)), k=min(len(text) - 1, 15)))
        _check_same(fmt, text, msg, cuts)
