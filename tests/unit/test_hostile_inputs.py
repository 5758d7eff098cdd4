"""Hostile inputs found by a sweep, each a 4xx naming the field (never a 5xx), checked without a
server: tool_choice, pin options, tool and response schemas too deep or not enforceable, and
model output the tool-call parser must hand back as content."""

from __future__ import annotations

import json

import pytest

from radixserve.front.types import InvalidRequest
from radixserve.front.validation.inputs import check_pin_options
from radixserve.front.validation.limits import Limits
from radixserve.front.validation.sampling import parse_sampling_params
from radixserve.front.validation.schemas import MAX_SCHEMA_DEPTH
from radixserve.http.openai.constraints import body_constraint
from radixserve.http.openai.tool_call_parser import HERMES
from radixserve.http.openai.tool_requests import parse_tool_request, structural_tag

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


# ---------------------------------------------------------------------- schemas: depth, keywords



def _nested(levels: int) -> dict:
    """An object schema with `levels` nested properties: 2 JSON levels each."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _sampling(schema) -> None:
    parse_sampling_params({"json_schema": schema}, vocab_size=100, limits=Limits())


@pytest.mark.parametrize("levels", [150, 250, 5000])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_tool_parameters_nested_too_deep_are_a_400(levels, choice):
    err = _error(parse_tool_request, {"tools": [_tool(_nested(levels))], "tool_choice": choice})
    assert err.param == "tools" and f"at most {MAX_SCHEMA_DEPTH}" in err.message and "parameters" in err.message


@pytest.mark.parametrize("levels", [150, 5000])
def test_response_schemas_nested_too_deep_are_a_400(levels):
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(levels)}}}
    assert _error(body_constraint, body).param == "response_format"
    assert _error(body_constraint, {"json_schema": _nested(levels)}).param == "json_schema"
    assert _error(_sampling, _nested(levels)).param == "json_schema"


def test_a_schema_just_within_the_depth_limit_compiles_into_a_tool_grammar():
    levels = (MAX_SCHEMA_DEPTH - 1) // 2
    request = parse_tool_request({"tools": [_tool(_nested(levels))], "tool_choice": "required"})
    assert "properties" in structural_tag(request, HERMES)


UNENFORCEABLE = {
    "remote ref": ({"$ref": "http://example.com/schema.json"}, "$ref"),
    "file ref": ({"$ref": "file:///etc/passwd"}, "$ref"),
    "relative ref": ({"type": "object", "properties": {"a": {"$ref": "other.json#/a"}}}, "$ref"),
    "not": ({"not": {}}, "not"),
    "nested not": ({"type": "object", "properties": {"a": {"anyOf": [{"not": {"type": "string"}}]}}}, "not"),
    "allOf of two": ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
    "if then": ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "if"),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
}


@pytest.mark.parametrize("name", UNENFORCEABLE)
def test_schemas_the_grammar_cannot_enforce_are_a_400_naming_the_keyword(name):
    schema, keyword = UNENFORCEABLE[name]
    rf = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    errors = [
        _error(body_constraint, rf),
        _error(body_constraint, {"json_schema": schema}),
        _error(_sampling, schema),
        _error(_sampling, json.dumps(schema)),  # SGLang's json_schema as text
        _error(parse_tool_request, {"tools": [_tool(schema)], "tool_choice": "required"}),
        _error(parse_tool_request, {"tools": [_tool(schema)], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ]
    for err, param in zip(errors, ["response_format", "json_schema", "json_schema", "json_schema", "tools", "tools"]):
        assert err.param == param and f"`{keyword}" in err.message, err.message


ENFORCEABLE = {
    "local ref": {"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a"},
    "root ref": {"type": "object", "properties": {"child": {"$ref": "#"}}},
    "allOf of one (pydantic)": {"type": "object", "properties": {"a": {"allOf": [{"$ref": "#/$defs/A"}]}},
                                "$defs": {"A": {"type": "integer"}}},
    "keywords as property names": {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"},
                                                                   "$ref": {"type": "string"}}},
    "keywords in values": {"enum": [{"not": 1}, {"$ref": "http://x"}], "default": {"allOf": [1, 2]}},
    "booleans": True,
}


@pytest.mark.parametrize("name", ENFORCEABLE)
def test_schemas_the_grammar_enforces_pass(name):
    schema = ENFORCEABLE[name]
    rf = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    assert body_constraint(rf).kind == "json_schema"
    if isinstance(schema, dict):
        _sampling(schema)
        assert parse_tool_request({"tools": [_tool(schema)], "tool_choice": "required"}).choice == "required"


def test_tool_choice_auto_shows_unenforceable_schemas_without_refusing_them():
    """Nothing is compiled for `auto`: the schema is only shown to the model, as OpenAI does."""
    assert parse_tool_request({"tools": [_tool({"not": {}})], "tool_choice": "auto"}).choice == "auto"


def test_the_path_in_a_schema_error_is_cut_short():
    schema = {"type": "object", "properties": {"k" * 5000: {"type": "object", "properties": {"b": {"not": {}}}}}}
    err = _error(body_constraint, {"json_schema": schema})
    assert "properties.b" in err.message and len(err.message) < 500
