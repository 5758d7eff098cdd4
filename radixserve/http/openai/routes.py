"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions`.

Requests are parsed into the same `build_requests` the native API uses (so validation and its
messages are shared), then results are shaped as OpenAI's objects: ids `cmpl-...` /
`chatcmpl-...`, `choices[]` (prompt-major, n per prompt), `usage` with
`prompt_tokens_details.cached_tokens` (and `segment_tokens`, `recomputed_tokens`), streaming
chunks with `delta`, then `data: [DONE]`.

Accepted beyond OpenAI's fields (vLLM/SGLang extensions): top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, skip_special_tokens, spaces_between_special_tokens, no_stop_trim,
min_tokens, cache_salt, add_generation_prompt (chat), and the constraint keys of
`front.constraints`; segments, RAG pieces whose KV may be reused wherever they sit:
`segments` instead of `prompt` (completions), content parts with `"segment": true` (chat), and
`segment_recompute_ratio` (both), with `prompt_tokens_details.segment_tokens` and
`recomputed_tokens` in `usage`. `logit_bias` really biases sampling (greedy included). Unknown top-level
fields are ignored as OpenAI does; known fields with a wrong type are 400s.

Tool calling (chat): `front.tools` checks the request and renders the prompt, `front.tool_calls`
reads the calls out of each choice's text, here and while streaming (`delta.tool_calls`).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixserve.front.types import GenerateRequest, InvalidRequest, RequestFailed
from radixserve.front.validation.inputs import MAX_SEGMENTS, build_requests
from radixserve.front.validation.sampling import check_prompt_chars
from radixserve.http.common import (
    SSE_DONE,
    JSONResponse,
    SSEResponse,
    handles_errors,
    read_json,
    sse,
    to_http_error,
    until_disconnect,
)
from radixserve.http.openai.constraints import Constraint, body_constraint
from radixserve.http.openai.tool_call_parser import (
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    Event,
    ToolCallFormat,
    ToolCallParser,
    parse_tool_calls,
    resolve_format,
)
from radixserve.http.openai.tool_requests import (
    ToolRequest,
    parse_tool_request,
    prompt_chars,
    render_chat,
    render_chat_segments,
    structural_tag,
)
from radixserve.http.state import ServerState
from radixserve.http.tenants import scope_requests
from radixserve.tokenizer import ChatSegments, normalize_messages, text_chars

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint

# OpenAI body key -> SGLang sampling parameter
_SAMPLING_KEYS = {
    "temperature": "temperature", "top_p": "top_p", "n": "n", "seed": "seed", "stop": "stop",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim",
    "spaces_between_special_tokens": "spaces_between_special_tokens", "min_tokens": "min_new_tokens",
    "logit_bias": "logit_bias",
}


@dataclass
class _Call:
    """One parsed OpenAI request: its requests, and what shaping the answer needs."""

    chat: bool
    id: str
    model: str
    requests: list[GenerateRequest]
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    echo: list[str] | None = None  # completions with echo: each prompt's text
    tool_format: ToolCallFormat | None = None  # chat with tools to call: how calls are written
    tool_names: frozenset[str] = frozenset()
    constraint: Constraint | None = None  # the decoding constraint, for naming it in errors
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return self.requests[0].sampling.n

    @property
    def object(self) -> str:
        if self.chat:
            return "chat.completion.chunk" if self.stream else "chat.completion"
        return "text_completion"

    def envelope(self, **fields: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model, **fields}


# ---------------------------------------------------------------------- routes


@handles_errors
async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, state.config.max_body_bytes)
    call = await state.prepare(_parse_completion, state, body)
    del body  # unknown fields are ignored, not kept alive (and walked by the GC) while it runs
    return await _serve(request, state, call)


@handles_errors
async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, state.config.max_body_bytes)
    call = await state.prepare(_parse_chat, state, body)
    del body  # unknown fields are ignored, not kept alive (and walked by the GC) while it runs
    return await _serve(request, state, call)


async def _serve(request: Request, state: ServerState, call: _Call) -> Response:
    scope_requests(request.scope, call.requests)  # the key's tenant owns the cache namespace
    try:
        if call.stream:
            results = state.results(call.requests)
            first = await until_disconnect(request, anext(results))  # a full queue is still a 503
            return SSEResponse(_events(call, results, first))
        finals = await until_disconnect(request, state.collect(call.requests))
    except RequestFailed as exc:
        raise _grammar_refused(call, exc) from None
    choices = [_choice(call, pos, out) for pos, out in enumerate(finals)]
    return JSONResponse(call.envelope(choices=choices, usage=_usage(call, finals)))


def _grammar_refused(call: _Call, exc: RequestFailed) -> Exception:
    """A constraint the scheduler could not compile (the only refusal of a request, other than a
    full queue, that comes before any output) names the client's field, not our sampling key."""
    if exc.retryable or call.constraint is None:
        return exc
    return _renamed(InvalidRequest(exc.message, param=call.constraint.kind), {call.constraint.kind: call.constraint.source})


# ---------------------------------------------------------------------- parsing


def _parse_completion(state: ServerState, body: dict[str, Any]) -> _Call:
    """Runs in a prepare thread (it tokenizes): reads the state, changes nothing."""
    state.check_model(body.get("model"))
    _reject_unsupported(body)
    if body.get("suffix"):
        raise InvalidRequest("`suffix` is not supported yet", param="suffix")
    segments = body.get("segments")
    prompt = body.get("prompt")
    # with `segments`, a `prompt` too is refused by build_requests (as `text` / `input_ids`)
    text, input_ids = _prompt(prompt) if prompt is not None or segments is None else (None, None)
    top = _opt_int(body, "logprobs", 0, state.limits.max_top_logprobs)
    echo = _opt_bool(body, "echo")
    sampling = _sampling(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    renames = {"max_new_tokens": "max_tokens", "top_logprobs_num": "logprobs", "input_ids": "prompt", "text": "prompt"}
    constraint = body_constraint(body)
    _constrain(sampling, renames, constraint)
    call = _Call(chat=False, id=f"cmpl-{uuid.uuid4().hex}", model=state.model_name, requests=[], constraint=constraint)
    call.requests = _build(
        state, body, call.id, renames, text=text, input_ids=input_ids, sampling=sampling,
        logprobs=top is not None, top=top or 0, start=0 if echo and top is not None else None,
        segments=segments,
    )
    if echo:
        if segments is not None:
            call.echo = ["".join(segments)]
        elif text is None:
            call.echo = [state.tokenizer.decode(r.input_ids) for r in call.requests]
        else:
            call.echo = text if isinstance(text, list) else [text]
    return _finish_parse(call, body, logprobs=top is not None, top=top or 0)


def _parse_chat(state: ServerState, body: dict[str, Any]) -> _Call:
    """Runs in a prepare thread (it renders the template and tokenizes): reads the state,
    changes nothing. The conversation's length is checked before the template is rendered."""
    state.check_model(body.get("model"))
    _reject_unsupported(body)
    add_generation_prompt = _opt_bool(body, "add_generation_prompt", default=True)
    tools = parse_tool_request(body)
    fmt = resolve_format(state.config.tool_call_parser, _template_text(state.tokenizer))
    constraint = _tool_constraint(tools, fmt, body_constraint(body))
    segments = ChatSegments()  # the content parts marked `"segment": true`
    spans: list[tuple[int, int]] = []
    try:
        chat = normalize_messages(body.get("messages"), segments)
        if len(segments.texts) > MAX_SEGMENTS:
            raise InvalidRequest(
                f"`messages` mark {len(segments.texts)} content parts as segments; at most {MAX_SEGMENTS} are allowed",
                param="messages",
            )
        chars = text_chars(chat) + sum(map(len, segments.texts)) + prompt_chars(chat, tools)
        check_prompt_chars(chars, state.limits, state.ready.context_len, "`messages`", "messages")
        if segments.texts:
            ids, spans = render_chat_segments(state.tokenizer, chat, tools, fmt, add_generation_prompt, segments)
        else:
            ids = render_chat(state.tokenizer, chat, tools, fmt, add_generation_prompt)
    except InvalidRequest:
        raise
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="messages") from None
    logprobs = _opt_bool(body, "logprobs")
    top = _opt_int(body, "top_logprobs", 0, state.limits.max_top_logprobs) or 0
    if top and not logprobs:
        raise InvalidRequest("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = state.ready.context_len - len(ids)  # default: whatever fits in the context
    sampling = _sampling(body, max_key, max(1, min(state.limits.max_new_tokens, room)))
    renames = {"max_new_tokens": max_key, "top_logprobs_num": "top_logprobs", "input_ids": "messages", "prompt": "messages"}
    _constrain(sampling, renames, constraint)
    call = _Call(chat=True, id=f"chatcmpl-{uuid.uuid4().hex}", model=state.model_name, requests=[], constraint=constraint)
    if tools is not None and tools.choice != "none":
        call.tool_format, call.tool_names = fmt, tools.names
    call.requests = _build(
        state, body, call.id, renames, input_ids=ids, sampling=sampling, logprobs=logprobs, top=top,
    )
    call.requests[0].segments = spans  # one conversation, one request
    return _finish_parse(call, body, logprobs=logprobs, top=top)


def _template_text(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None if template is None else str(template)


def _tool_constraint(tools: ToolRequest | None, fmt: ToolCallFormat, other: Constraint | None) -> Constraint | None:
    """The one constraint of a chat request: a constrained tool choice's calls, or (tool choice
    auto with a JSON response format) calls or the JSON answer, or the body's own constraint."""
    if tools is None or tools.choice == "none":
        return other
    if tools.constrained:
        if other is not None:
            choice = "a named function" if tools.choice == "named" else '"required"'
            raise InvalidRequest(
                f"`tool_choice` {choice} constrains the output to tool calls; it cannot be combined with `{other.source}`",
                param=other.source,
            )
        return Constraint("structural_tag", structural_tag(tools, fmt), "tools")
    if other is not None and other.answer_schema is not None:
        return Constraint("structural_tag", structural_tag(tools, fmt, other.answer_schema), other.source)
    return other


def _constrain(sampling: dict[str, Any], renames: dict[str, str], constraint: Constraint | None) -> None:
    if constraint is not None:
        sampling[constraint.kind] = constraint.text
        if constraint.source != constraint.kind:
            renames[constraint.kind] = constraint.source


def _finish_parse(call: _Call, body: dict[str, Any], *, logprobs: bool, top: int) -> _Call:
    call.stream = _opt_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("`stream_options` must be an object", param="stream_options")
    call.include_usage = _opt_bool(options or {}, "include_usage", param="stream_options.include_usage")
    call.logprobs, call.top_logprobs = logprobs, top
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise InvalidRequest("`user` must be a string", param="user")
    return call


def _reject_unsupported(body: dict[str, Any]) -> None:
    best_of = body.get("best_of")
    if best_of is not None and best_of != (body.get("n") or 1):
        raise InvalidRequest("`best_of` other than `n` is not supported yet", param="best_of")


def _prompt(prompt: Any) -> tuple[str | list[str] | None, list[int] | list[list[int]] | None]:
    """OpenAI's four prompt shapes -> (text, input_ids) for `build_requests`."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt, None
        if all(type(p) is int for p in prompt):
            return None, prompt
        if all(isinstance(p, list) for p in prompt):
            return None, prompt
    raise InvalidRequest(
        "`prompt` must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        param="prompt",
    )


def _sampling(body: dict[str, Any], max_key: str, default_max: int) -> dict[str, Any]:
    given = body.get(max_key)
    params: dict[str, Any] = {"max_new_tokens": default_max if given is None else given}
    for key, name in _SAMPLING_KEYS.items():
        if body.get(key) is not None:
            params[name] = body[key]
    return params


def _build(
    state: ServerState, body: dict[str, Any], call_id: str, renames: dict[str, str], *,
    sampling: dict[str, Any], logprobs: bool, top: int, start: int | None = None,
    text: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None,
    segments: Any = None,
) -> list[GenerateRequest]:
    try:
        requests, _ = build_requests(
            state.tokenizer, state.ready, state.limits, text=text, input_ids=input_ids,
            sampling_params=sampling, return_logprob=logprobs, logprob_start_len=start,
            top_logprobs_num=top, return_text_in_logprobs=True, cache_salt=body.get("cache_salt"),
            segments=segments, segment_recompute_ratio=body.get("segment_recompute_ratio"),
            default_recompute_ratio=state.config.segment_recompute_ratio,
        )
    except InvalidRequest as exc:
        raise _renamed(exc, renames) from None
    for i, req in enumerate(requests):
        req.rid = f"{call_id}-{i}"
    return requests


def _renamed(exc: InvalidRequest, renames: dict[str, str]) -> InvalidRequest:
    """Speak the client's language: `max_tokens`, not our internal `max_new_tokens`."""
    message, param = exc.message, exc.param
    for ours, theirs in [*renames.items(), ("min_new_tokens", "min_tokens")]:
        # a field's name: in backticks, or an identifier with an underscore; never a word of
        # prose ("the prompt has N tokens" stays so on chat, where `prompt` is `messages`)
        pattern = rf"\b{re.escape(ours)}\b" if "_" in ours else rf"(?<=`){re.escape(ours)}(?=[`\[])"
        message = re.sub(pattern, theirs, message)
        param = theirs if param == ours else param
    return InvalidRequest(message, param=param)


def _opt_bool(body: dict[str, Any], key: str, default: bool = False, param: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if type(value) is not bool:
        raise InvalidRequest(f"`{param or key}` must be a boolean", param=param or key)
    return value


def _opt_int(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        raise InvalidRequest(f"`{key}` must be an integer between {low} and {high}, got {value!r}", param=key)
    return value


# ---------------------------------------------------------------------- shaping


def _finish_reason(meta: dict[str, Any]) -> tuple[str | None, Any]:
    finish = meta["finish_reason"]
    return (None, None) if finish is None else (finish["type"], finish.get("matched"))


def _choice(call: _Call, pos: int, out: dict[str, Any]) -> dict[str, Any]:
    meta = out["meta_info"]
    reason, matched = _finish_reason(meta)
    choice: dict[str, Any] = {"index": pos}
    if call.chat:
        choice["message"] = {"role": "assistant", "content": out["text"]}
        if call.tool_format is not None:
            parsed = parse_tool_calls(call.tool_format, call.tool_names, out["text"])
            if parsed.tool_calls:
                choice["message"] = {
                    "role": "assistant", "content": parsed.content,
                    "tool_calls": [c.to_openai() for c in parsed.tool_calls],
                }
                reason = _tool_finish_reason(reason)
            else:
                choice["message"]["content"] = parsed.content or ""
        entries = meta.get("output_token_logprobs", [])
        tops = meta.get("output_top_logprobs") or [[]] * len(entries)
        choice["logprobs"] = {"content": _chat_logprobs(entries, tops, call.top_logprobs)} if call.logprobs else None
    else:
        prefix = call.echo[pos // call.n] if call.echo is not None else ""
        choice["text"] = prefix + out["text"]
        choice["logprobs"] = None
        if call.logprobs:
            echo_text = None if call.echo is None else prefix
            choice["logprobs"] = _completion_logprobs(call, meta, echo_text=echo_text, offset=0)[0]
    choice.update(finish_reason=reason, matched_stop=matched)
    return choice


def _tool_finish_reason(reason: str | None) -> str | None:
    """A choice that ends with calls: "tool_calls" when it stopped by itself (EOS, a stop
    string, the grammar's end), as OpenAI says; "length" stays, so a client can tell that the
    last call's arguments may be cut short."""
    return "tool_calls" if reason == "stop" else reason


def _usage(call: _Call, finals: list[dict[str, Any]]) -> dict[str, Any]:
    """Each prompt counts once, every sample's output counts; a prompt's cached tokens are the
    fewest any of its samples got (n samples share one prompt computation), and its segment
    and recomputed tokens are that same sample's (the one that computed the prompt)."""
    metas = [out["meta_info"] for out in finals]
    groups = [metas[i : i + call.n] for i in range(0, len(metas), call.n)]
    prompt = sum(g[0]["prompt_tokens"] for g in groups)
    completion = sum(m["completion_tokens"] for m in metas)
    computed = [min(g, key=lambda m: m["cached_tokens"]) for g in groups]
    details = {key: sum(m[key] for m in computed) for key in ("cached_tokens", "segment_tokens", "recomputed_tokens")}
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
    }


def _completion_logprobs(
    call: _Call, meta: dict[str, Any], *, echo_text: str | None, offset: int, skip: int = 0,
) -> tuple[dict[str, Any], int]:
    """The legacy logprobs object of the output tokens from `skip` on, preceded with echo by the
    prompt's; returns it and the text offset after it. Offsets count characters of the choice's
    text (echoed prompt included)."""
    prompt = meta.get("input_token_logprobs", []) if echo_text is not None else []
    prompt_tops = meta.get("input_top_logprobs") or [None] * len(prompt)
    entries = meta.get("output_token_logprobs", [])[skip:]
    tops = (meta.get("output_top_logprobs") or [None] * (len(entries) + skip))[skip:]
    offsets, _ = _text_offsets(prompt, 0)
    output_offsets, end = _text_offsets(entries, offset if echo_text is None else len(echo_text))
    entries, tops = prompt + entries, prompt_tops + tops
    block = {
        "tokens": [text for _, _, text in entries],
        "token_logprobs": [lp for lp, _, _ in entries],
        "top_logprobs": [{t: lp for lp, _, t in top or []} or None for top in tops] if call.top_logprobs else None,
        "text_offset": offsets + output_offsets,
    }
    return block, end


def _text_offsets(entries: list[list[Any]], start: int) -> tuple[list[int], int]:
    offsets = []
    for _, _, text in entries:
        offsets.append(start)
        start += len(text or "")
    return offsets, start


def _chat_logprobs(entries: list[list[Any]], tops: list[Any], k: int) -> list[dict[str, Any]]:
    def token(lp: float, text: str | None) -> dict[str, Any]:
        text = text or ""
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return [
        {**token(lp, text), "top_logprobs": [token(tlp, tt) for tlp, _, tt in (top or [])[:k]]}
        for (lp, _, text), top in zip(entries, tops)
    ]


# ---------------------------------------------------------------------- streaming


@dataclass
class _Sent:
    """How much of one choice has been streamed."""

    chars: int = 0
    tokens: int = 0
    text_offset: int = 0
    started: bool = False


class _StreamShaper:
    """Cumulative results in, OpenAI chunks with deltas out."""

    def __init__(self, call: _Call) -> None:
        self.call = call
        self.sent: dict[int, _Sent] = {}
        self.finals: dict[int, dict[str, Any]] = {}
        self.parsers: dict[int, ToolCallParser] = {}  # chat with tools: one per choice

    def start(self) -> Iterator[dict[str, Any]]:
        if self.call.chat:  # the role first, one chunk per choice, as OpenAI does
            for pos in range(len(self.call.requests) * self.call.n):
                delta = {"role": "assistant", "content": ""}
                yield self._chunk({"index": pos, "delta": delta, "logprobs": None, "finish_reason": None})

    def update(self, pos: int, out: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if self.call.tool_format is not None:
            yield from self._tool_update(pos, out)
            return
        sent = self.sent.setdefault(pos, _Sent())
        meta = out["meta_info"]
        reason, matched = _finish_reason(meta)
        text = out["text"][sent.chars :]
        sent.chars = max(sent.chars, len(out["text"]))
        logprobs = self._logprobs(pos, sent, meta)
        if not sent.started and self.call.echo is not None:
            text = self.call.echo[pos // self.call.n] + text
        sent.started = True
        if reason is not None:
            self.finals[pos] = out
        elif not text and not logprobs:
            return
        choice: dict[str, Any] = {"index": pos}
        if self.call.chat:
            choice["delta"] = {"content": text} if text else {}
            choice["logprobs"] = {"content": logprobs} if logprobs else None
        else:
            choice.update(text=text, logprobs=logprobs)
        choice.update(finish_reason=reason, matched_stop=matched)
        yield self._chunk(choice)

    def _tool_update(self, pos: int, out: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """A chat choice with tools: the parser decides what of the new text is content and what
        belongs to calls (text that may open a call waits until that is known); one chunk per
        run of content or per call's piece, the finish reason on the last."""
        assert self.call.tool_format is not None
        sent = self.sent.setdefault(pos, _Sent())
        parser = self.parsers.get(pos)
        if parser is None:
            parser = self.parsers[pos] = ToolCallParser(self.call.tool_format, self.call.tool_names)
        meta = out["meta_info"]
        reason, matched = _finish_reason(meta)
        sent.chars = max(sent.chars, len(out["text"]))
        deltas = _tool_deltas(parser.feed(out["text"], final=reason is not None))
        logprobs = self._logprobs(pos, sent, meta)
        sent.started = True
        if reason is not None:
            self.finals[pos] = out
            if parser.calls:
                reason = _tool_finish_reason(reason)
            if not deltas or "tool_calls" in deltas[-1]:  # as OpenAI: the reason after a call, alone
                deltas.append({})
        elif not deltas:
            if not logprobs:
                return
            deltas.append({})
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            yield self._chunk({
                "index": pos, "delta": delta,
                "logprobs": {"content": logprobs} if logprobs and i == 0 else None,
                "finish_reason": reason if last else None, "matched_stop": matched if last else None,
            })

    def _logprobs(self, pos: int, sent: _Sent, meta: dict[str, Any]) -> Any:
        """Logprobs of the tokens not streamed yet (and of the prompt first, with echo)."""
        call = self.call
        if not call.logprobs:
            return None
        entries = meta.get("output_token_logprobs", [])
        skip, sent.tokens = sent.tokens, len(entries)
        echo = call.echo is not None and not sent.started
        if len(entries) == skip and not echo:
            return None
        if call.chat:
            tops = meta.get("output_top_logprobs") or [[]] * len(entries)
            return _chat_logprobs(entries[skip:], tops[skip:], call.top_logprobs)
        echo_text = call.echo[pos // call.n] if echo else None  # type: ignore[index]
        block, sent.text_offset = _completion_logprobs(call, meta, echo_text=echo_text, offset=sent.text_offset, skip=skip)
        return block

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self.call.envelope(choices=[choice])
        if self.call.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        finals = [self.finals[pos] for pos in sorted(self.finals)]
        return self.call.envelope(choices=[], usage=_usage(self.call, finals))


def _tool_deltas(events: list[Event]) -> list[dict[str, Any]]:
    """Parser events as OpenAI deltas: content as `content`; a call's first piece with its id,
    type and name (arguments "" or their first fragment), later ones with arguments only."""
    deltas: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, ContentDelta):
            deltas.append({"content": e.text})
        elif isinstance(e, CallStarted):
            entry = {"index": e.index, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
            deltas.append({"tool_calls": [entry]})
        else:
            assert isinstance(e, ArgumentsDelta)
            last = deltas[-1]["tool_calls"][0] if deltas and "tool_calls" in deltas[-1] else None
            if last is not None and last["index"] == e.index and "id" in last and not last["function"]["arguments"]:
                last["function"]["arguments"] = e.text  # the first fragment rides with the name
            else:
                deltas.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return deltas


async def _events(
    call: _Call, results: AsyncIterator[tuple[int, dict[str, Any]]], first: tuple[int, dict[str, Any]],
) -> AsyncIterator[bytes]:
    shaper = _StreamShaper(call)
    async with aclosing(results):
        try:
            for chunk in shaper.start():
                yield sse(chunk)
            for chunk in shaper.update(*first):
                yield sse(chunk)
            async for pos, out in results:
                for chunk in shaper.update(pos, out):
                    yield sse(chunk)
            if call.include_usage:
                yield sse(shaper.usage_chunk())
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            yield sse(to_http_error(exc).body())
    yield SSE_DONE

