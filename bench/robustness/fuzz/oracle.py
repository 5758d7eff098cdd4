"""The oracle: what every answer must be, what the documented rules say must be refused, and
which aborts no abort call explains."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from bench.robustness.fuzz.client import Answer
from bench.robustness.fuzz.encoding import json_or_none
from bench.robustness.fuzz.request import GENERATING, FuzzRequest, Target
from bench.robustness.fuzz.schemas import json_depth
from bench.robustness.fuzz.values import SAMPLING_KEYS, SGLANG_UNSUPPORTED, UNKNOWN_KEYS

PIN_ROUTES = ("/cache/pin", "/cache/unpin")


@dataclass
class Outcome:
    """One request's fate: its problems (kind, detail), and what the abort check needs."""

    index: int
    route: str
    status: int | None
    start: float
    end: float
    problems: list[tuple[str, str]] = field(default_factory=list)
    note: str | None = None  # left, hang, overloaded, closed-over-limit
    aborted: list[str | None] = field(default_factory=list)  # labels of sequences that ended in "abort"
    abort_call: tuple[str | None, bool] | None = None  # an /abort_request that answered 200: (rid, all)


# An error names what was wrong; it does not echo a client's huge value back (a 4,000-digit id, a
# 100 kB key): a message past this many characters is a finding
MAX_ERROR_CHARS = 1000


def judge(req: FuzzRequest, ans: Answer, limit: int) -> tuple[list[tuple[str, str]], str | None]:
    """The per-request oracle: (problems, a note on an allowed special case)."""
    over = len(req.payload()) > limit and req.body is not None
    if ans.left:
        return [], "left"
    if ans.status is None:
        if over:  # the server may close while the rest of an oversized body is still coming
            return [], "closed-over-limit"
        return [("connection", ans.error or "no answer")], None
    problems: list[tuple[str, str]] = []
    text = ans.body.decode("utf-8", "replace")
    if ans.status >= 500:
        if ans.status == 503 and error_code(ans.body) == "overloaded":
            return [], "overloaded"
        return [("5xx", f"{ans.status} {text[:500]}")], None
    if over and req.route in GENERATING and ans.status != 413:
        problems.append(("limit-not-enforced", f"{len(req.payload())} bytes > {limit} answered {ans.status}"))
    if ans.status == 413 and not over:
        problems.append(("unexpected-413", f"{len(req.payload())} bytes <= {limit}"))
    if 300 <= ans.status < 400:
        problems.append(("redirect", f"{ans.status} {ans.headers.get('location')!r}"))
        return problems, None
    if ans.status >= 400:
        message = error_message(ans.body)
        if req.method != "HEAD" and message is None:
            problems.append(("bad-error-body", f"{ans.status} {text[:300]!r}"))
        elif message is not None and len(message) > MAX_ERROR_CHARS:
            problems.append(("long-error", f"{ans.status}, {len(message)} characters: {message[:300]!r}"))
        return problems, None
    if ans.events is not None:
        for event in ans.events:
            try:
                data = json.loads(event)
            except ValueError:
                problems.append(("bad-event", event[:300]))
                continue
            if isinstance(data, dict) and "error" in data:
                problems.append(("stream-error", event[:500]))
        if not ans.done:
            problems.append(("stream-unfinished", f"{len(ans.events)} events, no [DONE]"))
    elif req.method != "HEAD" and req.route != "/metrics":
        try:
            json.loads(ans.body)
        except ValueError:
            problems.append(("bad-json", text[:300]))
    return problems, None


# The documented per-request rules (docs/server.md), written out again as the oracle for
# answers that must be refused. name -> (low, high, low excluded); ints are typed as numbers too
_FLOAT_RULES = {
    "temperature": (0.0, 100.0, False), "top_p": (0.0, 1.0, True), "min_p": (0.0, 1.0, False),
    "frequency_penalty": (-2.0, 2.0, False), "presence_penalty": (-2.0, 2.0, False),
    "repetition_penalty": (0.01, 10.0, False),
}
_BOOL_RULES = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_TOKEN_KEY = re.compile(r"[0-9]{1,10}")
# what an OpenAI error must not name unless the client sent it: our internal names
_INTERNAL_PARAMS = frozenset({"max_new_tokens", "min_new_tokens", "top_logprobs_num", "sampling_params",
                              "input_ids", "text", "return_logprob", "logprob_start_len"})


def must_refuse(route: str, body: Any, target: Target) -> str | None:
    """Why the documented rules refuse this body whatever else it holds, or None when they may
    accept it (the oracle for 2xx answers to bodies that break a rule)."""
    if not isinstance(body, dict):
        return "the body is not a JSON object"
    if route in PIN_ROUTES:
        return _pin_refusal(route, body, target)
    if route == "/generate":
        unknown = [k for k in body if k in UNKNOWN_KEYS]
        unknown += [k for k in body if k in SGLANG_UNSUPPORTED and not _empty(body[k])]
        if unknown:
            return f"unknown or unsupported field {unknown[0]!r}"
        if body.get("cache_salt") == "" or body.get("rid") == "":
            return "an empty cache_salt or rid"
        rid = body.get("rid")
        named = [r for r in rid if isinstance(r, str)] if isinstance(rid, list) else []
        if len(set(named)) < len(named):
            return "a rid twice in one batch"
        sps = body.get("sampling_params")
        for sp in sps if isinstance(sps, list) else [sps]:
            if isinstance(sp, dict):
                if any(k in UNKNOWN_KEYS and k not in SAMPLING_KEYS for k in sp):
                    return "an unknown sampling parameter"
                why = _sampling_refusal(sp, target, "max_new_tokens", "min_new_tokens") or _schemas_refusal(sp, ("json_schema",))
                if why:
                    return why
        return None
    if body.get("cache_salt") == "":
        return "an empty cache_salt"
    chat = route.endswith("chat/completions")
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    return (_sampling_refusal(body, target, max_key, "min_tokens") or _response_format_refusal(body)
            or _schemas_refusal(body, ("json_schema", "guided_json")) or (_tools_refusal(body) if chat else None))


# A JSON schema for output (docs/server.md, "/generate"): at most 64 levels of objects and arrays;
# no `not`, no `$ref` but a local one, no `allOf` of several schemas (the grammar cannot enforce
# them). Only the places the fuzzer puts these are walked, so a keyword found is one the server
# must have seen.
MAX_SCHEMA_DEPTH = 64
_SCHEMA_ONE, _SCHEMA_MAP = ("items", "additionalProperties"), ("properties", "$defs")
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def schema_refusal(schema: Any) -> str | None:
    """Why the documented rules refuse this schema, or None."""
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        return f"a schema nested more than {MAX_SCHEMA_DEPTH} levels"
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if "not" in node:
            return "a schema with `not`"
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
            return f"a schema with a `$ref` that is not local ({ref!r:.60})"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return "a schema with an `allOf` of several schemas"
        stack += [node[k] for k in _SCHEMA_ONE if k in node]
        stack += node["anyOf"] if isinstance(node.get("anyOf"), list) else []
        stack += [sub for k in _SCHEMA_MAP if isinstance(node.get(k), dict) for sub in node[k].values()]
    return None


def _schemas_refusal(holder: dict[str, Any], keys: Sequence[str]) -> str | None:
    """A schema given under one of `keys` (an object, or its JSON text) that the rules refuse."""
    for key in keys:
        value = holder.get(key)
        if isinstance(value, str):
            value = json_or_none(value.encode("utf-8", "surrogatepass"))
        if isinstance(value, (dict, bool)):
            why = schema_refusal(value)
            if why:
                return f"{why} in `{key}`"
    return None


def _response_format_refusal(body: dict[str, Any]) -> str | None:
    fmt = body.get("response_format")
    spec = fmt.get("json_schema") if isinstance(fmt, dict) and fmt.get("type") == "json_schema" else None
    schema = spec.get("schema") if isinstance(spec, dict) else None
    why = schema_refusal(schema) if isinstance(schema, (dict, bool)) else None
    return f"{why} in `response_format`" if why else None


def _tools_refusal(body: dict[str, Any]) -> str | None:
    """Chat tools (docs/compatibility.md, "Tool calling"): a list of at most 128 function tools
    with names of 1-64 letters, digits, `_` or `-`, each once, a string description, parameters
    an object at most 64 levels deep, a boolean `strict`; a `tool_choice` of "none", "auto",
    "required" or a function of the list by name (only "none" and "auto" without tools); and
    the schemas a required or named choice compiles as a schema's rules say."""
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            return f"`{key}`, the deprecated function calling"
    if body.get("parallel_tool_calls") is not None and type(body["parallel_tool_calls"]) is not bool:
        return "a parallel_tool_calls that is not a boolean"
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        return None if choice in (None, "none", "auto") else "a tool_choice without tools"
    if not isinstance(tools, list) or len(tools) > 128:
        return "tools that are not a list of at most 128"
    functions = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function":
            return "a tool that is not {\"type\": \"function\", \"function\": {...}}"
        name, params = fn.get("name"), fn.get("parameters")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            return f"a tool name {name!r:.40} out of the rules"
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            return "a tool description that is not a string"
        if params is not None and (not isinstance(params, dict) or json_depth(params) > MAX_SCHEMA_DEPTH):
            return "tool parameters that are no object, or nested too deep"
        if fn.get("strict") is not None and type(fn["strict"]) is not bool:
            return "a tool's strict that is not a boolean"
        functions.append(fn)
    names = [fn["name"] for fn in functions]
    if len(set(names)) < len(names):
        return "two tools of one name"
    if choice in (None, "none", "auto"):
        return None
    forced = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if choice != "required" and not (isinstance(forced, dict) and forced.get("name") in names):
        return f"a tool_choice {json.dumps(choice)[:60]} out of the rules"
    for fn in functions:
        if choice == "required" or fn["name"] == forced.get("name"):
            why = schema_refusal(fn.get("parameters") or {})
            if why:
                return f"{why} in a tool a tool_choice forces"
    return None


def _pin_refusal(route: str, body: dict[str, Any], target: Target) -> str | None:
    """/cache/pin and /cache/unpin (docs/server.md): known fields only; exactly one of `text` and
    `input_ids` (on unpin, or a `pin_id` alone, an integer); `tier` "memory" or "disk" (this
    with a disk tier only); `ttl` a finite number > 0."""
    known = ("text", "input_ids", "cache_salt") + (("tier", "ttl") if route == "/cache/pin" else ("pin_id",))
    unknown = [k for k in body if k not in known]
    if unknown:
        return f"an unknown field {unknown[0]!r:.40}"
    if "pin_id" in body:
        if len(body) > 1:
            return "a pin_id with a prefix"
        return None if type(body["pin_id"]) is int else "a pin_id that is not an integer"
    if (body.get("text") is None) == (body.get("input_ids") is None):
        return "not exactly one of text and input_ids"
    if route == "/cache/pin":
        tier, ttl = body.get("tier", "memory"), body.get("ttl")
        if tier not in ("memory", "disk") or (tier == "disk" and not target.disk_tier):
            return f"a tier {tier!r:.40} this server does not have"
        if ttl is not None and ((_as_float(ttl) or 0) <= 0):
            return f"a ttl {ttl!r:.40} that is not a finite number > 0"
    return None


# What a foreign web page can make a browser send is refused before any route runs
# (docs/server.md, "Browsers"): a Host that does not name the server 421, then a foreign Origin
# 403; then a route answers a method it does not take 405, and a JSON route a body not declared
# `application/json` 415 (after the 413 of a body over the limit).
POST_ONLY = frozenset({*GENERATING, "/abort_request", "/flush_cache", "/reset_prefix_cache", *PIN_ROUTES})
JSON_ROUTES = frozenset({*GENERATING, "/abort_request", *PIN_ROUTES})


def must_refuse_request(req: FuzzRequest, target: Target) -> tuple[int, str] | None:
    """The status the browser and method rules give this request whatever its body, and why; or
    None. A name is foreign when it is under .example (RFC 2606: no server of a plan's has one),
    an Origin also when it is "null" or not http(s)."""
    headers = {k.lower(): v for k, v in req.headers.items()}
    host = headers.get("host")
    if target.browser_rules and host is not None and _foreign_name(host.rsplit(":", 1)[0]):
        return 421, f"a foreign Host {host!r}"
    origin = headers.get("origin")
    if target.browser_rules and origin is not None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname or _foreign_name(parts.hostname):
            return 403, f"a foreign Origin {origin!r}"
    path = urlsplit(req.path).path
    if path in POST_ONLY and req.method != "POST":
        return 405, f"{req.method} on {path}, a POST route"
    declared = req.content_type if req.body is not None else None
    media = (declared or "").split(";", 1)[0].strip().lower()
    if path in JSON_ROUTES and media != "application/json" and len(req.payload()) <= target.max_body_bytes:
        return 415, f"a body declared {declared!r}, not JSON"
    return None


def _foreign_name(name: str) -> bool:
    name = name.strip().lower().rstrip(".")
    return name == "example" or name.endswith(".example")


def _empty(value: Any) -> bool:
    """What an unsupported SGLang field may be: null, false or empty (not 0)."""
    return value is None or value is False or (type(value) in (list, dict, str) and not value)


def _sampling_refusal(sp: dict[str, Any], target: Target, max_key: str, min_key: str) -> str | None:
    given = {k: v for k, v in sp.items() if v is not None}

    def bad_int(key: str, low: int, high: float) -> bool:
        return key in given and (type(given[key]) is not int or not low <= given[key] <= high)

    # top_k has no upper bound: one at or past the vocabulary is "off", however many digits it has
    if bad_int(max_key, 0, 16384) or bad_int("n", 1, 16) or bad_int("seed", 0, 2**63 - 1) or bad_int("top_k", -1, math.inf):
        return "a count out of range or not an integer"
    if bad_int(min_key, 0, given.get(max_key, 0) if type(given.get(max_key, 0)) is int else 0):
        return f"{min_key} out of range"
    for key, (low, high, low_open) in _FLOAT_RULES.items():
        if key in given:
            number = _as_float(given[key])
            if number is None or number > high or (number <= low if low_open else number < low):
                return f"{key} {given[key]!r:.40} out of range or not a number"
    if 0 < (_as_float(given.get("temperature", 0)) or 0) < 1e-5:
        return "a temperature between 0 and 1e-5"
    if sum(k in given for k in ("json_schema", "regex", "ebnf", "structural_tag")) > 1:
        return "two constraints at once"
    if any(key in given and type(given[key]) is not bool for key in _BOOL_RULES):
        return "a flag that is not a boolean"
    stop = given.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stops, list) or len(stops) > 16
                             or any(not isinstance(x, str) or not x or len(x) > 256 for x in stops)):
        return "stop strings out of the rules"
    ids = given.get("stop_token_ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) > 1024
                            or any(type(t) is not int or not 0 <= t < target.vocab_size for t in ids)):
        return "stop_token_ids out of the rules"
    bias = given.get("logit_bias")
    if bias is not None and (not isinstance(bias, dict) or len(bias) > 1024 or any(
            not _TOKEN_KEY.fullmatch(k) or int(k) >= target.vocab_size for k in bias)):
        return "a logit_bias key that is not a token id"
    if isinstance(bias, dict) and any(_as_float(v) is None or not -100 <= _as_float(v) <= 100 for v in bias.values()):
        return "a logit_bias value out of range"
    return None


def _as_float(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else (bools, NaN, huge ints)."""
    if type(value) not in (int, float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def error_field(raw: bytes, key: str) -> Any:
    """A field of an OpenAI-shaped error body, or None."""
    data = json_or_none(raw)
    error = data.get("error") if isinstance(data, dict) else None
    return error.get(key) if isinstance(error, dict) else None


def error_message(raw: bytes) -> str | None:
    message = error_field(raw, "message")
    return message if isinstance(message, str) and message else None


def error_code(raw: bytes) -> str | None:
    return error_field(raw, "code")


def results_of(req: FuzzRequest, ans: Answer) -> dict[int, dict[str, Any]]:
    """Each sequence's final result by position: /generate results, OpenAI choices."""
    if req.route == "/generate":
        if ans.events is not None:
            items = [e for e in map(json_or_none, ans.events) if isinstance(e, dict)]
        else:
            data = json_or_none(ans.body)
            items = data if isinstance(data, list) else [data]
        return {item.get("index", 0): item for item in items if isinstance(item, dict)}
    finals: dict[int, dict[str, Any]] = {}
    chunks = [json_or_none(e) for e in ans.events] if ans.events is not None else [json_or_none(ans.body)]
    for chunk in chunks:
        for choice in chunk.get("choices") or [] if isinstance(chunk, dict) else []:
            if isinstance(choice, dict) and choice.get("finish_reason") is not None:
                finals[choice.get("index", 0)] = choice
    return finals


def check_rules(req: FuzzRequest, ans: Answer, outcome: Outcome, target: Target) -> None:
    """A generating or pin route's answer against the documented rules: a body that breaks one
    is refused; an OpenAI error names a field the client sent; a 2xx of a generating route has
    the results asked for."""
    body = req.sent_json()
    if ans.status is None or body is None:
        return
    if ans.status < 300:
        why = must_refuse(req.route, body, target)
        if why is not None:
            outcome.problems.append(("accepted-invalid", f"answered {ans.status} to a body with {why}"))
        if req.route in GENERATING:
            check_results(req, ans, outcome)
    elif req.route in GENERATING[1:] and isinstance(body, dict):
        param = error_field(ans.body, "param")
        internal = _INTERNAL_PARAMS | ({"prompt"} if req.route.endswith("chat/completions") else set())
        if param in internal and param not in body:
            outcome.problems.append(("param-not-sent", f"the error names {param!r}, a field the client did not send"))


def check_results(req: FuzzRequest, ans: Answer, outcome: Outcome) -> None:
    """For a 2xx of a generating route: one result per sequence asked for, each labelled with
    the rid its prompt was given; collects the sequences that ended in "abort"."""
    body = req.sent_json()
    if not isinstance(body, dict):
        return
    finals = results_of(req, ans)
    labels = _labels(body) if req.route == "/generate" else None
    expected = len(labels) if labels is not None else _sequences(req.route, body)
    if expected is not None and not ans.left and set(finals) != set(range(expected)):
        outcome.problems.append(("result-count", f"asked for {expected} sequences, got results at {sorted(finals)}"))
    for pos, result in sorted(finals.items()):
        if req.route == "/generate":
            meta = result.get("meta_info") or {}
            finish = (meta.get("finish_reason") or {}).get("type")
            label = meta.get("id")
            if labels is not None and pos < len(labels) and label != labels[pos]:
                outcome.problems.append(("rid-mismatch", f"sequence {pos} labelled {label!r}, its rid is {labels[pos]!r}"))
        else:
            finish, label = result.get("finish_reason"), None
        if finish == "abort":
            outcome.aborted.append(label)


def _prompt_count(body: dict[str, Any]) -> int | None:
    prompt = body.get("text", body.get("input_ids", body.get("prompt")))
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and not isinstance(prompt[0], (str, list))):
        return 1
    return len(prompt) if isinstance(prompt, list) else None


def _labels(body: dict[str, Any]) -> list[str] | None:
    """/generate: the rid each sequence must carry (prompt-major, n per prompt), when given."""
    count, rid = _prompt_count(body), body.get("rid")
    if count is None or rid is None:
        return None
    sps = body.get("sampling_params")
    sps = sps if isinstance(sps, list) else [sps] * count
    ns = [(sp or {}).get("n") or 1 if isinstance(sp, dict) else 1 for sp in sps]
    rids_ = rid if isinstance(rid, list) else [rid] * count
    return [rids_[i] for i in range(count) for _ in range(ns[i])]


def _sequences(route: str, body: dict[str, Any]) -> int | None:
    if route == "/generate":
        return None  # without rids: counted by `_labels` only when given
    count = 1 if route == "/v1/chat/completions" else _prompt_count(body)
    n = body.get("n") or 1
    return count * n if count is not None and type(n) is int else None


def unexplained_aborts(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """Requests with a sequence aborted though no /abort_request for its rid (or abort_all)
    ran while it was in flight: an abort reached the wrong request."""
    calls = [o for o in outcomes if o.abort_call is not None]
    bad = []
    for o in outcomes:
        for label in o.aborted:
            if not any(c.start <= o.end and c.end >= o.start and (c.abort_call[1] or c.abort_call[0] == label)
                       for c in calls if c.abort_call is not None):
                bad.append(o)
                break
    return bad
