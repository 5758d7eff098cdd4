"""Turning what a caller sends (text or token ids, one or a batch) into validated requests.

Shared by the Engine and the HTTP server, so both accept exactly the same inputs and reject
bad ones with the same messages.
"""

from __future__ import annotations

from typing import Any

from radixserve.front.types import GenerateRequest, InvalidRequest
from radixserve.front.validation.limits import Limits
from radixserve.front.validation.sampling import (
    check_lengths,
    check_prompt_chars,
    finite_float,
    parse_sampling_params,
    validate_input_ids,
)
from radixserve.protocol import PIN_TIERS, WorkerInfo
from radixserve.tokenizer import encode


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
) -> tuple[list[GenerateRequest], bool]:
    """Returns the requests and whether the input was a batch (a list) rather than one prompt.

    Sizes are checked before the work they would cost: the number of prompts and every text's
    length in characters before any is tokenized, each tokenized prompt against the context before
    the next is tokenized, a token-id list's length before its ids are.
    """
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
