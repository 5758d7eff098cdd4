"""Hostile inputs found by a sweep, each a 4xx naming the field (never a 5xx), checked without a
server: tool_choice, pin options, tool and response schemas too deep or not enforceable, and
model output the tool-call parser must hand back as content."""

from __future__ import annotations

import pytest

from radixserve.front.types import InvalidRequest
from radixserve.http.openai.tool_requests import parse_tool_request

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}


def _error(fn, *args, **kwargs) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        fn(*args, **kwargs)
    return err.value


@pytest.mark.parametrize("choice", [
    {"type": "function", "function": {"name": ["get_weather"]}},
    {"type": "function", "function": {"name": {"a": 1}}},
    {"type": "function", "function": {}},
    {"function": {}},
])
def test_tool_choice_with_a_name_that_is_not_a_string_is_a_400(choice):
    err = _error(parse_tool_request, {"tools": [WEATHER], "tool_choice": choice})
    assert err.param == "tool_choice" and "tool_choice" in err.message
