"""Hypothesis strategies for values: numbers, keys, ids and rids of the shapes that break parsers,
and weighted choices that hypothesis does not skew."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from bench.robustness.fuzz.encoding import Raw
from bench.robustness.fuzz.request import Target


def one_in(draw: Any, n: int) -> bool:
    """True about once in `n` draws. The middle of the range, not an end: hypothesis leans
    towards the ends of an integer range, which would make rare choices common."""
    return draw(st.integers(0, n - 1)) == n // 2


def weighted(draw: Any, weights: dict[str, int]) -> str:
    """A key with probability proportional to its weight; the roll's two ends, which
    hypothesis favours, both fall on the first key."""
    total = sum(weights.values())
    roll = (draw(st.integers(0, total - 1)) + next(iter(weights.values())) // 2) % total
    for key, weight in weights.items():
        if roll < weight:
            return key
        roll -= weight
    raise AssertionError("unreachable")


# Numbers as text: each one a key, an id or a rid somewhere. int() and str.isdigit() disagree on
# several of them (superscripts, other scripts' digits, full-width digits, "--5", " 5", "1_000").
NUMBER_TEXTS = (
    "0", "-0", "1", "-1", "00", "05", "+5", "--5", "- 5", " 5", "5 ", "5\n", "1_000", "0x10", "1e3", "1.0",
    "\u00b2", "\u00b3", "\u00b9", "\u0663", "\uff15", "\u2155", "\u0b67", "\U0001d7d3",
    "NaN", "nan", "-nan", "Infinity", "-Infinity", "inf", "1e308", "1e-45", "1e400", "", " ",
    "4294967296", "18446744073709551616", "-9223372036854775809", "9" * 20, "1" * 5000,
)
# Numbers as JSON: the shapes no well-behaved client writes. Integers past a float's range (309
# digits and more) are exact ints once parsed, and float() of them raises.
RAW_NUMBERS = tuple(Raw(t) for t in (
    "1" * 5000, "-" + "9" * 5000, "1" + "0" * 309, "-" + "9" * 400, "1" * 4300, "1" * 4301,
    "0." + "0" * 4000 + "1", "1e-45", "5e-324", "1e308", "1.7976931348623157e308", "1e309", "-1e400",
    "-0", "-0.0", "1E2", "1.0", "0.1e1", "2e0", "4.000000000000001",
))
EDGE_NUMBERS = (
    0, -1, 1, 2, 16, 17, 20, 21, 1024, 1025, 16384, 16385, -2**31, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63,
    -2**63 - 1, 2**64, 10**30, 10**400, -(10**400), 0.0, -0.0, 0.5, 1e-45, 5e-324, 1e-300, 1e-6, 9.99e-6, 1e-5,
    0.009, 1e308, -1e308, 100.0001, 2.0000001, 10.01, float("nan"), float("inf"),
)
FALSY = (0, 0.0, "", [], {}, False, None, Raw("-0"), Raw("0e0"))
STRINGS = (
    "", " ", "\x00", "\t\n", "\u00b2", "--5", "NaN", "null", "true", "x#1", "<|im_start|>", "<|endoftext|>",
    "<s>", "</s>", "\ud800", "\udfff", "\U0001f600", "\u202e\u2066", "\ufeff", "a\r\nb", "{{ 7*7 }}", "{% raw %}",
    "%s%n", "../../etc/passwd", "\\", '"', "e\u0301", "\u200b" * 10,
)
RID_FAMILY = ("x", "x#0", "x#1", "x#2", "x-1")  # shapes of the ids samples of "x" once had
RID_POOL = ("fuzz", "fuzz#1", "\u00b2", "--5", "0", "a" * 256, "a" * 257, "", " ")
PROMPTS = (
    "Hello", "The capital of France is", "Count: 1, 2, 3,", " ", "\n\n", "x#1", "\u00b2\u00b3", "<|im_start|>user",
    "<|endoftext|>", "def f(x):", "\U0001f600 emoji", "a" * 300, "Once upon a time", "--5 NaN 1e308",
)
UNKNOWN_KEYS = ("foo", "", " text", "Text", "text ", "\u00b2", "__proto__", "sampling_params.n", "max_new_tokens", "0")
SGLANG_UNSUPPORTED = ("image_data", "lora_path", "session_params", "return_hidden_states", "modalities", "input_embeds")
SAMPLING_KEYS = (
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "logit_bias", "ignore_eos", "n", "seed",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "sampling_seed", "stream_interval",
    "json_schema", "regex", "ebnf", "stop_regex",
)
GENERATE_KEYS = ("text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                 "top_logprobs_num", "return_text_in_logprobs", "rid", "cache_salt")
OPENAI_KEYS = (
    "model", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "frequency_penalty",
    "presence_penalty", "user", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "logit_bias",
    "cache_salt", "response_format", "best_of", "suffix", "regex", "json_schema", "guided_json", "tools",
)
COMPLETION_KEYS = (*OPENAI_KEYS, "prompt", "max_tokens", "logprobs", "echo")
CHAT_KEYS = (*OPENAI_KEYS, "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
             "add_generation_prompt", "functions")
MAX_KEYS = ("max_new_tokens", "max_tokens", "max_completion_tokens")  # kept cheap by `bodies.cap_tokens`


@st.composite
def number_texts(draw: Any) -> str:
    kind = weighted(draw, {"listed": 70, "int": 15, "unicode": 15})
    if kind == "listed":
        return draw(st.sampled_from(NUMBER_TEXTS))
    if kind == "int":
        return str(draw(st.integers(-(10**6), 10**6)))
    return draw(st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=4))


@st.composite
def numbers(draw: Any) -> Any:
    """A JSON number (or a string or boolean where one is expected), mostly of an edge shape."""
    kind = weighted(draw, {"edge": 35, "raw": 25, "text": 15, "float": 10, "int": 10, "bool": 5})
    if kind == "edge":
        return draw(st.sampled_from(EDGE_NUMBERS))
    if kind == "raw":
        return draw(st.sampled_from(RAW_NUMBERS))
    if kind == "text":
        return draw(number_texts())
    if kind == "float":
        return draw(st.floats())
    return draw(st.integers(-(2**70), 2**70)) if kind == "int" else draw(st.booleans())


strings = st.one_of(st.sampled_from(STRINGS), st.text(max_size=12), number_texts())
scalars = st.one_of(st.none(), st.booleans(), numbers(), strings, st.sampled_from(FALSY))
containers = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(strings, inner, max_size=3)),
    max_leaves=6,
)


@st.composite
def hostile(draw: Any) -> Any:
    """A value of the wrong shape for most fields: numbers first, then falsy ones, strings, containers."""
    kind = weighted(draw, {"number": 45, "falsy": 15, "string": 15, "container": 20, "null": 5})
    if kind == "number":
        return draw(numbers())
    if kind == "falsy":
        return draw(st.sampled_from(FALSY))
    if kind == "string":
        return draw(strings)
    return draw(containers) if kind == "container" else None


@st.composite
def rids(draw: Any) -> str:
    kind = weighted(draw, {"family": 55, "pool": 25, "number": 20})
    if kind == "family":
        return draw(st.sampled_from(RID_FAMILY))
    return draw(st.sampled_from(RID_POOL)) if kind == "pool" else draw(number_texts())


def bad_max_tokens(target: Target) -> st.SearchStrategy[Any]:
    """Token counts that must be refused: negative, past the cap or the context, wrong types."""
    return st.one_of(
        st.sampled_from((-1, -(2**63), 16385, 10**6, 2**63, 2**64, 10**400, target.context_len + 1, *RAW_NUMBERS[:3])),
        st.integers(max_value=-1), st.integers(min_value=16385), st.floats(),
        st.sampled_from(("4", "\u00b2", "--5", "NaN", "1e308", True, False, [], {}, [4], 4.0, Raw("4.0"))), number_texts(),
    )


# Names no server of the plan's can have (.example is reserved, RFC 2606): what the oracle knows
# to be foreign. Origins of a cross-site page, of a sandboxed frame ("null"), of a file, and of a
# DNS-rebinding page (its Host names it too); Host headers of a rebinding page.
FOREIGN_ORIGINS = ("http://evil.example", "https://evil.example:443", "null", "file://", "http://127.0.0.1.evil.example",
                   "http://localhost.example:30000", "chrome-extension://abcdef", "http://rebind.example")
FOREIGN_HOSTS = ("evil.example", "rebind.example", "rebind.example:30000", "127.0.0.1.evil.example", "localhost.example")
# Content types a page may send without a CORS preflight, others no JSON route takes, and None: no
# Content-Type header at all. "APPLICATION/JSON" and "application/json ;..." are JSON as the rule
# reads them (the media type, trimmed, in any case).
ODD_CONTENT_TYPES = ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", "", "application/jsonx", "json", "application/json-patch+json",
                  "APPLICATION/JSON", "application/json ; charset=utf-8", None)
# Pins: ttl, tier and pin_id of every wrong kind (and a few edges that are valid)
BAD_TTLS = (Raw("1" * 400), Raw("1e309"), Raw("-1e309"), -1, 0, Raw("-0.0"), "60", "1e3", True, False, [], {}, 10**400,
            float("nan"), float("inf"), Raw("NaN"))
EDGE_TTLS = (1e308, Raw("5e-324"), 2**63, 0.001)
BAD_TIERS = ("disk", "Memory", "", None, 5, [], {"tier": "memory"}, "gpu", "memory ", "\u00b2")
BAD_PIN_IDS = (Raw("1" * 400), Raw("9" * 4300), 10**400, 2**63, 2**64, -1, "1", 1.0, Raw("1.0"), True, None, [], {}, "\u00b2", Raw("1e309"))
