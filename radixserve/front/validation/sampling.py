"""Checking what clients send, in the front, before anything reaches the scheduler.

Every bad value becomes an `InvalidRequest` (HTTP 400) naming the parameter: an empty prompt, a
huge ``n``, an out-of-vocabulary token id or a constraint we cannot honour must never get as far as
the scheduler or the GPU. Nothing is silently ignored: unknown keys and unsupported features are
errors. ``None`` for any sampling parameter means "use the default", as OpenAI clients send it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from radixserve.front.types import InvalidRequest, json_type
from radixserve.front.validation.limits import Limits
from radixserve.front.validation.schemas import check_json_schema
from radixserve.protocol import GRAMMAR_KINDS, Grammar, SamplingParams

MAX_SEED = 2**63 - 1
_DEFAULTS = SamplingParams()
# the keys a client may give; `grammar` is built from one of GRAMMAR_KINDS, never given
_KNOWN = frozenset(SamplingParams.__struct_fields__) - {"grammar"}
# SGLang sampling keys we cannot honour yet: accepted only when null
_UNSUPPORTED = {
    "stop_regex": "stop regexes", "beam_width": "beam search",
    "custom_params": "custom logit processors", "watermark": "watermarking",
}
# SGLang sampling keys that change nothing here: streaming already sends every step
_ACCEPTED_NO_EFFECT = frozenset({"stream_interval"})
# Below this, logits / temperature can overflow float32 and the distribution turns NaN. SGLang
# and vLLM quietly treat near-zero temperatures as greedy (vLLM: under 1e-5, and it lifts the
# rest below 0.01 to 0.01); we refuse rather than sample differently from what was asked.
MIN_TEMPERATURE = 1e-5
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # a logit_bias key: an ASCII decimal integer

_Num = TypeVar("_Num", int, float)
# name -> (low, high, low excluded)
_FLOAT_RANGES = {
    "temperature": (0.0, 100.0, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "presence_penalty": (-2.0, 2.0, False),
    "repetition_penalty": (0.01, 10.0, False),  # smaller ones overflow the divided logits
}
_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


def parse_sampling_params(
    raw: Mapping[str, Any] | None, *, vocab_size: int, limits: Limits
) -> SamplingParams:
    """SGLang-style ``sampling_params`` -> a validated `SamplingParams`.

    Normalises two spellings of "off": ``top_k`` 0 and ``top_k >= vocab_size`` become -1. When
    ``max_new_tokens`` is absent, the default (128) is capped at ``limits.max_new_tokens``.
    Repeated stop strings and stop token ids are dropped (first occurrence kept).
    """
    given = _known_keys(raw)
    out = _lengths(given, limits)
    for key, (lo, hi, lo_open) in _FLOAT_RANGES.items():
        if key in given:
            out[key] = _check_range(key, _float(given, key), lo, hi, lo_open=lo_open)
    if 0.0 < out.get("temperature", 0.0) < MIN_TEMPERATURE:
        raise InvalidRequest(
            f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE} and "
            f"{_FLOAT_RANGES['temperature'][1]}, got {out['temperature']}", "temperature",
        )
    if "top_k" in given:
        top_k = _int(given, "top_k")
        if top_k < -1:
            raise InvalidRequest(f"top_k must be -1 or 0 (off) or >= 1, got {top_k}", "top_k")
        out["top_k"] = -1 if top_k == 0 or top_k >= vocab_size else top_k
    if "n" in given:
        out["n"] = _check_range("n", _int(given, "n"), 1, limits.max_n)
    if "seed" in given:
        out["seed"] = _check_range("seed", _int(given, "seed"), 0, MAX_SEED)
    if "logit_bias" in given:
        out["logit_bias"] = _logit_bias(given["logit_bias"], vocab_size, limits.max_logit_bias)
    if "stop" in given:
        out["stop"] = _stop_strings(given["stop"], limits)
    if "stop_token_ids" in given:
        out["stop_token_ids"] = _stop_token_ids(given["stop_token_ids"], vocab_size, limits)
    for key in _BOOLS:
        if key in given:
            if type(given[key]) is not bool:
                raise InvalidRequest(f"{key} must be a boolean, got {json_type(given[key])}", key)
            out[key] = given[key]
    grammar = _grammar(raw or {}, limits)
    if grammar is not None:
        out["grammar"] = grammar
    return SamplingParams(**out)


def _grammar(raw: Mapping[str, Any], limits: Limits) -> Grammar | None:
    """At most one of `json_schema`, `regex`, `ebnf`, `structural_tag` (as SGLang allows): its
    source as text. Only what is cheap is checked here (type, size, JSON syntax); the scheduler
    compiles it and refuses what xgrammar cannot compile, with xgrammar's message. A JSON
    schema is also refused when nested too deeply or using a keyword the grammar cannot enforce
    (`schemas.check_json_schema`)."""
    given = [k for k in GRAMMAR_KINDS if raw.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(
            f"give at most one constraint of {', '.join(GRAMMAR_KINDS)}; got {' and '.join(given)}", given[1],
        )
    kind = given[0]
    value = raw[kind]
    is_json = kind in ("json_schema", "structural_tag")
    parsed: Any = None
    if isinstance(value, dict) and is_json:
        parsed = value
        if kind == "json_schema":  # before dumps walks it recursively
            check_json_schema(value, kind, kind)
        try:
            value = json.dumps(value)  # an object is taken as the JSON it spells
        except RecursionError:
            raise InvalidRequest(f"{kind} is nested too deeply", kind) from None
    if not isinstance(value, str):
        raise InvalidRequest(f"{kind} must be a string, got {json_type(value)}", kind)
    if not value.strip():
        raise InvalidRequest(f"{kind} must not be empty", kind)
    if len(value) > limits.max_grammar_chars:
        raise InvalidRequest(f"{kind} has {len(value)} characters; at most {limits.max_grammar_chars}", kind)
    if is_json:
        if parsed is None:  # given as text: it must parse
            try:
                parsed = json.loads(value)
            except ValueError as exc:
                raise InvalidRequest(f"{kind} is not valid JSON: {exc}", kind) from None
            except RecursionError:
                raise InvalidRequest(f"{kind} is nested too deeply", kind) from None
        if not isinstance(parsed, (dict, bool)) or (kind == "structural_tag" and not isinstance(parsed, dict)):
            raise InvalidRequest(f"{kind} must be a JSON object, got {json_type(parsed)}", kind)
        if kind == "json_schema" and parsed is not raw[kind]:  # given as text: checked once parsed
            check_json_schema(parsed, kind, kind)
    return Grammar(kind, value)


def _known_keys(raw: Any) -> dict[str, Any]:
    """The parameters given (None = not given); unknown and unsupported ones are errors."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise InvalidRequest(
            f"sampling_params must be an object, got {json_type(raw)}", "sampling_params"
        )
    for key, value in raw.items():
        if key in _UNSUPPORTED:
            if value is not None and value != []:  # SGLang's client sends stop_regex: []
                raise InvalidRequest(f"{key} ({_UNSUPPORTED[key]}) is not supported yet", key)
        elif key in _ACCEPTED_NO_EFFECT:
            if value is not None and type(value) is not int:
                raise InvalidRequest(f"{key} must be an integer, got {json_type(value)}", key)
        elif key not in _KNOWN and key != "sampling_seed" and key not in GRAMMAR_KINDS:
            raise InvalidRequest(f"unknown sampling parameter {key!r}", str(key))
    given = {k: v for k, v in raw.items() if v is not None and k in _KNOWN}
    if raw.get("sampling_seed") is not None:  # SGLang's name for the per-request seed
        if "seed" in given and given["seed"] != raw["sampling_seed"]:
            raise InvalidRequest("seed and sampling_seed disagree; give one", "sampling_seed")
        given["seed"] = raw["sampling_seed"]
    return given


def _lengths(given: Mapping[str, Any], limits: Limits) -> dict[str, Any]:
    max_new = min(_DEFAULTS.max_new_tokens, limits.max_new_tokens)
    if "max_new_tokens" in given:
        max_new = _check_range(
            "max_new_tokens", _int(given, "max_new_tokens"), 0, limits.max_new_tokens
        )
    out: dict[str, Any] = {"max_new_tokens": max_new}
    if "min_new_tokens" in given:
        min_new = _int(given, "min_new_tokens")
        if not 0 <= min_new <= max_new:
            raise InvalidRequest(
                f"min_new_tokens must be between 0 and max_new_tokens ({max_new}), got {min_new}",
                "min_new_tokens",
            )
        out["min_new_tokens"] = min_new
    return out


def validate_input_ids(ids: Any, vocab_size: int) -> list[int]:
    """Check client-supplied token ids: a non-empty list of ints in ``[0, vocab_size)``."""
    if not isinstance(ids, list) or not ids:
        raise InvalidRequest("input_ids must be a non-empty list of token ids", "input_ids")
    return _token_ids(ids, vocab_size, "input_ids")


def check_prompt_chars(chars: int, limits: Limits, context_len: int, what: str, param: str) -> None:
    """Refuse, before tokenizing it, a prompt text too long to fit the context whatever it holds
    (see `Limits.max_prompt_chars`): tokenizing megabytes would cost seconds and gigabytes."""
    limit = limits.max_prompt_chars
    if limit is not None and chars > limit:
        raise InvalidRequest(
            f"{what} is too long: {chars} characters, and a prompt over {limit} characters cannot "
            f"fit the model's context of {context_len} tokens",
            param,
        )


def check_lengths(
    prompt_len: int,
    max_new_tokens: int,
    context_len: int,
    *,
    max_prompt_tokens: int | None = None,
) -> None:
    """The prompt plus everything it may generate must fit the model's context."""
    if prompt_len <= 0:
        raise InvalidRequest("the prompt is empty; at least one token is needed", "prompt")
    if max_prompt_tokens is not None and prompt_len > max_prompt_tokens:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens; this server accepts at most {max_prompt_tokens}",
            "prompt",
        )
    if prompt_len >= context_len:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens but the model's context length is {context_len}, "
            f"so at most {context_len - 1} prompt tokens fit",
            "prompt",
        )
    if prompt_len + max_new_tokens > context_len:
        raise InvalidRequest(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{prompt_len + max_new_tokens} exceeds the model's context length of {context_len}; "
            f"ask for at most {context_len - prompt_len} new tokens",
            "max_new_tokens",
        )


def _int(given: Mapping[str, Any], key: str) -> int:
    value = given[key]
    if type(value) is not int:  # bool is an int subclass, and not a count
        raise InvalidRequest(f"{key} must be an integer, got {json_type(value)}", key)
    return value


def _float(given: Mapping[str, Any], key: str) -> float:
    value = given[key]
    if type(value) not in (int, float):
        raise InvalidRequest(f"{key} must be a number, got {json_type(value)}", key)
    number = finite_float(value)
    if number is None:
        raise InvalidRequest(f"{key} must be a finite number, got {_short(value)}", key)
    return number


def finite_float(value: int | float) -> float | None:
    """The value as a finite float, or None (NaN, infinities, and JSON integers too large for
    a float, which msgspec decodes as exact ints)."""
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _short(value: Any, limit: int = 40) -> str:
    """repr of a client's value, cut short: an error message must not echo a huge key."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _check_range(key: str, value: _Num, lo: float, hi: float, *, lo_open: bool = False) -> _Num:
    if (value <= lo if lo_open else value < lo) or value > hi:
        bounds = f"> {lo} and <= {hi}" if lo_open else f"between {lo} and {hi}"
        raise InvalidRequest(f"{key} must be {bounds}, got {value}", key)
    return value


def _stop_strings(value: Any, limits: Limits) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise InvalidRequest(
            f"stop must be a string or a list of strings, got {json_type(value)}", "stop"
        )
    if len(stops) > limits.max_stop:
        raise InvalidRequest(
            f"at most {limits.max_stop} stop strings are allowed, got {len(stops)}", "stop"
        )
    for i, stop in enumerate(stops):
        if not isinstance(stop, str):
            raise InvalidRequest(f"stop[{i}] must be a string, got {json_type(stop)}", "stop")
        if not stop:
            raise InvalidRequest(f"stop[{i}] is empty; stop strings must be non-empty", "stop")
        if len(stop) > limits.max_stop_chars:
            raise InvalidRequest(
                f"stop[{i}] has {len(stop)} characters; at most {limits.max_stop_chars} are allowed",
                "stop",
            )
    return list(dict.fromkeys(stops))


def _logit_bias(value: Any, vocab_size: int, max_entries: int) -> dict[int, float]:
    """`{token id: bias}` with ids as JSON object keys (ASCII decimal strings) or ints; bias in
    [-100, 100]. A superscript two or "--5" passes `str.isdigit` (after a strip of "-") but is
    not a token id, and int() of either fails."""
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"logit_bias must be an object, got {json_type(value)}", "logit_bias")
    if len(value) > max_entries:
        raise InvalidRequest(f"logit_bias has {len(value)} entries; at most {max_entries} are allowed", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key if type(key) is int else None
        if isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key):
            token = int(key)
        if token is None or not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"logit_bias key {_short(key)} is not a token id: keys must be ASCII decimal "
                f"integers in [0, {vocab_size})", "logit_bias",
            )
        number = finite_float(bias) if type(bias) in (int, float) else None
        if number is None or not -100 <= number <= 100:
            raise InvalidRequest(
                f"logit_bias[{_short(key)}] must be a number between -100 and 100, got {_short(bias)}",
                "logit_bias",
            )
        out[token] = number
    return out


def _stop_token_ids(value: Any, vocab_size: int, limits: Limits) -> list[int]:
    """Capped before the per-id checks, and deduplicated: each sample carries its own copy."""
    if isinstance(value, list) and len(value) > limits.max_stop_token_ids:
        raise InvalidRequest(
            f"at most {limits.max_stop_token_ids} stop_token_ids are allowed, got {len(value)}",
            "stop_token_ids",
        )
    return list(dict.fromkeys(_token_ids(value, vocab_size, "stop_token_ids")))


def _token_ids(ids: Any, vocab_size: int, key: str) -> list[int]:
    if not isinstance(ids, list):
        raise InvalidRequest(f"{key} must be a list of token ids, got {json_type(ids)}", key)
    for i, t in enumerate(ids):
        if type(t) is not int:
            raise InvalidRequest(
                f"{key}[{i}] must be an integer token id, got {json_type(t)}", key
            )
        if not 0 <= t < vocab_size:
            raise InvalidRequest(f"{key}[{i}] = {t} is out of range [0, {vocab_size})", key)
    return ids
