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
  become the start of a call (``<tool_ca`` at the end) is held back until decided, for at most
  `LOOKAHEAD_CHARS` (1,024) characters from where the call would start; past that, or at the end
  of generation, it is content. An opening is decided as soon as it can: an object whose name
  is a prefix of no tool's (llama) is content at once.
- Whitespace next to a call (the newline before ``<tool_call>``, the ``;`` and newlines between
  llama calls) is dropped, so a message that is only calls has no content.
- A hermes call written with its keys in another order (arguments before name) is recognized
  once its closing ``</tool_call>`` arrives within the look-ahead, and its arguments are
  re-serialized JSON.
- The work is linear in the text however it is cut into feeds: an opening's scan is a generator
  resumed where the last feed ran out, and whitespace held back is not scanned twice.

The arguments string is the model's own JSON text of the value (whitespace and key order as
written), which is what makes the streamed fragments and the final string agree.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Generator
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
# Text that may still open a call is held back for at most this many characters from where the
# call would start (its marker, or llama's `{`): an opening not decided by then (a `"type"` value
# that never ends, a hermes block with arguments before name that does not close) is content.
# An opening written as models write it (marker, name, arguments key) takes under 150.
LOOKAHEAD_CHARS = 1024


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

    def end(self, text: str, stop: int | None = None) -> int | None:
        """Index just after the value, or None while it is incomplete (in text[:stop])."""
        stop = len(text) if stop is None else stop
        if not self.kind:  # whitespace before the value is not part of it
            while self.start < stop and text[self.start] in _WS:
                self.start += 1
            self.pos = self.start
        i = self.pos
        if not self.kind:
            if i >= stop:
                return None
            c = text[i]
            self.kind = "container" if c in "{[" else "string" if c == '"' else "scalar"
            if self.kind == "container":
                self.depth = 1
            elif self.kind == "string":
                self.in_string = True
            i += 1
        while i < stop:
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


# A scan of one possible opening: a generator that yields while it needs text beyond the
# parser's `_stop`, and returns an `_Opening` or `_FAIL`.
_Scan = Generator[None, None, "_Opening | str"]


@dataclass
class _Candidate:
    """Where a call may open, and its scan, kept across feeds: each feed resumes it where the
    text ran out, so text held back is read once, not once per token."""

    at: int
    scan: _Scan
    content_end: int  # the content before it ends here (its whitespace waits with it)
    result: _Opening | str | None = None


class ToolCallParser:
    """One sample's text in (cumulative, as the front builds it), content and call deltas out.

    `feed(text)` takes the whole text so far (it only ever grows) and returns what can be decided
    now; `feed(text, final=True)` at the end of generation decides the rest. `calls` holds the
    calls found so far, their arguments as streamed. Each character is scanned a bounded number
    of times however the text is cut into feeds: the scanners keep their state between feeds."""

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
        self._candidate: _Candidate | None = None  # the opening being decided
        self._stop = 0  # how far the candidate's scan may read: its look-ahead, or the text's end
        self._ws_until = 0  # text[_pos:_ws_until] is known whitespace (held back content)
        self._tail_at = 0  # how far a call's tail has been skipped

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
                self._emit_content(events, i, len(text) if keep_ws else self._end_of_content(i))
                return
            found = self._call_at(k, i)
            if found == _FAIL:
                k += 1
                continue
            # content up to the candidate, less the whitespace before it (dropped if a call
            # opens there)
            assert self._candidate is not None
            self._emit_content(events, i, self._candidate.content_end)
            if found == _PARTIAL:
                if final:  # never completed: content after all
                    self._emit_content(events, self._pos, len(text))
                return
            assert isinstance(found, _Opening)
            self._start_call(events, found)
            return

    def _end_of_content(self, i: int) -> int:
        """The end of text[i:] less its trailing whitespace. Whitespace already found at the end
        of the text (held back, since a call may follow) is not scanned again."""
        text = self._text
        lo = max(i, self._ws_until)
        end = _end_before_ws(text, lo, len(text))
        self._ws_until = len(text)
        return i if end == lo else end

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

    def _call_at(self, k: int, content_from: int) -> _Opening | str:
        """Whether a call opens at k: its `_Opening`, `_PARTIAL` (cannot tell yet) or `_FAIL`.
        The scan of k resumes where the last feed left it; one still undecided once the text
        reaches `LOOKAHEAD_CHARS` past k fails (what it read is content). It reads nothing past
        that, so the answer does not depend on how the text was cut into feeds."""
        cand = self._candidate
        if cand is None or cand.at != k:
            end = _end_before_ws(self._text, content_from, k)
            cand = self._candidate = _Candidate(k, self._scan_call(k), end)
        if cand.result is None:
            self._stop = min(len(self._text), k + LOOKAHEAD_CHARS)
            try:
                next(cand.scan)
            except StopIteration as done:
                cand.result = done.value
            else:
                if self._stop < k + LOOKAHEAD_CHARS:
                    return _PARTIAL
                cand.result = _FAIL
        return cand.result

    # -- scanning an opening (generators: `yield` waits for more text)

    def _wait(self, i: int) -> Generator[None, None, None]:
        """Returns once text[i] may be read."""
        while i >= self._stop:
            yield

    def _scan_ws(self, i: int) -> Generator[None, None, int]:
        while True:
            yield from self._wait(i)
            if self._text[i] not in _WS:
                return i
            i += 1

    def _scan_literal(self, i: int, lit: str) -> Generator[None, None, int | str]:
        for n, c in enumerate(lit):
            yield from self._wait(i + n)
            if self._text[i + n] != c:
                return _FAIL
        return i + len(lit)

    def _scan_string(self, i: int, names: frozenset[str] | None = None) -> Generator[None, None, tuple[str, int] | str]:
        """A JSON string at i: (value, index after it). With `names`, fail as soon as the string
        cannot be one of them (no escapes: a prefix of none of them)."""
        yield from self._wait(i)
        if self._text[i] != '"':
            return _FAIL
        j, escaped = i + 1, False
        while True:
            yield from self._wait(j)
            c = self._text[j]
            if c == "\\":
                escaped = True
                j += 2
                continue
            if c == '"':
                try:
                    return json.loads(self._text[i : j + 1]), j + 1
                except ValueError:
                    return _FAIL
            if c < " ":  # a raw control character: not JSON
                return _FAIL
            j += 1
            if names is not None and not escaped:
                so_far = self._text[i + 1 : j]
                if not any(n.startswith(so_far) for n in names):
                    return _FAIL

    def _scan_call(self, k: int) -> _Scan:
        """llama's preamble (an opening without a call: it is dropped), or the marker (hermes)
        then the header, or (hermes) a whole block whose keys come in another order."""
        fmt = self.fmt
        if fmt.preamble and self._text.startswith(fmt.preamble[0], k):
            at = yield from self._scan_literal(k, fmt.preamble)
            if isinstance(at, int):
                return _Opening(end=at)
            if self._text[k] != "{":
                return _FAIL
        i = k
        if fmt.open:
            at = yield from self._scan_literal(k, fmt.open)
            if not isinstance(at, int):
                return at
            i = yield from self._scan_ws(at)
        head = yield from self._scan_header(i)
        if head == _FAIL and fmt.open:
            return (yield from self._scan_block(at))
        return head

    def _scan_header(self, i: int) -> _Scan:
        """`{`, the name of a known tool and the arguments key, in that order (a `"type"` key may
        come first, as some Llama models write it)."""
        yield from self._wait(i)
        if self._text[i] != "{":
            return _FAIL
        i += 1
        name = None
        while True:
            i = yield from self._scan_ws(i)
            key = yield from self._scan_string(i)
            if isinstance(key, str):
                return key
            key, i = key
            i = yield from self._scan_ws(i)
            at = yield from self._scan_literal(i, ":")
            if not isinstance(at, int):
                return at
            i = yield from self._scan_ws(at)
            if key == "name" and name is None:
                value = yield from self._scan_string(i, self.tool_names)
                if isinstance(value, str):
                    return value
                name, i = value
                if name not in self.tool_names:
                    return _FAIL
            elif key in self.fmt.args_keys and name is not None:
                return _Opening(end=i, name=name)
            elif key == "type" and name is None:
                scanner = _ValueScanner(i)
                while (end := scanner.end(self._text, self._stop)) is None:
                    yield
                i = end
            else:
                return _FAIL
            i = yield from self._scan_ws(i)
            at = yield from self._scan_literal(i, ",")
            if not isinstance(at, int):
                return at
            i = at

    def _scan_block(self, body_start: int) -> _Scan:
        """A hermes block whose object does not begin with name then arguments: a call if the
        JSON between the markers is one, decided once the closing marker is there. A block that
        is not a call (its name not a string, its JSON nested deeper than Python's parser goes)
        is content."""
        close_marker, j = self.fmt.close, body_start
        while (close := self._text.find(close_marker, j, self._stop)) < 0:
            j = max(j, self._stop - len(close_marker) + 1)
            yield
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
        return _Opening(end=close + len(close_marker), name=name, arguments=arguments)

    def _start_call(self, events: list[Event], opening: _Opening) -> None:
        self._candidate = None
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
            self._mode, self._tail_at = _TAIL, end
        elif final:  # cut off inside the arguments: the call keeps what was written
            self._pos = len(self._text)

    def _tail(self, final: bool) -> None:
        """After the arguments: the object's `}` (hermes: and `</tool_call>`, tolerating doubled
        or missing braces). Anything else goes back to being content; at the end of generation a
        tail cut short (say, a missing `</tool_call>`) still closes the call."""
        text, i = self._text, self._tail_at
        skip = _WS + "}" if self.fmt.close else _WS
        while i < len(text) and text[i] in skip:
            i += 1
        self._tail_at = i  # what was skipped is not read again on the next feed
        at = _literal(text, i, self.fmt.close or "}")
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
