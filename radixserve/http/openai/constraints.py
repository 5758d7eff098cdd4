"""Which decoding constraint an OpenAI request asks for, as the one sampling key the scheduler
compiles (`json_schema`, `regex`, `ebnf` or `structural_tag`).

Sources, at most one per request (two are a 400: a sample decodes under one grammar):
- `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}` (any JSON object),
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}` (the
  schema; `strict` or not, it holds), and SGLang's `{"type": "structural_tag", ...}`;
- the extension keys SGLang reads from the body: `json_schema`, `regex`, `ebnf`,
  `structural_tag`; and vLLM's older `guided_json`, `guided_regex`, `guided_grammar`,
  `guided_choice` (a list of strings: the answer is one of them);
- tools with `tool_choice: "required"` or a named function (`front.tools`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixserve.front.types import InvalidRequest
from radixserve.front.validation.schemas import check_json_schema

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
ANY_OBJECT = {"type": "object"}
# body key -> the sampling key it becomes
_EXTENSIONS = {
    "json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf", "structural_tag": "structural_tag",
    "guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "ebnf", "guided_choice": "ebnf",
}


@dataclass(frozen=True)
class Constraint:
    """One constraint: the sampling key and its value, the body field it came from (errors name
    it), and for JSON response formats the schema object (tool choice `auto` combines with it)."""

    kind: str
    text: str
    source: str
    answer_schema: Any = None


def body_constraint(body: Mapping[str, Any]) -> Constraint | None:
    """The constraint of `response_format` or of an extension key; a 400 if there are two."""
    found = [c for c in (_response_format(body.get("response_format")), *_extensions(body)) if c is not None]
    if len(found) > 1:
        raise InvalidRequest(
            f"give at most one decoding constraint; got `{found[0].source}` and `{found[1].source}`",
            param=found[1].source,
        )
    return found[0] if found else None


def _response_format(fmt: Any) -> Constraint | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _json(ANY_OBJECT)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidRequest("`response_format.json_schema` must be an object with `name` and `schema`", param="response_format")
        name = spec.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequest(
                f"`response_format.json_schema.name` must be 1 to 64 letters, digits, '_' or '-'; got {name!r}",
                param="response_format",
            )
        schema = spec.get("schema")
        if schema is not None and not isinstance(schema, (Mapping, bool)):
            raise InvalidRequest("`response_format.json_schema.schema` must be a JSON schema object", param="response_format")
        if schema is not None:
            check_json_schema(schema, "`response_format.json_schema.schema`", "response_format")
        for key in ("strict",):
            if spec.get(key) is not None and type(spec[key]) is not bool:
                raise InvalidRequest(f"`response_format.json_schema.{key}` must be a boolean", param="response_format")
        return _json(ANY_OBJECT if schema is None else schema)
    if kind == "structural_tag":  # SGLang's: the whole object is the tag
        return Constraint("structural_tag", json.dumps(fmt, ensure_ascii=False), "response_format")
    raise InvalidRequest(
        '`response_format.type` must be "text", "json_object", "json_schema" or "structural_tag"',
        param="response_format",
    )


def _json(schema: Any) -> Constraint:
    return Constraint("json_schema", json.dumps(schema, ensure_ascii=False), "response_format", answer_schema=schema)


def _extensions(body: Mapping[str, Any]) -> list[Constraint | None]:
    out: list[Constraint | None] = []
    for key, kind in _EXTENSIONS.items():
        value = body.get(key)
        if value is None:
            continue
        if key == "guided_choice":
            if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
                raise InvalidRequest("`guided_choice` must be a non-empty list of strings", param=key)
            value = "root ::= " + " | ".join(json.dumps(v, ensure_ascii=False) for v in value)
        elif kind in ("json_schema", "structural_tag") and isinstance(value, (Mapping, bool)):
            if kind == "json_schema":
                check_json_schema(value, f"`{key}`", key)
            value = json.dumps(value, ensure_ascii=False)
        if not isinstance(value, str):
            raise InvalidRequest(f"`{key}` must be a string", param=key)
        out.append(Constraint(kind, value, key))
    return out
