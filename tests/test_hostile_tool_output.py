"""Model output the tool-call parser (http/openai/tool_call_parser.py) must survive: a `name` that
is not a string, brackets nested past Python's JSON parser, and openings that never complete.
Each is returned as content (never a 500, never an in-band error, never lost), the same streamed
as whole."""

from __future__ import annotations

import random

import pytest

from radixserve.http.openai.tool_call_parser import (
    HERMES,
    LLAMA3,
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
