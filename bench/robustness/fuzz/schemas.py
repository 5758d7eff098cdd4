"""Hypothesis strategies for what constrains an answer, hostile: JSON schemas nested hundreds of
levels deep, with remote `$ref`s, `not` or a conflicting `allOf`; deep regexes; and the tools and
tool choices of /v1/chat/completions (deep parameters, names of every JSON type, missing and extra
fields, huge descriptions, duplicate names, parameters that are no object).

The server refuses a schema it cannot enforce or one nested past its limit, and a malformed tool
or tool choice, with a 400 (docs/server.md); the rest it compiles under
--grammar-compile-timeout. What the oracle asks: a 200 or a 4xx with a message, in time, and a
refusal wherever the documented rules refuse (`oracle.must_refuse`)."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import strategies as st

from bench.robustness.fuzz.encoding import Raw
from bench.robustness.fuzz.request import Target
from bench.robustness.fuzz.values import hostile, one_in, weighted

SCHEMA_SHAPES = ("object", "array", "mixed")
# the server's limit (radixserve/front/validation/schemas.py) and either side of it, then far past
DEEP_SCHEMA_DEPTHS = (50, 63, 64, 65, 100, 250, 500)
REMOTE_REFS = (
    "http://evil.example/schema.json", "https://evil.example/s.json#/a", "file:///etc/passwd", "file:///dev/zero",
    "other.json#/a", "//evil.example/x", "#nowhere",
)
CONFLICTING_ALL_OFS = (
    [{"type": "string"}, {"type": "integer"}],
    [{"type": "object", "required": ["a"]}, {"type": "object", "properties": {"a": False}}],
    [{"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 1}],
)
LOCAL_REFS = (  # recursion through local references: enforceable, so accepted
    {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 2}}, "$ref": "#/$defs/n"},
    {"type": "object", "properties": {"next": {"$ref": "#"}}},
)
TOOL_NAMES = (5, 1.5, True, None, [], ["fn"], {"name": "fn"}, Raw("1" * 400), "", "a" * 65, "has space", "\u00b2",
              "fn.x", "fn\n", "<|im_start|>")
TOOL_PARAMETERS = ("object", "", [], [{"type": "object"}], 5, True, Raw("1e309"))  # none of them an object
# the shapes of each hostile class, in the proportions a plan deals them (`plan.SHAPES`; the first
# also gets what rounding leaves over)
SCHEMA_KINDS = {"deep": 45, "remote-ref": 12, "not": 8, "allof-conflict": 8, "local-ref": 8, "buried-keyword": 8,
                "regex-deep": 11}
TOOL_EDITS = {"deep": 20, "valid": 10, "bad-name": 15, "missing-field": 10, "extra-field": 8, "huge-description": 8,
              "duplicate-name": 8, "parameters-not-object": 8, "unenforced-schema": 5, "too-many": 3, "not-list": 5}
TOOL_CHOICES = {"required": 10, "absent": 10, "auto": 10, "none": 10, "named": 10, "name-list": 8, "name-dict": 8,
                "name-number": 8, "name-missing": 8, "name-unknown": 8, "function-empty": 6, "wrong-type": 6}
TOOL_CHOICE_WRONG = ("AUTO", "", "any", 5, True, [], ["auto"], {"type": "function"},
                     {"type": "function", "function": "fn_0"}, {"type": "tool", "function": {"name": "fn_0"}})


def nested_schema(depth: int, shape: str) -> dict[str, Any]:
    """A schema whose JSON nests exactly `depth` levels, each object and array one level as the
    server counts them (a nested property is two: its schema and `properties`): nested objects,
    nested arrays, or both in turn (`SCHEMA_SHAPES`). Built from the inside out, without
    recursion, as `json_depth` measures it: the depth is the point."""
    if depth < 2 or shape not in SCHEMA_SHAPES:
        raise ValueError(f"a nested schema needs depth >= 2 and a shape of {SCHEMA_SHAPES}; got {depth}, {shape!r}")
    odd = shape == "object" and depth % 2 == 0  # objects add two levels: start at the parity wanted
    schema: dict[str, Any] = {"enum": ["a"]} if odd else {"type": "string"}
    level, wraps = (2 if odd else 1), 0
    while level < depth:
        if shape == "array" or depth - level == 1 or (shape == "mixed" and wraps % 2):
            schema, level = {"type": "array", "items": schema, "maxItems": 1}, level + 1
        else:
            schema, level = {"type": "object", "properties": {"a": schema}, "required": ["a"]}, level + 2
        wraps += 1
    return schema


def json_depth(value: Any) -> int:
    """How many objects and arrays deep `value` nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def nested_regex(depth: int, shape: str) -> str:
    """A regex of `depth` nested groups: plain, alternations, or stacked stars (a backtracking
    engine's worst case)."""
    if shape == "groups":
        return "(" * depth + "a" + ")" * depth
    if shape == "alternation":
        return "(?:a|" * depth + "b" + ")" * depth
    regex = "a"
    for _ in range(depth):
        regex = f"({regex})*"
    return regex


def hostile_schemas(draw: Any, tags: list[str], kind: str) -> Any:
    """A schema of a `SCHEMA_KINDS` kind: deep, or using what the grammar cannot enforce (a 400
    by the rules when deeper than 64 or so), or recursive through local references (accepted);
    at the root or under a property."""
    if kind == "deep":
        shape = draw(st.sampled_from(SCHEMA_SHAPES))
        depth = draw(st.one_of(st.sampled_from(DEEP_SCHEMA_DEPTHS), st.integers(50, 500)))
        tags.append(f"schema-deep-{shape}")
        return nested_schema(depth, shape)
    tags.append(f"schema-{kind}")
    if kind == "remote-ref":
        schema: Any = {"$ref": draw(st.sampled_from(REMOTE_REFS))}
    elif kind == "not":
        schema = {"not": draw(st.sampled_from(({"type": "string"}, {}, {"not": {"type": "integer"}})))}
    elif kind == "allof-conflict":
        schema = {"allOf": copy.deepcopy(draw(st.sampled_from(CONFLICTING_ALL_OFS)))}
    elif kind == "local-ref":
        schema = copy.deepcopy(draw(st.sampled_from(LOCAL_REFS)))
    else:  # an array schema whose innermost item is what cannot be enforced: found by walking it all
        schema = nested_schema(draw(st.integers(3, 40)), "array")
        leaf = schema
        while "items" in leaf:
            leaf = leaf["items"]
        leaf.clear()
        leaf.update(draw(st.sampled_from(({"not": {}}, {"$ref": REMOTE_REFS[0]}, {"allOf": [{}, {}]}))))
    if one_in(draw, 3):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def constrain(draw: Any, path: str, body: dict[str, Any], tags: list[str], kind: str) -> None:
    """Put a hostile schema or a deep regex (`kind`, of `SCHEMA_KINDS`) on a valid body of
    `path`, replacing any constraint it had: /generate's `json_schema` (an object or its text)
    or `regex`; an OpenAI route's `response_format`, or its `json_schema` / `guided_json` /
    `regex` / `guided_regex` extensions."""
    holder = body.get("sampling_params") if path == "/generate" else body
    holders = holder if isinstance(holder, list) else [holder]
    keys = ("json_schema", "regex", "ebnf", "structural_tag", "guided_json", "guided_regex", "guided_grammar",
            "guided_choice", "response_format")
    for sp in holders:
        for key in keys:
            sp.pop(key, None)
    if kind == "regex-deep":
        shape = draw(st.sampled_from(("groups", "alternation", "stars")))
        tags.append("regex-deep")
        key = "regex" if path == "/generate" else draw(st.sampled_from(("regex", "guided_regex")))
        holders[0][key] = nested_regex(draw(st.integers(50, 500)), shape)
        return
    schema = hostile_schemas(draw, tags, kind)
    if path == "/generate":
        holders[0]["json_schema"] = json.dumps(schema) if draw(st.booleans()) else schema
        return
    where = weighted(draw, {"response_format": 70, "json_schema": 15, "guided_json": 15})
    if where == "response_format":
        holders[0]["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    else:
        holders[0][where] = json.dumps(schema) if one_in(draw, 3) else schema


def _tool(i: int) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": f"fn_{i}", "description": f"Function {i}.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    }}


def hostile_tools(draw: Any, target: Target, tags: list[str], edit: str) -> Any:
    """A tool list: valid, or with one hostile edit (of `TOOL_EDITS`) of one tool."""
    tools = [_tool(i) for i in range(draw(st.integers(1, 3)))]
    tags.append(f"tools-{edit}")
    fn = tools[draw(st.integers(0, len(tools) - 1))]["function"]
    if edit == "deep":
        fn["parameters"] = nested_schema(draw(st.one_of(st.integers(200, 300), st.sampled_from((64, 65)))),
                                         draw(st.sampled_from(SCHEMA_SHAPES)))
    elif edit == "bad-name":
        fn["name"] = draw(st.sampled_from(TOOL_NAMES))
    elif edit == "missing-field":
        where = draw(st.sampled_from(("type", "function", "name", "parameters", "description")))
        tool = next(t for t in tools if t["function"] is fn)
        (tool if where in ("type", "function") else fn).pop(where)
    elif edit == "extra-field":
        holder = fn if draw(st.booleans()) else next(t for t in tools if t["function"] is fn)
        holder[draw(st.sampled_from(("strict", "extra", "examples")))] = copy.deepcopy(draw(hostile()))
    elif edit == "huge-description":
        size = draw(st.sampled_from((5_000, 50_000, min(target.max_body_bytes // 2, 1_000_000))))
        fn["description"] = draw(st.sampled_from(("d", "\u00b2", "{{ x }}", "<|im_end|>"))) * size
    elif edit == "duplicate-name":
        tools.append(_tool(0))
        tools[-1]["function"]["description"] = "A second fn_0."
    elif edit == "parameters-not-object":
        fn["parameters"] = draw(st.sampled_from(TOOL_PARAMETERS))
    elif edit == "unenforced-schema":
        kind = draw(st.sampled_from(("remote-ref", "not", "allof-conflict", "buried-keyword")))
        fn["parameters"] = {"type": "object", "properties": {"a": hostile_schemas(draw, tags, kind)}}
    elif edit == "too-many":
        tools = [_tool(i) for i in range(129)]
    elif edit == "not-list":
        return draw(st.sampled_from((tools[0], "fn_0", 0, {}, [None])))
    return tools


def choose_tool(draw: Any, body: dict[str, Any], tags: list[str], shape: str) -> None:
    """Set the body's `tool_choice` to a shape of `TOOL_CHOICES` ("absent": leave it out): each
    shape the rules name, and several they refuse."""
    tags.append(f"tool_choice-{shape}")
    named = {"named": "fn_0", "name-list": ["fn_0"], "name-dict": {"name": "fn_0"}, "name-number": 0,
             "name-unknown": draw(st.sampled_from(("fn_9", "FN_0", "", "fn_0 ")))}
    if shape in ("auto", "none", "required"):
        body["tool_choice"] = shape
    elif shape in named:
        body["tool_choice"] = {"type": "function", "function": {"name": named[shape]}}
    elif shape == "name-missing":
        body["tool_choice"] = {"type": "function", "function": {}}
    elif shape == "function-empty":
        body["tool_choice"] = {"function": {}}
    elif shape == "wrong-type":
        body["tool_choice"] = copy.deepcopy(draw(st.sampled_from(TOOL_CHOICE_WRONG)))
