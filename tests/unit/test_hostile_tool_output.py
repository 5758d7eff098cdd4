"""Model output the tool-call parser (http/openai/tool_call_parser.py) must survive: a `name` that
is not a string, brackets nested past Python's JSON parser, and openings that never complete.
Each is returned as content (never a 500, never an in-band error, never lost), the same streamed
as whole, and parsing is linear in the text however it is cut into feeds."""

from __future__ import annotations

import random
import time

import pytest

from radixserve.http.openai.tool_call_parser import (
    HERMES,
    LLAMA3,
    LOOKAHEAD_CHARS,
    ContentDelta,
    ToolCallParser,
    parse_tool_calls,
)

NAMES = frozenset({"get_weather", "search"})

AS_CONTENT = {
    "name an object": (HERMES, '<tool_call>\n{"name": {"a": 1}, "arguments": {}}\n</tool_call>'),
    "name an object, arguments first": (HERMES, '<tool_call>\n{"arguments": {}, "name": {"a": 1}}\n</tool_call>'),
    "name a list, arguments first": (HERMES, '<tool_call>{"arguments": {}, "name": ["get_weather"]}</tool_call>'),
    "llama name an object": (LLAMA3, '{"name": {"a": 1}, "parameters": {}}'),
    "1200 brackets": (HERMES, "<tool_call>" + "[" * 1200 + "]" * 1200 + "</tool_call>"),
    "1200 brackets, arguments first": (
        HERMES, '<tool_call>{"arguments": ' + "[" * 1200 + "]" * 1200 + ', "name": "search"}</tool_call>',
    ),
    "a type value that never ends": (HERMES, '<tool_call>{"type": "' + "ab " * 600),
    "llama type value that never ends": (LLAMA3, '{"type": "' + "ab " * 600),
}


def _streamed(fmt, text: str, cuts: list[int]) -> tuple[str, list, int]:
    """(content, calls, how many feeds released content) of `text` fed cut at `cuts`."""
    parser = ToolCallParser(fmt, NAMES)
    content, released = "", 0
    for cut in [*cuts, len(text)]:
        pieces = [e.text for e in parser.feed(text[:cut], final=cut == len(text)) if isinstance(e, ContentDelta)]
        content += "".join(pieces)
        released += bool(pieces)
    return content, parser.calls, released


@pytest.mark.parametrize("case", list(AS_CONTENT))
def test_output_that_is_not_a_call_is_content_whole_and_streamed(case):
    fmt, text = AS_CONTENT[case]
    msg = parse_tool_calls(fmt, NAMES, text)
    assert msg.tool_calls == [] and msg.content == text
    rng = random.Random(case)
    for cuts in (list(range(1, len(text), 3)), sorted(rng.sample(range(1, len(text)), min(40, len(text) - 1)))):
        content, calls, _ = _streamed(fmt, text, cuts)
        assert calls == [] and content == text


def test_an_unclosed_opening_is_released_after_the_look_ahead_and_parsing_is_linear():
    """2,000+ tokens of an opening that never completes: every token after the first
    LOOKAHEAD_CHARS characters reaches the client as it comes, and the whole costs milliseconds
    (it rescanned from the start on every feed: 5 s of CPU for 2,000 tokens)."""
    for fmt, start in ((HERMES, '<tool_call>{"type": "'), (LLAMA3, '{"type": "')):
        tokens = 4000
        text = start + "ab " * tokens
        began = time.perf_counter()
        content, calls, released = _streamed(fmt, text, list(range(len(start), len(text), 3)))
        elapsed = time.perf_counter() - began
        assert content == text and calls == []
        assert released >= tokens - LOOKAHEAD_CHARS // 3 - 1, released
        assert elapsed < 2.0, f"{elapsed:.2f} s for {tokens} feeds"


def test_text_that_cannot_become_a_call_is_released_at_once():
    """(A hermes block waits for its closing marker or the look-ahead: its keys may come in any
    order.)"""
    parser = ToolCallParser(HERMES, NAMES)
    assert parser.feed('<tool_call>\n{"name": "get_weather') == []  # may still be a call
    parser = ToolCallParser(LLAMA3, NAMES)
    events = parser.feed('Hi {"name": "rm')  # no tool's name starts with "rm"
    assert "".join(e.text for e in events) == 'Hi {"name": "rm'


def test_a_block_with_arguments_first_is_a_call_within_the_look_ahead_only():
    short = '<tool_call>{"arguments": {"q": "' + "x" * 100 + '"}, "name": "search"}</tool_call>'
    msg = parse_tool_calls(HERMES, NAMES, short)
    assert [c.name for c in msg.tool_calls] == ["search"] and msg.content is None
    long = '<tool_call>{"arguments": {"q": "' + "x" * LOOKAHEAD_CHARS + '"}, "name": "search"}</tool_call>'
    msg = parse_tool_calls(HERMES, NAMES, long)
    assert msg.tool_calls == [] and msg.content == long


def test_long_whitespace_and_tails_are_linear():
    """A model looping on newlines (held back: a call may follow), or on spaces and braces after a
    call's arguments, is scanned once, not once per token."""
    for fmt, text in (
        (HERMES, "Answer." + "\n" * 40000),
        (HERMES, '<tool_call>{"name": "search", "arguments": {"q": 1}' + " }" * 20000),
        (LLAMA3, '{"name": "search", "parameters": {"q": 1}' + " " * 40000),
    ):
        began = time.perf_counter()
        _streamed(fmt, text, list(range(1, len(text), 2)))
        assert time.perf_counter() - began < 2.0, text[:30]
