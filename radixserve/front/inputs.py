"""Turning what a caller sends (text or token ids, one or a batch) into validated requests.

Shared by the Engine and the HTTP server, so both accept exactly the same inputs and reject
bad ones with the same messages.
"""

from __future__ import annotations

from typing import Any

from radixserve.front.manager import GenerateRequest
from radixserve.front.tokenizer import encode
from radixserve.front.validation import (
    InvalidRequest,
    Limits,
    check_lengths,
    parse_sampling_params,
    validate_input_ids,
)
from radixserve.protocol import SchedulerReady


def build_requests(
    tokenizer: Any,
    ready: SchedulerReady,
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
    """Returns the requests and whether the input was a batch (a list) rather than one prompt."""
    if (text is None) == (input_ids is None):
        raise InvalidRequest("give exactly one of `text` and `input_ids`")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidRequest("`text` must be a string or a non-empty list of strings", param="text")
        prompts = [encode(tokenizer, t) for t in texts]
    else:
        is_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]  # type: ignore[list-item]
    n = len(prompts)
    requests = []
    for i, ids in enumerate(prompts):
        validate_input_ids(ids, ready.vocab_size)
        raw = _pick(sampling_params, i, n, "sampling_params")
        sampling = parse_sampling_params(raw, vocab_size=ready.vocab_size, limits=limits)
        check_lengths(len(ids), sampling.max_new_tokens, ready.context_len)
        want_logprob = bool(_pick(return_logprob, i, n, "return_logprob"))
        start = _pick(logprob_start_len, i, n, "logprob_start_len")
        top = _pick(top_logprobs_num, i, n, "top_logprobs_num")
        _check_int("logprob_start_len", -1 if start is None else start, -1, len(ids))
        _check_int("top_logprobs_num", top, 0, limits.max_top_logprobs)
        salt = _pick(cache_salt, i, n, "cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise InvalidRequest("`cache_salt` must be a string", param="cache_salt")
        req = GenerateRequest(
            input_ids=list(ids), sampling=sampling, return_logprob=want_logprob,
            logprob_start_len=-1 if start is None else start, top_logprobs_num=top,
            return_text_in_logprobs=bool(return_text_in_logprobs), cache_salt=salt,
        )
        this_rid = _pick(rid, i, n, "rid")
        if this_rid is not None:
            if not isinstance(this_rid, str) or not this_rid:
                raise InvalidRequest("`rid` must be a non-empty string", param="rid")
            req.rid = this_rid
        requests.append(req)
    return requests, is_batch


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
