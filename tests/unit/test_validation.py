"""Request validation in the front: sampling params, token ids, lengths."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.front.types import InvalidRequest
from radixserve.front.validation.limits import Limits
from radixserve.front.validation.sampling import (
    MAX_SEED,
    check_lengths,
    parse_sampling_params,
    validate_input_ids,
)
from radixserve.protocol import Grammar, SamplingParams

VOCAB = 1000
LIMITS = Limits()


def parse(raw: Any, limits: Limits = LIMITS) -> SamplingParams:
    return parse_sampling_params(raw, vocab_size=VOCAB, limits=limits)


def test_defaults() -> None:
    assert parse(None) == SamplingParams()
    assert parse({}) == SamplingParams()
    # None means "not given", as OpenAI clients send it; so do null constraint fields
    assert (
        parse({"stop": None, "seed": None, "regex": None, "json_schema": None}) == SamplingParams()
    )


def test_every_parameter() -> None:
    raw = {
        "max_new_tokens": 64,
        "min_new_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        "min_p": 0.05,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.1,
        "stop": ["\n\n", "END"],
        "stop_token_ids": [0, 999],
        "ignore_eos": True,
        "n": 3,
        "seed": MAX_SEED,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
        "logit_bias": {5: 1.5, 999: -100.0},
    }
    sp = parse({**raw, "regex": "[a-z]+"})
    assert msgspec.structs.asdict(sp) == {**raw, "grammar": Grammar("regex", "[a-z]+")}
    # what the front builds is what travels: it survives the msgpack round trip unchanged
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams) == sp


def test_sglang_client_keys() -> None:
    """What SGLang's RuntimeEndpoint sends: null constraints, an empty stop_regex list, and
    stream_interval / sampling_seed."""
    sp = parse({"stop_regex": [], "regex": None, "json_schema": None, "stream_interval": 2, "sampling_seed": 7})
    assert sp.seed == 7
    assert parse({"logit_bias": {"5": 2, 7: -1.5}}).logit_bias == {5: 2.0, 7: -1.5}
    for bad, param in [
        ({"stop_regex": ["a+"]}, "stop_regex"), ({"beam_width": 2}, "beam_width"),
        ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
        ({"seed": 1, "sampling_seed": 2}, "sampling_seed"), ({"stream_interval": "x"}, "stream_interval"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            parse(bad)
        assert err.value.param == param


def test_normalisations() -> None:
    assert parse({"temperature": 1}).temperature == 1.0
    assert type(parse({"temperature": 1}).temperature) is float
    assert parse({"top_k": 0}).top_k == -1
    assert parse({"top_k": VOCAB}).top_k == -1
    assert parse({"top_k": VOCAB - 1}).top_k == VOCAB - 1
    assert parse({"stop": "###"}).stop == ["###"]
    assert parse({"max_new_tokens": 0}).max_new_tokens == 0
    assert parse({"temperature": 0}).is_greedy
    # an absent max_new_tokens takes the default, but never more than the server allows
    assert parse({}, Limits(max_new_tokens=16)).max_new_tokens == 16


INVALID = [
    # (sampling_params, param, message)
    ([1, 2], "sampling_params", "sampling_params must be an object, got array"),
    ({"max_tokens": 5}, "max_tokens", "unknown sampling parameter 'max_tokens'"),
    ({"json_schema": "{}", "regex": "a+"}, "regex", "give at most one constraint of json_schema, regex, ebnf, structural_tag; got json_schema and regex"),
    ({"json_schema": "{"}, "json_schema", "json_schema is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ({"structural_tag": "[]"}, "structural_tag", "structural_tag must be a JSON object, got array"),
    ({"regex": ["a+"]}, "regex", "regex must be a string, got array"),
    ({"ebnf": "  "}, "ebnf", "ebnf must not be empty"),
    ({"max_new_tokens": True}, "max_new_tokens", "max_new_tokens must be an integer, got boolean"),
    ({"max_new_tokens": "10"}, "max_new_tokens", "max_new_tokens must be an integer, got string"),
    ({"max_new_tokens": 10.0}, "max_new_tokens", "max_new_tokens must be an integer, got number"),
    (
        {"max_new_tokens": -1},
        "max_new_tokens",
        "max_new_tokens must be between 0 and 16384, got -1",
    ),
    ({"max_new_tokens": 16385}, "max_new_tokens", "between 0 and 16384, got 16385"),
    (
        {"max_new_tokens": 8, "min_new_tokens": 9},
        "min_new_tokens",
        "min_new_tokens must be between 0 and max_new_tokens (8), got 9",
    ),
    ({"min_new_tokens": 200}, "min_new_tokens", "and max_new_tokens (128), got 200"),
    ({"min_new_tokens": -1}, "min_new_tokens", "min_new_tokens must be between 0 and"),
    ({"temperature": -0.1}, "temperature", "temperature must be between 0.0 and 100.0, got -0.1"),
    ({"temperature": 101}, "temperature", "temperature must be between 0.0 and 100.0, got 101"),
    ({"temperature": math.nan}, "temperature", "temperature must be a finite number, got nan"),
    ({"temperature": math.inf}, "temperature", "temperature must be a finite number, got inf"),
    ({"temperature": "hot"}, "temperature", "temperature must be a number, got string"),
    ({"temperature": False}, "temperature", "temperature must be a number, got boolean"),
    ({"top_p": 0}, "top_p", "top_p must be > 0.0 and <= 1.0, got 0"),
    ({"top_p": 1.5}, "top_p", "top_p must be > 0.0 and <= 1.0, got 1.5"),
    ({"top_k": -2}, "top_k", "top_k must be -1 or 0 (off) or >= 1, got -2"),
    ({"top_k": 1.5}, "top_k", "top_k must be an integer, got number"),
    ({"min_p": 1.1}, "min_p", "min_p must be between 0.0 and 1.0, got 1.1"),
    ({"min_p": -0.1}, "min_p", "min_p must be between 0.0 and 1.0, got -0.1"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "between -2.0 and 2.0, got 2.5"),
    ({"presence_penalty": -3}, "presence_penalty", "between -2.0 and 2.0, got -3"),
    ({"repetition_penalty": 0}, "repetition_penalty", "must be between 0.01 and 10.0, got 0"),
    ({"repetition_penalty": 11}, "repetition_penalty", "must be between 0.01 and 10.0, got 11"),
    ({"n": 0}, "n", "n must be between 1 and 16, got 0"),
    ({"n": 17}, "n", "n must be between 1 and 16, got 17"),
    ({"seed": -1}, "seed", f"seed must be between 0 and {MAX_SEED}, got -1"),
    ({"seed": 2**63}, "seed", f"seed must be between 0 and {MAX_SEED}, got {2**63}"),
    ({"seed": 1.0}, "seed", "seed must be an integer, got number"),
    ({"stop": 5}, "stop", "stop must be a string or a list of strings, got integer"),
    ({"stop": {"a": 1}}, "stop", "stop must be a string or a list of strings, got object"),
    ({"stop": ["a", 5]}, "stop", "stop[1] must be a string, got integer"),
    ({"stop": ["a", ""]}, "stop", "stop[1] is empty; stop strings must be non-empty"),
    ({"stop": ""}, "stop", "stop[0] is empty"),
    ({"stop": ["x" * 257]}, "stop", "stop[0] has 257 characters; at most 256 are allowed"),
    ({"stop": ["s"] * 17}, "stop", "at most 16 stop strings are allowed, got 17"),
    (
        {"stop_token_ids": [1, VOCAB]},
        "stop_token_ids",
        "stop_token_ids[1] = 1000 is out of range [0, 1000)",
    ),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids[0] = -1 is out of range"),
    (
        {"stop_token_ids": [True]},
        "stop_token_ids",
        "stop_token_ids[0] must be an integer token id, got boolean",
    ),
    (
        {"stop_token_ids": 5},
        "stop_token_ids",
        "stop_token_ids must be a list of token ids, got integer",
    ),
    ({"ignore_eos": "yes"}, "ignore_eos", "ignore_eos must be a boolean, got string"),
    (
        {"skip_special_tokens": 1},
        "skip_special_tokens",
        "skip_special_tokens must be a boolean, got integer",
    ),
    ({"no_stop_trim": 0}, "no_stop_trim", "no_stop_trim must be a boolean, got integer"),
]


@pytest.mark.parametrize(("raw", "param", "message"), INVALID)
def test_invalid_sampling_params(raw: Any, param: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(raw)
    assert message in info.value.message
    assert str(info.value) == info.value.message
    assert info.value.param == param
    assert isinstance(info.value, ValueError)


def test_limits_are_configurable() -> None:
    limits = Limits(max_new_tokens=100, max_n=2, max_stop=1, max_stop_chars=3)
    with pytest.raises(InvalidRequest, match="between 0 and 100, got 101"):
        parse({"max_new_tokens": 101}, limits)
    with pytest.raises(InvalidRequest, match="n must be between 1 and 2, got 3"):
        parse({"n": 3}, limits)
    with pytest.raises(InvalidRequest, match="at most 1 stop strings are allowed, got 2"):
        parse({"stop": ["a", "b"]}, limits)
    with pytest.raises(InvalidRequest, match="has 4 characters; at most 3"):
        parse({"stop": "abcd"}, limits)


def test_limits_validate_themselves() -> None:
    with pytest.raises(ValueError, match="Limits.max_n must be a positive integer, got 0"):
        Limits(max_n=0)
    with pytest.raises(ValueError, match="Limits.max_prompt_tokens must be a positive integer"):
        Limits(max_prompt_tokens=-5)
    with pytest.raises(AttributeError):
        LIMITS.max_n = 3  # type: ignore[misc]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
KEYS = st.sampled_from([*SamplingParams.__struct_fields__, "regex", "max_tokens"])


@given(raw=st.dictionaries(KEYS, JSON, max_size=5))
@settings(max_examples=400, deadline=None)
def test_any_json_gives_params_or_invalid_request(raw: dict[str, Any]) -> None:
    try:
        sp = parse(raw)
    except InvalidRequest as e:
        assert e.message and e.param
        return
    assert 0 <= sp.min_new_tokens <= sp.max_new_tokens <= LIMITS.max_new_tokens
    assert all(isinstance(s, str) and 0 < len(s) <= 256 for s in sp.stop)
    assert all(0 <= t < VOCAB for t in sp.stop_token_ids)
    assert 0.0 <= sp.temperature <= 100.0 and 0.0 < sp.top_p <= 1.0
    assert sp.top_k == -1 or 1 <= sp.top_k < VOCAB


# --------------------------------------------------------------------------- input ids, lengths


def test_validate_input_ids() -> None:
    assert validate_input_ids([0, 5, VOCAB - 1], VOCAB) == [0, 5, VOCAB - 1]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "input_ids must be a non-empty list of token ids"),
        ("hello", "input_ids must be a non-empty list of token ids"),
        (None, "input_ids must be a non-empty list of token ids"),
        ([1, 2, VOCAB], "input_ids[2] = 1000 is out of range [0, 1000)"),
        ([1, -3], "input_ids[1] = -3 is out of range [0, 1000)"),
        ([1, True], "input_ids[1] must be an integer token id, got boolean"),
        ([1, 2.0], "input_ids[1] must be an integer token id, got number"),
        ([[1, 2]], "input_ids[0] must be an integer token id, got array"),
    ],
)
def test_invalid_input_ids(ids: Any, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_input_ids(ids, VOCAB)
    assert info.value.message == message
    assert info.value.param == "input_ids"


def test_check_lengths() -> None:
    check_lengths(10, 0, 11)
    check_lengths(10, 22, 32)  # exactly fills the context
    check_lengths(10, 5, 100, max_prompt_tokens=10)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((0, 10, 100), {}, "the prompt is empty; at least one token is needed"),
        (
            (100, 0, 100),
            {},
            "the prompt has 100 tokens but the model's context length is 100, so at most 99 "
            "prompt tokens fit",
        ),
        (
            (90, 20, 100),
            {},
            "prompt (90 tokens) + max_new_tokens (20) = 110 exceeds the model's context length "
            "of 100; ask for at most 10 new tokens",
        ),
        (
            (11, 1, 100),
            {"max_prompt_tokens": 10},
            "the prompt has 11 tokens; this server accepts at most 10",
        ),
    ],
)
def test_check_lengths_errors(
    args: tuple[int, int, int], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_lengths(*args, **kwargs)
    assert info.value.message == message


# --------------------------------------------------------------------------- hostile values


@pytest.mark.parametrize(
    "key",
    ["\u00b2", "--5", "1" * 5000, " 5", "+5", "5.0", "\u0663", "-1", ""],
    ids=["superscript", "double minus", "5000 digits", "space", "plus", "decimal", "arabic digit", "negative", "empty"],
)
def test_logit_bias_keys_must_be_ascii_decimal_token_ids(key: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse({"logit_bias": {key: 1.0}})
    assert info.value.param == "logit_bias"
    assert "ASCII decimal" in info.value.message and len(info.value.message) < 300
    assert parse({"logit_bias": {"0": 1, str(VOCAB - 1): -1}}).logit_bias == {0: 1.0, VOCAB - 1: -1.0}


def test_list_valued_fields_are_capped_and_stop_token_ids_deduplicated() -> None:
    cap = LIMITS.max_stop_token_ids
    assert cap == 1024
    assert parse({"stop_token_ids": [5, 7, 5, 5, 7, 9]}).stop_token_ids == [5, 7, 9]
    assert len(parse({"stop_token_ids": [i % VOCAB for i in range(cap)]}).stop_token_ids) == VOCAB
    with pytest.raises(InvalidRequest, match=f"at most {cap} stop_token_ids are allowed, got {cap + 1}"):
        parse({"stop_token_ids": [1] * (cap + 1)})
    with pytest.raises(InvalidRequest, match=f"at most {LIMITS.max_logit_bias} are allowed"):
        parse({"logit_bias": {str(i): 1 for i in range(LIMITS.max_logit_bias + 1)}}, Limits())
    assert parse({"stop": ["a", "b", "a"]}).stop == ["a", "b"]


@pytest.mark.parametrize(
    ("raw", "param", "message"),
    [
        ({"temperature": 1e-45}, "temperature", "temperature must be 0 (greedy) or between 1e-05 and 100.0"),
        ({"temperature": 1e-6}, "temperature", "temperature must be 0 (greedy) or between 1e-05"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty", "between 0.01 and 10.0, got 1e-300"),
        ({"repetition_penalty": 0.009}, "repetition_penalty", "between 0.01 and 10.0"),
        ({"temperature": 10**400}, "temperature", "temperature must be a finite number"),
        ({"top_p": -(10**400)}, "top_p", "top_p must be a finite number"),
        ({"logit_bias": {"1": 10**400}}, "logit_bias", "must be a number between -100 and 100"),
    ],
    ids=["denormal temperature", "tiny temperature", "tiny repetition_penalty", "repetition_penalty below 0.01",
         "huge int temperature", "huge int top_p", "huge int bias"],
)
def test_values_that_would_make_a_nan_distribution_are_rejected(raw: Any, param: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(raw)
    assert info.value.param == param and message in info.value.message, info.value.message


def test_smallest_accepted_values_give_a_finite_distribution() -> None:
    """The bounds are where sampling stays exact: the worst accepted settings on large logits."""
    import torch

    from radixserve.worker.sampler import Sampler, SamplingState

    sp = parse({"temperature": 1e-5, "repetition_penalty": 0.01, "logit_bias": {"3": 100}})
    logits = torch.full((1, VOCAB), -300.0)
    logits[0, 3] = 300.0
    state = SamplingState(sp, prompt_ids=[3, 4])
    assert Sampler(VOCAB).sample(logits, [state]).token_ids == [3]


# --------------------------------------------------------------------------- build_requests


class _CharTokenizer:
    """One token per character; counts its calls, so a test sees what was tokenized."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> Any:
        self.calls += 1
        return type("Encoding", (), {"input_ids": [ord(c) % VOCAB for c in text]})()


def build(**fields: Any) -> list[Any]:
    from radixserve.front.validation.inputs import build_requests
    from radixserve.protocol import WorkerInfo

    ready = WorkerInfo(1024, 4, 256, VOCAB, [2], "stub", "float32", "cpu", "avx2")
    return build_requests(fields.pop("tokenizer", _CharTokenizer()), ready, fields.pop("limits", LIMITS), **fields)[0]


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"text": ""}, "text", "`text` is empty"),
        ({"text": ["a", ""]}, "text", "`text[1]` is empty"),
        ({"text": "hi", "cache_salt": ""}, "cache_salt", "`cache_salt` must be a non-empty string"),
        ({"text": "hi", "cache_salt": "s" * 257}, "cache_salt", "has 257 characters; at most 256 are allowed"),
        ({"text": ["a", "b", "c"], "rid": ["x", "y", "x"]}, "rid", "'x' is given twice"),
        ({"text": "hi", "rid": "r" * 257}, "rid", "has 257 characters; at most 256 are allowed"),
    ],
    ids=["empty text", "empty text in a batch", "empty salt", "long salt", "duplicate rids", "long rid"],
)
def test_build_requests_names_the_field(fields: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        build(**fields)
    assert info.value.param == param and message in info.value.message, info.value.message


def test_a_batch_over_the_sequence_cap_is_refused_before_tokenizing() -> None:
    tokenizer, limits = _CharTokenizer(), Limits(max_sequences=4)
    with pytest.raises(InvalidRequest, match="5 sequences .* at most 4"):
        build(text=["a"] * 5, tokenizer=tokenizer, limits=limits)
    assert tokenizer.calls == 0
    with pytest.raises(InvalidRequest, match="6 sequences .* at most 4"):
        build(text=["a", "b"], sampling_params={"n": 3}, tokenizer=tokenizer, limits=limits)
    assert len(build(text=["a", "b"], sampling_params={"n": 2}, limits=limits)) == 2


def test_a_text_over_the_character_bound_is_refused_before_any_is_tokenized() -> None:
    tokenizer, limits = _CharTokenizer(), Limits(max_prompt_chars=10)
    expected = r"`text\[1\]` is too long: 11 characters, and a prompt over 10 characters cannot fit the model's context of 256 tokens"
    with pytest.raises(InvalidRequest, match=expected) as info:
        build(text=["a", "b" * 11], tokenizer=tokenizer, limits=limits)
    assert info.value.param == "text" and tokenizer.calls == 0
    assert len(build(text="b" * 10, limits=limits)) == 1


def test_a_batch_stops_tokenizing_at_the_first_prompt_over_the_context() -> None:
    tokenizer = _CharTokenizer()  # one token per character; the context is 256 tokens
    with pytest.raises(InvalidRequest, match="the prompt has 300 tokens but the model's context length is 256"):
        build(text=["a", "b" * 300, "c" * 300], tokenizer=tokenizer)
    assert tokenizer.calls == 2


# --------------------------------------------------------------------------- segments

BOS = 1


class _BosTokenizer(_CharTokenizer):
    """One token per character, a BOS first unless asked not to (as Llama-style tokenizers)."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> Any:
        ids = super().__call__(text).input_ids
        return type("Encoding", (), {"input_ids": [BOS, *ids] if add_special_tokens else ids})()


def _ids(text: str) -> list[int]:
    return [ord(c) % VOCAB for c in text]


def test_segments_are_tokenized_one_by_one_and_their_spans_kept() -> None:
    (req,) = build(segments=["Doc one. ", "Doc two. ", "Question?"], tokenizer=_BosTokenizer())
    assert req.input_ids == [BOS, *_ids("Doc one. "), *_ids("Doc two. "), *_ids("Question?")]
    # the first segment as `text` would be tokenized (BOS included); the last is never a span
    assert req.segments == [(0, 10), (10, 19)]
    assert req.input_ids[10:19] == _ids("Doc two. ")
    assert req.segment_recompute_ratio == 0.15  # the server's default


def test_segment_reuse_and_the_recompute_ratio() -> None:
    (req,) = build(
        segments=["intro ", "doc", " between ", "doc2", "?"], segment_reuse=[False, True, False, True, False],
        segment_recompute_ratio=0, default_recompute_ratio=0.5, tokenizer=_BosTokenizer(),
    )
    assert req.segments == [(7, 10), (19, 23)] and req.segment_recompute_ratio == 0.0
    assert build(segments=["a", "b"], default_recompute_ratio=0.5)[0].segment_recompute_ratio == 0.5
    assert build(segments=["a", "b"], segment_recompute_ratio=1)[0].segment_recompute_ratio == 1.0
    # one segment: the whole prompt is the question, nothing to reuse
    assert build(segments=["only the question"])[0].segments == []
    # a ratio without segments is accepted (a client may send it with every request)
    assert build(text="hi", segment_recompute_ratio=0.3)[0].segments == []


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"segments": "a b"}, "segments", "`segments` must be a list of strings, got string"),
        ({"segments": []}, "segments", "`segments` is empty"),
        ({"segments": ["a"] * 65}, "segments", "`segments` has 65 entries; at most 64 are allowed"),
        ({"segments": ["a", 3]}, "segments", "`segments[1]` must be a non-empty string, got integer"),
        ({"segments": ["a", ""]}, "segments", "`segments[1]` must be a non-empty string, got an empty string"),
        ({"segments": ["a", None]}, "segments", "`segments[1]` must be a non-empty string, got null"),
        ({"segments": [["a", "b"], ["c"]]}, "segments", "a batch of segmented prompts (a list of lists) is not supported"),
        ({"segments": ["a"], "text": "b"}, "segments", "`segments` cannot be combined with `text`"),
        ({"segments": ["a"], "text": ["b"]}, "segments", "`segments` cannot be combined with `text`"),
        ({"segments": ["a"], "input_ids": [1]}, "segments", "`segments` cannot be combined with `input_ids`"),
        ({"segments": ["a"], "segment_recompute_ratio": 1.5}, "segment_recompute_ratio", "must be a number from 0 to 1"),
        ({"segments": ["a"], "segment_recompute_ratio": -0.1}, "segment_recompute_ratio", "got -0.1"),
        ({"segments": ["a"], "segment_recompute_ratio": True}, "segment_recompute_ratio", "got boolean"),
        ({"segments": ["a"], "segment_recompute_ratio": "0.2"}, "segment_recompute_ratio", "got string"),
        ({"segments": ["a"], "segment_recompute_ratio": math.nan}, "segment_recompute_ratio", "must be a number"),
        ({"text": "a", "segment_recompute_ratio": 2}, "segment_recompute_ratio", "must be a number from 0 to 1"),
        ({"segments": ["a", "b"], "segment_reuse": [True]}, "segment_reuse", "has 1 entries for 2 segments"),
        ({"segments": ["a", "b"], "segment_reuse": [1, 0]}, "segment_reuse", "a list of booleans"),
        ({"segments": ["a", "b"], "segment_reuse": [True, True]}, "segment_reuse", "the last is always computed"),
        ({"text": "a", "segment_reuse": [False]}, "segment_reuse", "give them too"),
    ],
    ids=[
        "not a list", "empty", "too many", "not a string", "empty string", "null", "batch", "with text",
        "with a text batch", "with input_ids", "ratio over 1", "ratio under 0", "ratio boolean", "ratio string",
        "ratio nan", "ratio without segments", "reuse length", "reuse not booleans", "reuse last", "reuse alone",
    ],
)
def test_bad_segments_are_refused_naming_the_field(fields: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        build(**fields)
    assert info.value.param == param and message in info.value.message, info.value.message


def test_segments_are_checked_against_the_context_like_any_prompt() -> None:
    tokenizer = _BosTokenizer()  # the context is 256 tokens
    with pytest.raises(InvalidRequest, match="the prompt has 301 tokens but the model's context length is 256"):
        build(segments=["a" * 150, "b" * 150, "c" * 300], tokenizer=tokenizer)
    assert tokenizer.calls == 2  # the third segment was never tokenized
    with pytest.raises(InvalidRequest, match=r"prompt \(201 tokens\) \+ max_new_tokens \(100\) = 301 exceeds"):
        build(segments=["a" * 100, "b" * 100], sampling_params={"max_new_tokens": 100}, tokenizer=_BosTokenizer())
    with pytest.raises(InvalidRequest, match="`segments` is too long: 11 characters") as info:
        build(segments=["a" * 5, "b" * 6], tokenizer=tokenizer, limits=Limits(max_prompt_chars=10))
    assert info.value.param == "segments"


def test_a_segment_without_tokens_has_no_span_and_the_last_piece_is_never_one() -> None:
    from radixserve.tokenizer import reusable_spans

    assert reusable_spans([3, 0, 4, 2], [True, True, True, False]) == [(0, 3), (3, 7)]
    # a reusable piece that ends the prompt (the pieces after it have no tokens) is computed in context
    assert reusable_spans([3, 4, 0], [True, True, False]) == [(0, 3)]
    assert reusable_spans([3], [False]) == []
