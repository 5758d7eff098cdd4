"""Checking a client's JSON schema before it becomes a grammar: how deep it nests, and whether it
uses a keyword the grammar would silently leave unenforced.

xgrammar 0.2.8 compiles a schema it only partly understands without a word: `{"not": {...}}`,
`if`/`then`/`else`, an `allOf` of several schemas, a `$ref` that is not local (`http://...`,
`file:///...`, `other.json#/a`) and dependent keywords all become "any JSON value", and the
client gets a 200 with output the schema forbids. We refuse those with a 400 naming the keyword,
rather than hand back unconstrained output under a schema's name. Keywords it ignores that only
annotate (`description`, `title`, `examples`, ...) or merely loosen (`uniqueItems`, which pydantic
writes for sets) are let through.

Both walks are iterative: a schema nested thousands of levels deep must not overflow the stack of
the check meant to refuse it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixserve.front.types import InvalidRequest

# Levels of JSON nesting (objects and arrays) a schema may have: about 30 levels of nested
# `properties`. Deeper ones are refused before any work: pydantic fails to serialize a tool
# schema past ~250 levels, and compile time grows with depth.
MAX_SCHEMA_DEPTH = 64

_UNENFORCED = {
    "not": "`not`", "if": "`if`/`then`/`else`", "then": "`if`/`then`/`else`", "else": "`if`/`then`/`else`",
    "dependentRequired": "`dependentRequired`", "dependentSchemas": "`dependentSchemas`",
    "dependencies": "`dependencies`", "$dynamicRef": "`$dynamicRef`", "$recursiveRef": "`$recursiveRef`",
}
# keyword -> how its value holds subschemas: one schema, a list of them, or a map of them
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
        "contains", "propertyNames")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def check_json_schema(schema: Any, what: str, param: str) -> None:
    """Refuse (`InvalidRequest` on `param`) a schema nested deeper than `MAX_SCHEMA_DEPTH` or
    using a keyword the grammar cannot enforce; `what` names the schema in the message."""
    check_depth(schema, what, param)
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, Mapping):
            continue  # true / false, or a malformed subschema xgrammar will refuse itself
        where = f"{what}{' at ' + _short_path(path) if path else ''}"
        for key in node:
            if key in _UNENFORCED:
                raise InvalidRequest(f"{where}: {_UNENFORCED[key]} cannot be enforced by the grammar; remove it", param)
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
            raise InvalidRequest(
                f"{where}: `$ref` {_short(ref)} cannot be enforced: only local references (\"#/...\") are followed",
                param,
            )
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            raise InvalidRequest(
                f"{where}: `allOf` with {len(all_of)} schemas cannot be enforced by the grammar (one is); "
                "merge them into one schema",
                param,
            )
        for key in _ONE:
            if key in node:
                stack.append((node[key], f"{path}.{key}".lstrip(".")))
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{path}.{key}[{i}]".lstrip(".")) for i, sub in enumerate(node[key]))
        if isinstance(node.get("items"), list):  # draft 4's tuple form
            stack.extend((sub, f"{path}.items[{i}]".lstrip(".")) for i, sub in enumerate(node["items"]))
        for key in _MAP:
            if isinstance(node.get(key), Mapping):
                stack.extend((sub, f"{path}.{key}.{name}".lstrip(".")) for name, sub in node[key].items())


def check_depth(value: Any, what: str, param: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """Refuse a JSON value nested more than `limit` levels deep (an object or array is one)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, Mapping) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            raise InvalidRequest(f"{what} is nested more than {limit} levels deep; at most {limit} are allowed", param)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (Mapping, list)))


def _short_path(path: str, limit: int = 200) -> str:
    """A path in the schema for a message: its end, when property names make it long."""
    return path if len(path) <= limit else f"...{path[-limit:]}"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."
