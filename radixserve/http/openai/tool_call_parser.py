"""The text formats models write tool calls in, and reading the calls back out of generated text.

Two formats, named by `--tool-call-parser`:

- ``hermes`` (Hermes, Qwen 2.5/3; ``qwen`` is an alias): each call is
  ``<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>``; there may be several.
- ``llama3`` (Llama 3.1/3.2 JSON tool calling): an optional ``<|python_tag|>``, then objects
  ``{"name": "NAME", "parameters": {...}}`` (``"arguments"`` is read too), separated by ``;`` or
  whitespace.

`ToolCallParser` reads a sample's text as it grows (streaming) or once (not streaming); both go
through the same state machine, so a streamed answer adds up to exactly the non-streamed one,
wherever the token boundaries fall. Its rules:

- A call counts from the moment its opening is complete: the marker (hermes), ``{``, the name of
  a tool of the request, then the arguments key. From then on it is a call (streamed as one);
  the arguments' JSON text is streamed as the model writes it, up to where the value ends.
- Anything else stays content: a ``<tool_call>`` followed by something that is not a call, an
  object naming an unknown tool, a hermes block whose JSON does not parse. Text that may still
  become the start of a call (``<tool_ca`` at the end) is held back until decided, and at the end
  of generation it is content.
- Whitespace next to a call (the newline before ``<tool_call>``, the ``;`` and newlines between
  llama calls) is dropped, so a message that is only calls has no content.
- A hermes call written with its keys in another order (arguments before name) is recognized
  once its closing ``</tool_call>`` arrives, and its arguments are re-serialized JSON.

The arguments string is the model's own JSON text of the value (whitespace and key order as
written), which is what makes the streamed fragments and the final string agree.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

_WS = " \t\r\n"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family of models writes a tool call."""

    name: str
    structural_tag_model: str  # xgrammar's builtin structural tag that emits exactly this format
    open: str  # the marker before a call's object ("" when the object itself opens the call)
    close: str  # the marker after it
    args_keys: tuple[str, ...]  # the object's key holding the arguments
    preamble: str = ""  # a marker dropped before calls (llama's <|python_tag|>)

    def render_call(self, name: str, arguments: str) -> str:
        """A call as this format writes it (for assistant turns in a conversation's history)."""
        body = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.args_keys[0]}": {arguments}}}'
        return f"{self.open}\n{body}\n{self.close}" if self.open else body


HERMES = ToolCallFormat(
    name="hermes", structural_tag_model="qwen_3", open="<tool_call>", close="</tool_call>",
    args_keys=("arguments",),
)
LLAMA3 = ToolCallFormat(
    name="llama3", structural_tag_model="llama", open="", close="", args_keys=("parameters", "arguments"),
    preamble="<|python_tag|>",
)
FORMATS = {"hermes": HERMES, "qwen": HERMES, "llama3": LLAMA3}


@lru_cache(maxsize=8)
def resolve_format(option: str, chat_template: str | None) -> ToolCallFormat:
    """The format of `--tool-call-parser`; `auto` reads the chat template: Llama 3's templates
    speak of ``<|python_tag|>`` and the ``ipython`` role, every other one gets hermes (also the
    format radixserve renders tools in for templates that know no tools)."""
    if option != "auto":
        return FORMATS[option]
    template = chat_template or ""
    return LLAMA3 if "<|python_tag|>" in template or "ipython" in template else HERMES


def new_call_id() -> str:
    """OpenAI-style call ids; random, so a conversation's history never repeats one."""
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------- events


@dataclass
class ContentDelta:
    text: str


@dataclass
class CallStarted:
    index: int
    id: str
    name: str


@dataclass
class ArgumentsDelta:
    index: int
    text: str


Event = ContentDelta | CallStarted | ArgumentsDelta


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    """An assistant message read out of a sample's text: content null when it has none."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def parse_tool_calls(fmt: ToolCallFormat, tool_names: set[str] | frozenset[str], text: str) -> ParsedMessage:
    """The message of a finished sample (the non-streaming answer)."""
    parser = ToolCallParser(fmt, tool_names)
    content = "".join(e.text for e in parser.feed(text, final=True) if isinstance(e, ContentDelta))
    return ParsedMessage(content or None, parser.calls)


# ---------------------------------------------------------------------- scanning helpers

_PARTIAL = "partial"  # the text ends before the answer is known
_FAIL = "fail"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _end_before_ws(text: str, lo: int, hi: int) -> int:
    """The end of text[lo:hi] without its trailing whitespace (without copying it)."""
    while hi > lo and text[hi - 1] in _WS:
        hi -= 1
    return hi


def _literal(text: str, i: int, lit: str) -> int | str:
    """Index after `lit` at i, `_PARTIAL` when the text ends inside it, else `_FAIL`."""
    tail = text[i : i + len(lit)]
    if tail == lit:
        return i + len(lit)
    return _PARTIAL if lit.startswith(tail) else _FAIL


def _json_string(text: str, i: int) -> tuple[str, int] | str:
    """A JSON string starting at i (its opening quote): (value, index after it)."""
    if i >= len(text):
        return _PARTIAL
    if text[i] != '"':
        return _FAIL
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            try:
                return json.loads(text[i : j + 1]), j + 1
            except ValueError:
                return _FAIL
        if c < " ":  # a raw control character: not JSON
            return _FAIL
        j += 1
    return _PARTIAL


@dataclass
class _ValueScanner:
    """Finds where one JSON value ends in text that grows, resuming where it stopped. It matches
    brackets and strings only; it does not validate (the grammar does, when there is one)."""

    start: int  # index of the value's first character
    pos: int = 0
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    kind: str = ""  # "container", "string" or "scalar" once the first character is seen

    def end(self, text: str) -> int | None:
        """Index just after the value, or None while it is incomplete."""
        if not self.kind:  # whitespace before the value is not part of it
            self.start = _skip_ws(text, self.start)
            self.pos = self.start
        i = self.pos
        if not self.kind:
            if i >= len(text):
                return None
            c = text[i]
            self.kind = "container" if c in "{[" else "string" if c == '"' else "scalar"
            if self.kind == "container":
                self.depth = 1
            elif self.kind == "string":
                self.in_string = True
            i += 1
        while i < len(text):
            c = text[i]
            if self.kind == "scalar":
                if c in _WS or c in ",}];":
                    self.pos = i
                    return i
                i += 1
                continue
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.kind == "string":
                        self.pos = i + 1
                        return i + 1
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
            i += 1
        self.pos = i
        return None


# ---------------------------------------------------------------------- the parser

_CONTENT, _ARGS, _TAIL = "content", "args", "tail"


@dataclass
class _Opening:
    """A call's opening, complete: where it ends, and (a hermes block read whole) the call's
    arguments already. No name: llama's preamble, which opens no call of its own."""

    end: int
    name: str | None = None
    arguments: str | None = None


class ToolCallParser:
    """One sample's text in (cumulative, as the front builds it), content and call deltas out.

    `feed(text)` takes the whole text so far (it only ever grows) and returns what can be decided
    now; `feed(text, final=True)` at the end of generation decides the rest. `calls` holds the
    calls found so far, their arguments as streamed."""

    def __init__(self, fmt: ToolCallFormat, tool_names: set[str] | frozenset[str]) -> None:
        self.fmt = fmt
        self.tool_names = frozenset(tool_names)
        self.calls: list[ToolCall] = []
        self._text = ""
        self._pos = 0  # everything before is decided
        self._mode = _CONTENT
        self._after_call = False  # drop whitespace (and llama's `;`) that follows a call
        self._scanner: _ValueScanner | None = None
        self._args_sent = 0  # index up to which the current call's arguments are streamed

    def feed(self, text: str, final: bool = False) -> list[Event]:
        if len(text) < len(self._text):
            raise ValueError("the text of a sample only grows")
        self._text = text
        events: list[Event] = []
        while True:
            before = (self._pos, self._mode)
            if self._mode == _CONTENT:
                self._content(events, final)
            elif self._mode == _ARGS:
                self._arguments(events, final)
            else:
                self._tail(final)
            if (self._pos, self._mode) == before:
                break
        return _merged(events)

    # -- content

    def _content(self, events: list[Event], final: bool) -> None:
        text, i = self._text, self._pos
        if self._after_call:
            j = _skip_ws(text, i)
            while self.fmt is LLAMA3 and j < len(text) and text[j] == ";":
                j = _skip_ws(text, j + 1)
            if j == len(text) and not final:
                self._pos = j  # only whitespace so far: still dropped if a call follows
                return
            self._pos = i = j
            self._after_call = False
        k = i
        while True:
            k = self._next_candidate(k)
            if k is None:
                # no call can start in the rest: content, but trailing whitespace waits (it is
                # dropped if a call follows, and at the end if the message has calls)
                keep_ws = final and not self.calls
                self._emit_content(events, i, len(text) if keep_ws else _end_before_ws(text, i, len(text)))
                return
            found = self._call_at(k)
            if found == _FAIL:
                k += 1
                continue
            # content up to the candidate, less the whitespace before it (dropped if a call
            # opens there)
            self._emit_content(events, i, _end_before_ws(text, i, k))
            if found == _PARTIAL:
                if final:  # never completed: content after all
                    self._emit_content(events, self._pos, len(text))
                return
            assert isinstance(found, _Opening)
            self._start_call(events, found)
            return

    def _emit_content(self, events: list[Event], start: int, end: int) -> None:
        start = max(start, self._pos)
        if end > start:
            events.append(ContentDelta(self._text[start:end]))
            self._pos = end

    def _next_candidate(self, k: int) -> int | None:
        """The next index from k where a call (or its marker) could begin."""
        text = self._text
        if self.fmt.open:
            starts = [text.find(self.fmt.open[0], k)]
        else:
            starts = [text.find("{", k), text.find(self.fmt.preamble[0], k)]
        starts = [s for s in starts if s >= 0]
        return min(starts) if starts else None

    def _call_at(self, k: int) -> _Opening | str:
        """Whether a call opens at k: its `_Opening`, `_PARTIAL` (cannot tell yet) or `_FAIL`.
        llama's preamble counts as an opening without a call (it is dropped)."""
        text, fmt = self._text, self.fmt
        if fmt.preamble and text.startswith(fmt.preamble[0], k):
            at = _literal(text, k, fmt.preamble)
            if isinstance(at, int):
                return _Opening(end=at)
            if at == _PARTIAL:
                return _PARTIAL
            if text[k] != "{":
                return _FAIL
        i = k
        if fmt.open:
            at = _literal(text, k, fmt.open)
            if not isinstance(at, int):
                return at
            i = _skip_ws(text, at)
        head = self._header(i)
        if head == _FAIL and fmt.open:
            return self._whole_block(at)
        return head

    def _header(self, i: int) -> _Opening | str:
        """`{`, the name of a known tool and the arguments key, in that order (a `"type"` key may
        come first, as some Llama models write it)."""
        text = self._text
        if i >= len(text):
            return _PARTIAL
        if text[i] != "{":
            return _FAIL
        i += 1
        name = None
        while True:
            i = _skip_ws(text, i)
            key = _json_string(text, i)
            if isinstance(key, str):
                return key
            key, i = key
            i = _skip_ws(text, i)
            at = _literal(text, i, ":")
            if not isinstance(at, int):
                return at
            i = _skip_ws(text, at)
            if key == "name" and name is None:
                value = _json_string(text, i)
                if isinstance(value, str):
                    return value
                name, i = value
                if name not in self.tool_names:
                    return _FAIL
            elif key in self.fmt.args_keys and name is not None:
                return _Opening(end=i, name=name)
            elif key == "type" and name is None:
                end = _ValueScanner(i).end(text)
                if end is None:
                    return _PARTIAL
                i = end
            else:
                return _FAIL
            i = _skip_ws(text, i)
            at = _literal(text, i, ",")
            if not isinstance(at, int):
                return at
            i = at

    def _whole_block(self, body_start: int) -> _Opening | str:
        """A hermes block whose object does not begin with name then arguments: a call if the
        JSON between the markers is one, decided once the closing marker is there. A block that
        is not a call (its name not a string, its JSON nested deeper than Python's parser goes)
        is content."""
        close = self._text.find(self.fmt.close, body_start)
        if close < 0:
            return _PARTIAL
        try:
            obj = json.loads(self._text[body_start:close])
        except (ValueError, RecursionError):
            return _FAIL
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or name not in self.tool_names:
            return _FAIL
        args_key = next((key for key in self.fmt.args_keys if key in obj), None)
        if args_key is None:
            return _FAIL
        args = obj[args_key]
        try:
            arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        except RecursionError:
            return _FAIL
        return _Opening(end=close + len(self.fmt.close), name=name, arguments=arguments)

    def _start_call(self, events: list[Event], opening: _Opening) -> None:
        if opening.name is None:  # llama's preamble: dropped, and whitespace after it too
            self._pos, self._after_call = opening.end, True
            return
        call = ToolCall(new_call_id(), opening.name)
        self.calls.append(call)
        events.append(CallStarted(len(self.calls) - 1, call.id, call.name))
        if opening.arguments is not None:  # a whole block, already read
            call.arguments = opening.arguments
            if opening.arguments:
                events.append(ArgumentsDelta(len(self.calls) - 1, opening.arguments))
            self._pos, self._after_call = opening.end, True
            return
        self._pos = self._args_sent = opening.end
        self._scanner = _ValueScanner(opening.end)
        self._mode = _ARGS

    # -- inside a call

    def _arguments(self, events: list[Event], final: bool) -> None:
        assert self._scanner is not None
        end = self._scanner.end(self._text)
        self._args_sent = max(self._args_sent, self._scanner.start)
        upto = len(self._text) if end is None else end
        if upto > self._args_sent:
            fragment = self._text[self._args_sent : upto]
            self.calls[-1].arguments += fragment
            events.append(ArgumentsDelta(len(self.calls) - 1, fragment))
            self._args_sent = upto
        self._pos = upto
        if end is not None:
            self._mode = _TAIL
        elif final:  # cut off inside the arguments: the call keeps what was written
            self._pos = len(self._text)

    def _tail(self, final: bool) -> None:
        """After the arguments: the object's `}` (hermes: and `</tool_call>`, tolerating doubled
        or missing braces). Anything else goes back to being content; at the end of generation a
        tail cut short (say, a missing `</tool_call>`) still closes the call."""
        text, i = self._text, self._pos
        if self.fmt.close:
            while i < len(text) and (text[i] in _WS or text[i] == "}"):
                i += 1
            at = _literal(text, i, self.fmt.close)
        else:
            at = _literal(text, _skip_ws(text, i), "}")
        if at == _PARTIAL:
            if not final:
                return
            at = len(text)
        self._mode = _CONTENT
        self._scanner = None
        if isinstance(at, int):
            self._pos, self._after_call = at, True


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent deltas of the same kind (and call) as one."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, ContentDelta) and isinstance(last, ContentDelta):
            last.text += e.text
        elif isinstance(e, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == e.index:
            last.text += e.text
        else:
            out.append(e)
    return out
