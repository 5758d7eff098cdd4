"""Hypothesis strategies for request bodies: valid ones for each generating route, hostile edits
of them, chat bodies with hostile tools, /cache/pin and /cache/unpin bodies, and the cap that
keeps every request cheap."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

from bench.robustness.fuzz.encoding import Pairs
from bench.robustness.fuzz.request import Target
from bench.robustness.fuzz.schemas import choose_tool, hostile_tools
from bench.robustness.fuzz.values import (
    BAD_PIN_IDS,
    BAD_TIERS,
    BAD_TTLS,
    EDGE_TTLS,
    FALSY,
    MAX_KEYS,
    PROMPTS,
    RID_FAMILY,
    SAMPLING_KEYS,
    SGLANG_UNSUPPORTED,
    UNKNOWN_KEYS,
    bad_max_tokens,
    hostile,
    number_texts,
    numbers,
    one_in,
    rids,
    scalars,
    weighted,
)


def long_prompt_ids(draw: Any, target: Target, tags: list[str]) -> list[int]:
    """A prompt at the edge of the context: it fits with any valid max tokens, or it does not."""
    tags.append("long-prompt")
    size = draw(st.sampled_from((target.context_len - target.leaver_tokens, target.context_len, target.context_len + 1)))
    return [draw(st.sampled_from((1, target.vocab_size - 1)))] * size  # a few prompts: cached after the first


def _valid_ids(draw: Any, target: Target, tags: list[str], max_size: int = 8) -> list[int]:
    """A few token ids in the vocabulary (its edges too), now and then a prompt as long as the context."""
    if one_in(draw, 50):
        return long_prompt_ids(draw, target, tags)
    edges = st.sampled_from((0, 1, 2, target.vocab_size - 1))
    return draw(st.lists(st.one_of(st.integers(0, target.vocab_size - 1), edges), min_size=1, max_size=max_size))


def _token_id(draw: Any, target: Target) -> Any:
    """A token id, mostly valid; else of the shapes ids must not have."""
    if not one_in(draw, 4):
        return draw(st.integers(0, target.vocab_size - 1))
    return draw(st.one_of(st.sampled_from((target.vocab_size, -1, 2**63, 2**64)), numbers()))


def _logit_bias(draw: Any, target: Target, tags: list[str]) -> dict[str, Any]:
    """Valid entries, with one odd key (a unicode digit, "--5", 5,000 digits...) or one odd
    bias among them, at any place."""
    valid = draw(st.lists(st.integers(0, target.vocab_size - 1).map(str), max_size=2, unique=True))
    entries = [(k, draw(st.sampled_from((-100, 100, 0, 5.5, -0.0)))) for k in valid]
    kind = weighted(draw, {"valid": 40, "odd-key": 40, "odd-bias": 20})
    if kind == "odd-key":
        tags.append("logit_bias-odd-key")
        entries.insert(draw(st.integers(0, len(entries))), (draw(number_texts()), 1))
    elif kind == "odd-bias":
        entries.insert(draw(st.integers(0, len(entries))), ("5", draw(numbers())))
    return dict(entries) or {"0": 1.0}


_DEEP = 2000  # nesting that a recursive schema or grammar converter must not crash on
GOOD_GRAMMARS = (
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}'),
    ("json_schema", '{"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}'),
    ("json_schema", {"type": "string", "maxLength": 5}),
    ("regex", "[a-z]{1,8}"), ("regex", "(yes|no)"), ("regex", "\\d{3}-\\d{2}"),
    ("ebnf", 'root ::= "a" | "b" root'),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}'),
)
BAD_GRAMMARS = (
    ("json_schema", '{"type": "objec"}'), ("json_schema", "{"), ("json_schema", "[]"), ("json_schema", '"x"'),
    ("json_schema", '{"type": "object", "properties": 5}'), ("json_schema", '{"$ref": "#/nowhere"}'),
    ("json_schema", '{"type": "string", "pattern": "(?<=a)b"}'), ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'),
    ("json_schema", '{"type": "array", "items": ' * _DEEP + "{}" + "}" * _DEEP),
    ("json_schema", '{"anyOf": [' + ", ".join(f'{{"type": "object", "properties": {{"k{i}": {{"oneOf": [{{"type": "string"}}, {{"type": "integer"}}]}}}}}}' for i in range(60)) + "]}"),
    ("regex", "(a"), ("regex", "a{99999999}"), ("regex", "(a)\\1"), ("regex", "(?=a)a"), ("regex", "[z-a]"),
    ("regex", "(" * _DEEP + "a" + ")" * _DEEP), ("regex", "\\"),
    ("ebnf", "root ::= undefined"), ("ebnf", "root ::= root"), ("ebnf", "x ::= \"a\""), ("ebnf", "root ::= (" * _DEEP + '"a"' + ")" * _DEEP),
    ("structural_tag", "{}"), ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}'),
    ("structural_tag", '{"structures": [{"begin": "<a>"}], "triggers": ["<a"]}'),
)


def _grammar(draw: Any, tags: list[str]) -> dict[str, Any]:
    """One constraint, valid or hostile (malformed, unsupported, deep, slow to compile), now and
    then two at once; the server must answer 2xx or a 400, and go on serving."""
    kind = weighted(draw, {"good": 45, "bad": 45, "two": 10})
    tags.append(f"grammar-{kind}")
    if kind == "two":
        (k1, v1), (k2, v2) = draw(st.lists(st.sampled_from(GOOD_GRAMMARS), min_size=2, max_size=2, unique_by=lambda g: g[0]))
        return copy.deepcopy({k1: v1, k2: v2})
    key, value = draw(st.sampled_from(GOOD_GRAMMARS if kind == "good" else BAD_GRAMMARS))
    return {key: copy.deepcopy(value)}


def _sampling(draw: Any, target: Target, tags: list[str], cap: int, max_key: str = "max_new_tokens") -> dict[str, Any]:
    """Valid sampling parameters (SGLang names; the caller renames), with a few risky extras."""
    sp: dict[str, Any] = {max_key: draw(st.integers(0, cap))}
    if draw(st.booleans()):
        sp["temperature"] = draw(st.sampled_from((0.0, 0.0, 0.7, 1.0, 1e-5, 100.0)))
    if one_in(draw, 4):
        sp["top_p"] = draw(st.sampled_from((1.0, 0.5, 1e-9)))
    if one_in(draw, 4):
        sp["top_k"] = draw(st.sampled_from((-1, 0, 1, 5, target.vocab_size, target.vocab_size + 1)))
    if one_in(draw, 6):
        sp["min_p"] = draw(st.sampled_from((0.0, 0.1, 1.0)))
    if one_in(draw, 6):
        sp["repetition_penalty"] = draw(st.sampled_from((0.01, 1.0, 10.0)))
    if one_in(draw, 6):
        sp["frequency_penalty"] = draw(st.sampled_from((-2.0, 0.0, 2.0)))
    if one_in(draw, 4):
        sp["n"] = draw(st.sampled_from((1, 2, 2, 3, 16)))
    if one_in(draw, 5):
        sp["seed"] = draw(st.sampled_from((0, 1, 2**63 - 1)))
    if one_in(draw, 3):
        sp["ignore_eos"] = True
    if one_in(draw, 5):
        sp["min_new_tokens"] = draw(st.integers(0, sp[max_key]))
    if one_in(draw, 4):
        tags.append("stop")
        size = draw(st.sampled_from((1, 2, 16, 17, 100)))
        length = draw(st.sampled_from((1, 3, 256, 257)))
        unit = draw(st.sampled_from(("a", " ", "\n", ",", "\u00b2", "x#1")))
        sp["stop"] = [unit * length + str(i) * (length < 256) for i in range(size)]
    if one_in(draw, 4):
        tags.append("stop_token_ids")
        size = draw(st.sampled_from((1, 2, 3, 1024, 1025, 5000)))
        ids = [_token_id(draw, target) for _ in range(min(size, 3))]
        sp["stop_token_ids"] = (ids * (size // len(ids) + 1))[:size]
    if one_in(draw, 3):
        tags.append("logit_bias")
        sp["logit_bias"] = _logit_bias(draw, target, tags)
    if one_in(draw, 8):
        sp.update(_grammar(draw, tags))
    return sp


def generate_body(draw: Any, target: Target, tags: list[str], cap: int) -> dict[str, Any]:
    # `x` with n=2 (alone, or next to `x#1` in a batch): `x#1` was once the id of its second sample
    race = weighted(draw, {"no": 85, "alone": 8, "batch": 7})
    batch = race == "batch" or one_in(draw, 4)
    count = 2 if race == "batch" else draw(st.integers(1, 4)) if batch else 1
    if draw(st.booleans()):
        prompts: list[Any] = [draw(st.sampled_from(PROMPTS)) for _ in range(count)]
        body: dict[str, Any] = {"text": prompts if batch else prompts[0]}
    else:
        prompts = [_valid_ids(draw, target, tags) for _ in range(count)]
        body = {"input_ids": prompts if batch else prompts[0]}
    if batch and draw(st.booleans()):
        body["sampling_params"] = [_sampling(draw, target, tags, cap) for _ in range(count)]
    else:
        body["sampling_params"] = _sampling(draw, target, tags, cap)
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
    if one_in(draw, 4):
        body["return_logprob"] = True
        body["top_logprobs_num"] = draw(st.sampled_from((0, 1, 20, 21)))
        body["logprob_start_len"] = draw(st.sampled_from((-1, 0, 1, 10**6)))
        body["return_text_in_logprobs"] = draw(st.booleans())
    if race != "no":
        tags += ["rid", "rid-family", "rid-x#1-with-n2"]
        body["rid"] = ["x", "x#1"] if race == "batch" else "x"
        for sp in body["sampling_params"] if isinstance(body["sampling_params"], list) else [body["sampling_params"]]:
            sp["n"] = 2
    elif draw(st.booleans()):
        if batch:
            body["rid"] = [draw(rids()) for _ in range(count)]
            if count > 1 and one_in(draw, 3):
                body["rid"][-1] = body["rid"][0]
            if len(set(body["rid"])) < count:
                tags.append("rid-repeated-in-batch")
        else:
            body["rid"] = draw(rids())
        tags.append("rid")
        if set(body["rid"] if batch else [body["rid"]]) & set(RID_FAMILY):
            tags.append("rid-family")
    if one_in(draw, 6):
        body["cache_salt"] = draw(st.sampled_from(("tenant-a", "tenant-b", "", "\u00b2", "s" * 257)))
    return body


def _openai_common(draw: Any, target: Target, tags: list[str], body: dict[str, Any], cap: int, max_key: str) -> None:
    sp = _sampling(draw, target, tags, cap, max_key=max_key)
    renames = {"min_new_tokens": "min_tokens"}
    body.update({renames.get(k, k): v for k, v in sp.items()})
    if not one_in(draw, 4):
        body["model"] = draw(st.sampled_from(("gpt-4", "", "\u00b2"))) if one_in(draw, 12) else target.model_name
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    if one_in(draw, 6):
        body["user"] = draw(st.sampled_from(("u1", "", "\u00b2")))


def completion_body(draw: Any, target: Target, tags: list[str], cap: int) -> dict[str, Any]:
    shape = draw(st.integers(0, 3))
    if shape == 0:
        prompt: Any = draw(st.sampled_from(PROMPTS))
    elif shape == 1:
        prompt = [draw(st.sampled_from(PROMPTS)) for _ in range(draw(st.integers(1, 3)))]
    elif shape == 2:
        prompt = _valid_ids(draw, target, tags)
    else:
        prompt = [_valid_ids(draw, target, tags, max_size=4) for _ in range(draw(st.integers(1, 3)))]
    body: dict[str, Any] = {"prompt": prompt}
    _openai_common(draw, target, tags, body, cap, "max_tokens")
    if one_in(draw, 4):
        body["logprobs"] = draw(st.sampled_from((0, 1, 5, 20, 21)))
    if one_in(draw, 5):
        body["echo"] = True
    return body


def chat_body(draw: Any, target: Target, tags: list[str], cap: int) -> dict[str, Any]:
    roles = st.sampled_from(("user", "user", "system", "assistant", "tool", "developer", "", "\u00b2"))
    part = st.fixed_dictionaries({"type": st.just("text"), "text": st.sampled_from(PROMPTS)})
    odd = ("", None, [], [{"type": "image_url", "image_url": {"url": "x"}}], [{"type": "text"}])
    content = st.one_of(st.sampled_from(PROMPTS), st.lists(part, min_size=1, max_size=2), st.sampled_from(odd))
    messages = [{"role": draw(roles), "content": draw(content)} for _ in range(draw(st.integers(1, 3)))]
    if draw(st.booleans()):
        messages = [{"role": "user", "content": draw(st.sampled_from(PROMPTS))}]
    body: dict[str, Any] = {"messages": messages}
    max_key = draw(st.sampled_from(("max_tokens", "max_completion_tokens")))
    _openai_common(draw, target, tags, body, cap, max_key)
    if one_in(draw, 4):
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.sampled_from((0, 1, 20, 21)))
    if one_in(draw, 6):
        body["add_generation_prompt"] = draw(st.booleans())
    return body


def mutate(draw: Any, target: Target, tags: list[str], body: dict[str, Any], keys: Sequence[str]) -> Any:
    """Up to three hostile edits of a valid body: a field set to a value of a wrong shape, an
    unknown field, a field deleted, a key repeated, or the whole body of another JSON type."""
    for _ in range(int(weighted(draw, {"0": 35, "1": 45, "2": 15, "3": 5}))):
        edit = weighted(draw, {"set": 50, "set-sampling": 20, "unknown": 15, "delete": 10, "retype": 5})
        if edit in ("set", "set-sampling"):
            holder, known = _sampling_holder(draw, body, keys) if edit == "set-sampling" else (body, keys)
            present = sorted(k for k in holder if isinstance(k, str))
            key = draw(st.sampled_from(present if present and not one_in(draw, 3) else known))
            # a copy: sampled values ({} and [] among them) are shared objects, and one edited
            # later as a holder would become a cycle in every body that holds it
            holder[key] = copy.deepcopy(draw(bad_max_tokens(target) if key in MAX_KEYS else hostile()))
            tags.append("wrong-value")
        elif edit == "unknown":
            holder, _ = _sampling_holder(draw, body, keys) if one_in(draw, 3) else (body, keys)
            key = draw(st.sampled_from(UNKNOWN_KEYS + (SGLANG_UNSUPPORTED if holder is body else ())))
            falsy = draw(st.booleans())
            holder[key] = copy.deepcopy(draw(st.sampled_from(FALSY) if falsy else hostile()))
            tags.append("unknown-field-falsy" if falsy else "unknown-field")
        elif edit == "delete" and body:
            key = draw(st.sampled_from(sorted(body)))
            if key not in MAX_KEYS:
                del body[key]
                tags.append("deleted-field")
        elif edit == "retype":
            tags.append("body-not-object")
            return draw(st.one_of(st.just([body]), scalars, st.lists(scalars, max_size=3)))
    if one_in(draw, 20) and body:
        key = draw(st.sampled_from(sorted(body)))
        if key not in (*MAX_KEYS, "sampling_params"):  # a repeat is not seen by `cap_tokens`
            tags.append("repeated-key")
            return Pairs((*body.items(), (key, draw(hostile()))))
    return body


def _sampling_holder(draw: Any, body: dict[str, Any], keys: Sequence[str]) -> tuple[dict[str, Any], Sequence[str]]:
    """/generate's sampling parameters (one of them, for a list) and their keys, else the body
    and its own (the OpenAI routes take sampling parameters at the top)."""
    sps = body.get("sampling_params")
    if isinstance(sps, list) and sps:
        sps = sps[draw(st.integers(0, len(sps) - 1))]
    return (sps, SAMPLING_KEYS) if isinstance(sps, dict) else (body, keys)


def cap_tokens(body: Any, target: Target, cap: int, path: str) -> None:
    """Keep every request cheap: a max-token field that is absent or null (the server's default:
    128, or the whole context for chat) or valid but above `cap` becomes `cap`."""
    if not isinstance(body, dict):
        return

    def fix(holder: dict[str, Any], key: str) -> None:
        value = holder.get(key)
        if value is None or (type(value) is int and cap < value <= target.context_len):
            holder[key] = cap

    if path == "/generate":
        sps = body.get("sampling_params")
        if sps is None:
            body["sampling_params"] = sps = {}
        for sp in sps if isinstance(sps, list) else [sps]:
            if isinstance(sp, dict):
                fix(sp, "max_new_tokens")
    elif path == "/v1/chat/completions" and body.get("max_completion_tokens") is not None:
        fix(body, "max_completion_tokens")
    else:
        fix(body, "max_tokens")


def tools_body(draw: Any, target: Target, tags: list[str], cap: int, edit: str, choice: str) -> dict[str, Any]:
    """A valid chat body with `tools` edited as `edit` says and a `tool_choice` of the shape
    `choice` (`schemas.TOOL_EDITS`, `schemas.TOOL_CHOICES`)."""
    body = chat_body(draw, target, tags, cap)
    body["tools"] = hostile_tools(draw, target, tags, edit)
    choose_tool(draw, body, tags, choice)
    if one_in(draw, 8):
        body["parallel_tool_calls"] = draw(st.sampled_from((True, False, "yes", 1)))
    return body


# Prefixes to pin: longer than a KV page of any page size a server takes, and ending where no
# token merges across (a newline), so that a prompt starting with one hits it
PIN_TEXTS = tuple(f"You are support agent {i} for ACME. Our return policy: items may be returned within 30 days.\n"
                  for i in range(4))


# the edits of pin and unpin bodies, in the proportions a plan deals them (`plan.SHAPES`)
PIN_EDITS = {"valid": 30, "ttl": 20, "edge-ttl": 5, "tier": 15, "prefix": 15, "salt": 5, "unknown": 10}
UNPIN_EDITS = {"pin_id": 30, "prefix": 25, "bad-pin_id": 25, "both": 10, "bad-prefix": 5, "unknown": 5}


def pin_body(draw: Any, target: Target, tags: list[str], edit: str) -> dict[str, Any]:
    """A /cache/pin body: a valid prefix pinned for a while (rarely until unpinned), with one
    field of a wrong kind unless `edit` (of `PIN_EDITS`) is "valid"."""
    tags.append(f"pin-{edit}")
    body = _prefix(draw, target)
    if not one_in(draw, 5):
        body["ttl"] = draw(st.sampled_from((1, 5, 30, 0.5)))
    if edit == "valid":
        return body
    if edit in ("ttl", "edge-ttl"):
        body["ttl"] = draw(st.sampled_from(BAD_TTLS if edit == "ttl" else EDGE_TTLS))
    elif edit == "tier":
        body["tier"] = copy.deepcopy(draw(st.sampled_from(BAD_TIERS)))
    elif edit == "prefix":
        _bad_prefix(draw, target, body)
    elif edit == "salt":
        body["cache_salt"] = copy.deepcopy(draw(st.one_of(st.sampled_from(("", "s" * 257)), hostile())))
    else:
        body[draw(st.sampled_from(("pin_id", "rid", "sampling_params", *UNKNOWN_KEYS)))] = copy.deepcopy(draw(hostile()))
    return body


def unpin_body(draw: Any, target: Target, tags: list[str], edit: str) -> dict[str, Any]:
    """A /cache/unpin body of an `UNPIN_EDITS` edit: a pin_id (most of them unknown: a 404) or a
    pinned prefix, or with a field of a wrong kind, or both at once."""
    tags.append(f"unpin-{edit}")
    if edit == "pin_id":
        return {"pin_id": draw(st.integers(1, 40))}
    if edit == "prefix":
        return _prefix(draw, target)
    if edit == "bad-pin_id":
        return {"pin_id": copy.deepcopy(draw(st.sampled_from(BAD_PIN_IDS)))}
    if edit == "both":
        return {"pin_id": draw(st.integers(1, 40)), **_prefix(draw, target)}
    body = _prefix(draw, target)
    if edit == "bad-prefix":
        _bad_prefix(draw, target, body)
    else:
        body[draw(st.sampled_from(("tier", "ttl", *UNKNOWN_KEYS)))] = copy.deepcopy(draw(hostile()))
    return body


def _prefix(draw: Any, target: Target) -> dict[str, Any]:
    """A prefix to pin or unpin: one of a few texts, or of a few id lists (so that pins and unpins
    meet), with a salt now and then."""
    if draw(st.booleans()):
        body: dict[str, Any] = {"text": draw(st.sampled_from(PIN_TEXTS))}
    else:
        start = draw(st.sampled_from((100, 200, target.vocab_size - 80)))
        body = {"input_ids": list(range(start, start + draw(st.sampled_from((16, 64, 80)))))}
    if one_in(draw, 5):
        body["cache_salt"] = draw(st.sampled_from(("tenant-a", "tenant-b")))
    return body


def _bad_prefix(draw: Any, target: Target, body: dict[str, Any]) -> None:
    """The prefix made wrong: both fields, neither, a batch, too short, out of the vocabulary, or
    of a wrong type."""
    shape = draw(st.sampled_from(("both", "neither", "batch", "short", "out-of-vocab", "hostile")))
    body.pop("text", None)
    body.pop("input_ids", None)
    if shape == "both":
        body.update(text=PIN_TEXTS[0], input_ids=[5] * 16)
    elif shape == "batch":
        body.update(draw(st.sampled_from(({"text": list(PIN_TEXTS[:2])}, {"input_ids": [[5] * 16, [6] * 16]}))))
    elif shape == "short":
        body.update(draw(st.sampled_from(({"text": "a"}, {"text": ""}, {"input_ids": [5]}, {"input_ids": []}))))
    elif shape == "out-of-vocab":
        body["input_ids"] = [5] * 15 + [draw(st.sampled_from((target.vocab_size, -1, 2**63, 10**400)))]
    elif shape == "hostile":
        body[draw(st.sampled_from(("text", "input_ids")))] = copy.deepcopy(draw(hostile()))
