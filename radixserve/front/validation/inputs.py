"""Turning what a caller sends (text or token ids, one or a batch) into validated requests.

Shared by the Engine and the HTTP server, so both accept exactly the same inputs and reject
bad ones with the same messages.
"""

from __future__ import annotations

from typing import Any

from radixserve.config import ServerConfig
from radixserve.front.types import GenerateRequest, InvalidRequest, json_type
from radixserve.front.validation.limits import Limits
from radixserve.front.validation.sampling import (
    check_lengths,
    check_prompt_chars,
    finite_float,
    parse_sampling_params,
    validate_input_ids,
)
from radixserve.protocol import PIN_TIERS, WorkerInfo
from radixserve.tokenizer import encode, encode_continuation, reusable_spans

# Pieces of one prompt given as `segments`. Each is tokenized on its own and may become a span
# the scheduler looks up in the segment cache; RAG prompts carry a handful of documents, and
# the bound keeps one request from costing a tokenizer call and a cache lookup per word.
MAX_SEGMENTS = 64


def build_requests(
    tokenizer: Any,
    ready: WorkerInfo,
    limits: Limits,
    *,
    text: str | list[str] | None = None,
    input_ids: list[int] | list[list[int]] | None = None,
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
    rid: str | list[str] | None = None,
    return_logprob: bool | list[bool] = False,
    logprob_start_len: int | list[int] | None = None,
    top_logprobs_num: int | list[int] = 0,
    return_text_in_logprobs: bool = False,
    cache_salt: str | list[str] | None = None,
    segments: list[str] | None = None,
    segment_reuse: list[bool] | None = None,
    segment_recompute_ratio: float | None = None,
    default_recompute_ratio: float = ServerConfig.segment_recompute_ratio,
) -> tuple[list[GenerateRequest], bool]:
    """Returns the requests and whether the input was a batch (a list) rather than one prompt.

    The prompt is `text`, `input_ids`, or `segments`: one prompt given as pieces, tokenized
    one by one and concatenated, whose pieces but the last may be reused from the segment cache
    wherever they sit (`segment_reuse` says which, one flag per piece, when not all but the
    last). `segment_recompute_ratio` (else `default_recompute_ratio`, the server's) is the share
    of reused tokens recomputed in context.

    Sizes are checked before the work they would cost: the number of prompts and every text's
    length in characters before any is tokenized, each tokenized prompt against the context before
    the next is tokenized, a token-id list's length before its ids are.
    """
    ratio = check_recompute_ratio(segment_recompute_ratio, default_recompute_ratio)
    spans: list[tuple[int, int]] = []
    if segments is not None:
        prompt, spans = _segmented_prompt(tokenizer, segments, segment_reuse, text, input_ids, limits, ready.context_len)
        prompts, is_batch = [prompt], False
    elif segment_reuse is not None:
        raise InvalidRequest("`segment_reuse` describes `segments`; give them too, or leave it out", param="segment_reuse")
    else:
        prompts, is_batch = _prompts(tokenizer, text, input_ids, limits, ready.context_len)
    n = len(prompts)
    rids = _rids(rid, n, limits)
    requests = []
    for i, ids in enumerate(prompts):
        raw = _pick(sampling_params, i, n, "sampling_params")
        sampling = parse_sampling_params(raw, vocab_size=ready.vocab_size, limits=limits)
        if isinstance(ids, list) and ids:
            check_lengths(len(ids), sampling.max_new_tokens, ready.context_len)
        validate_input_ids(ids, ready.vocab_size)
        want_logprob = bool(_pick(return_logprob, i, n, "return_logprob"))
        start = _pick(logprob_start_len, i, n, "logprob_start_len")
        top = _pick(top_logprobs_num, i, n, "top_logprobs_num")
        _check_int("logprob_start_len", -1 if start is None else start, -1, len(ids))
        _check_int("top_logprobs_num", top, 0, limits.max_top_logprobs)
        req = GenerateRequest(
            input_ids=list(ids), sampling=sampling, return_logprob=want_logprob,
            logprob_start_len=-1 if start is None else start, top_logprobs_num=top,
            return_text_in_logprobs=bool(return_text_in_logprobs),
            cache_salt=_salt(_pick(cache_salt, i, n, "cache_salt"), limits),
            segments=spans, segment_recompute_ratio=ratio,
        )
        if rids[i] is not None:
            req.rid = rids[i]
        requests.append(req)
    _check_sequences(sum(r.sampling.n for r in requests), limits)
    return requests, is_batch


def build_prefix(
    tokenizer: Any, ready: WorkerInfo, limits: Limits, *, text: Any = None, input_ids: Any = None,
    cache_salt: Any = None,
) -> tuple[list[int], str | None]:
    """One prefix to pin (``/cache/pin``, ``/cache/unpin``): its token ids, checked as a
    prompt's are, and its cache salt. `text` is tokenized as a prompt of /generate is."""
    prompts, is_batch = _prompts(tokenizer, text, input_ids, limits, ready.context_len)
    if is_batch or len(prompts) != 1:
        raise InvalidRequest("give one prefix, not a list", param="input_ids" if text is None else "text")
    ids = validate_input_ids(prompts[0], ready.vocab_size)
    check_lengths(len(ids), 0, ready.context_len)
    if len(ids) < ready.page_size:
        raise InvalidRequest(
            f"the prefix has {len(ids)} tokens, less than one KV page ({ready.page_size}): nothing to pin",
            param="text" if input_ids is None else "input_ids",
        )
    return ids, _salt(cache_salt, limits)


def check_pin_options(tier: Any, ttl: Any, disk_tier: bool) -> tuple[str, float | None]:
    """A pin's tier and ttl (seconds, None: until unpinned), checked."""
    if tier not in PIN_TIERS:
        raise InvalidRequest(f"`tier` must be one of {', '.join(PIN_TIERS)}", param="tier")
    if tier == "disk" and not disk_tier:
        raise InvalidRequest("`tier` \"disk\" needs the disk tier: start the server with --kv-disk-dir", param="tier")
    if ttl is None:
        return tier, None
    seconds = finite_float(ttl) if type(ttl) in (int, float) else None
    if seconds is None or seconds <= 0:
        raise InvalidRequest("`ttl` must be a finite number of seconds > 0 (omit it to pin until unpinned)", param="ttl")
    return tier, seconds



def _prompts(tokenizer: Any, text: Any, input_ids: Any, limits: Limits, context_len: int) -> tuple[list[Any], bool]:
    """The prompts as token-id lists (ids unchecked yet), and whether they came as a batch."""
    if (text is None) == (input_ids is None):
        raise InvalidRequest("give exactly one of `text` and `input_ids`")
    if text is None:
        is_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
        _check_sequences(len(prompts), limits, at_least=True)
        return prompts, is_batch
    is_batch = isinstance(text, list)
    texts = text if is_batch else [text]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidRequest("`text` must be a string or a non-empty list of strings", param="text")
    _check_sequences(len(texts), limits, at_least=True)
    names = [f"`text[{i}]`" if is_batch else "`text`" for i in range(len(texts))]
    for t, name in zip(texts, names):
        check_prompt_chars(len(t), limits, context_len, name, "text")
    prompts = []
    for t, name in zip(texts, names):
        ids = encode(tokenizer, t) if t else []
        if not ids:
            raise InvalidRequest(f"{name} is empty; a prompt needs at least one token", param="text")
        # stop at the first prompt that cannot fit: the rest of the batch is not tokenized
        check_lengths(len(ids), 0, context_len)
        prompts.append(ids)
    return prompts, is_batch


def check_recompute_ratio(value: Any, default: float) -> float:
    """A request's `segment_recompute_ratio`: a number in [0, 1] (a boolean is not one), or the
    server's `default` when absent."""
    if value is None:
        return default
    ratio = finite_float(value) if type(value) in (int, float) else None
    if ratio is None or not 0.0 <= ratio <= 1.0:
        raise InvalidRequest(
            "`segment_recompute_ratio` must be a number from 0 to 1 (the share of reused segment tokens "
            f"recomputed), got {json_type(value) if type(value) not in (int, float) else value}",
            param="segment_recompute_ratio",
        )
    return ratio


def _segmented_prompt(
    tokenizer: Any, segments: Any, reuse: Any, text: Any, input_ids: Any, limits: Limits, context_len: int,
) -> tuple[list[int], list[tuple[int, int]]]:
    """`segments`' token ids, concatenated, and the spans that may be reused.

    The first piece is tokenized as `text` would be (the tokenizer's special tokens, a BOS,
    included), the others on their own without special tokens: a piece's tokens then do not
    depend on what precedes it, so its KV can be computed once and reused wherever it sits.
    """
    for other, given in (("text", text), ("input_ids", input_ids)):
        if given is not None:
            raise InvalidRequest(
                f"`segments` cannot be combined with `{other}`: the segments are the prompt", param="segments",
            )
    if not isinstance(segments, list):
        raise InvalidRequest(f"`segments` must be a list of strings, got {json_type(segments)}", param="segments")
    if not segments:
        raise InvalidRequest("`segments` is empty; give at least one string (the last is the part after the reusable ones)",
                             param="segments")
    if any(isinstance(s, list) for s in segments):
        raise InvalidRequest(
            "`segments` is one prompt's pieces, a list of strings; a batch of segmented prompts (a list of lists) is "
            "not supported: send one request per prompt", param="segments",
        )
    if len(segments) > MAX_SEGMENTS:
        raise InvalidRequest(f"`segments` has {len(segments)} entries; at most {MAX_SEGMENTS} are allowed", param="segments")
    _check_segment_list(segments)
    flags = _segment_reuse(reuse, len(segments))
    check_prompt_chars(sum(len(s) for s in segments), limits, context_len, "`segments`", "segments")
    pieces: list[list[int]] = []
    total = 0
    for i, piece in enumerate(segments):
        ids = encode(tokenizer, piece) if i == 0 else encode_continuation(tokenizer, piece)
        pieces.append(ids)
        total += len(ids)
        if total:
            check_lengths(total, 0, context_len)  # stop at the first piece that overflows the context
    if not total:
        raise InvalidRequest("`segments` hold no tokens; a prompt needs at least one", param="segments")
    return [t for ids in pieces for t in ids], reusable_spans([len(ids) for ids in pieces], flags)


def _check_segment_list(segments: list[Any]) -> None:
    for i, piece in enumerate(segments):
        if not isinstance(piece, str) or not piece:
            got = "an empty string" if piece == "" else json_type(piece)
            raise InvalidRequest(f"`segments[{i}]` must be a non-empty string, got {got}", param="segments")


def build_segment_prefixes(
    tokenizer: Any, ready: WorkerInfo, limits: Limits, *, segments: Any, cache_salt: Any = None,
) -> tuple[list[list[int]], str | None]:
    """Segments to pin (``/cache/pin``, ``/cache/unpin``): each one's token ids as it follows
    other text in a prompt (the way a request's reusable segments are tokenized), and the salt."""
    if not isinstance(segments, list) or not segments:
        raise InvalidRequest("`segments` must be a non-empty list of strings", param="segments")
    if len(segments) > MAX_SEGMENTS:
        raise InvalidRequest(f"`segments` has {len(segments)} entries; at most {MAX_SEGMENTS} are allowed", param="segments")
    _check_segment_list(segments)
    check_prompt_chars(max(len(s) for s in segments), limits, ready.context_len, "a segment", "segments")
    prefixes = []
    for i, piece in enumerate(segments):
        ids = encode_continuation(tokenizer, piece)
        check_lengths(len(ids), 0, ready.context_len)
        if len(ids) < ready.page_size:
            raise InvalidRequest(
                f"`segments[{i}]` has {len(ids)} tokens, less than one KV page ({ready.page_size}): nothing to pin",
                param="segments",
            )
        prefixes.append(ids)
    return prefixes, _salt(cache_salt, limits)


def _segment_reuse(reuse: Any, count: int) -> list[bool]:
    """Which segments may be reused: by default all but the last (the part after them, such as
    the question, is always computed in context)."""
    if reuse is None:
        return [True] * (count - 1) + [False]
    if not isinstance(reuse, list) or not all(type(flag) is bool for flag in reuse):
        raise InvalidRequest("`segment_reuse` must be a list of booleans, one per segment", param="segment_reuse")
    if len(reuse) != count:
        raise InvalidRequest(f"`segment_reuse` has {len(reuse)} entries for {count} segments", param="segment_reuse")
    if reuse[-1]:
        raise InvalidRequest(
            "`segment_reuse` marks the last segment reusable; the last is always computed in context", param="segment_reuse",
        )
    return reuse


def _rids(rid: Any, n: int, limits: Limits) -> list[str | None]:
    """The caller's labels, one per prompt (None: a random one). Unique within the call; whether
    one is taken by a request in flight is the `TokenizerManager`'s to say."""
    if isinstance(rid, str) and n > 1:
        raise InvalidRequest("`rid` must be a list with one id per prompt for a batch", param="rid")
    rids = [_pick(rid, i, n, "rid") for i in range(n)]
    seen: set[str] = set()
    for r in rids:
        if r is None:
            continue
        if not isinstance(r, str) or not r:
            raise InvalidRequest("`rid` must be a non-empty string", param="rid")
        if len(r) > limits.max_rid_chars:
            raise InvalidRequest(f"`rid` has {len(r)} characters; at most {limits.max_rid_chars} are allowed", param="rid")
        if r in seen:
            raise InvalidRequest(f"`rid` {r!r} is given twice; each prompt of a batch needs its own", param="rid")
        seen.add(r)
    return rids


def _salt(salt: Any, limits: Limits) -> str | None:
    """None is the shared cache; an empty salt is refused rather than silently shared."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise InvalidRequest("`cache_salt` must be a non-empty string (omit it for the shared cache)", param="cache_salt")
    if len(salt) > limits.max_cache_salt_chars:
        raise InvalidRequest(
            f"`cache_salt` has {len(salt)} characters; at most {limits.max_cache_salt_chars} are allowed",
            param="cache_salt",
        )
    return salt


def _check_sequences(count: int, limits: Limits, at_least: bool = False) -> None:
    if count > limits.max_sequences:
        asks = f"at least {count}" if at_least else str(count)
        raise InvalidRequest(
            f"the request asks for {asks} sequences (prompts x n); this server queues at most "
            f"{limits.max_sequences}"
        )


def _pick(value: Any, i: int, n: int, name: str) -> Any:
    """A per-request value: one for all, or a list with one per prompt."""
    if isinstance(value, list) and name != "input_ids":
        if len(value) != n:
            raise InvalidRequest(f"`{name}` has {len(value)} entries for {n} prompts", param=name)
        return value[i]
    return value


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"`{name}` must be an integer in [{low}, {high}], got {value!r}", param=name)
