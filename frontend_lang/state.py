"""`ProgramState`: the running prompt of a program, and the interpreter of what is added to it.

Every state runs its operations in order on a background thread, so `s += fl.gen(...)` returns
at once and reading (`s["name"]`, `s.text()`) waits for what came before. That is what makes
forks concurrent:

    forks = s.fork(3)                 # waits for s, sends s's text once (it becomes cached)
    for f in forks:
        f += fl.gen("idea")           # three calls in flight together, all hitting s's prefix
    ideas = forks["idea"]             # waits for the three

Prefix sharing is by construction: a state's text only grows, so each call's prompt extends the
previous call's, and the runtime's radix cache finds it. Every call's `cached_tokens` is
recorded, so `cache_stats()` measures the sharing instead of assuming it. Text added with
`fl.segment` is shared wherever it sits: a state that has some sends its prompt as segments.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

from frontend_lang.primitives import Gen, Op, RoleBegin, RoleEnd, Segment, Select, SetVar, flatten

if TYPE_CHECKING:
    from frontend_lang.backends.base import Backend


@dataclass(frozen=True)
class CallRecord:
    """One call to the runtime, as its meta_info reported it."""

    kind: str  # "gen", "select" (scoring) or "fork" (sending the shared prefix)
    name: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class CacheStats:
    """Token counts over a program's calls; add them up over a batch with `sum(..., CacheStats())`."""

    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over all prompt tokens (0 when there were none)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def __add__(self, other: CacheStats) -> CacheStats:
        return CacheStats(
            self.calls + other.calls, self.prompt_tokens + other.prompt_tokens,
            self.cached_tokens + other.cached_tokens, self.completion_tokens + other.completion_tokens,
        )

    def __str__(self) -> str:
        return (
            f"{self.calls} call{'' if self.calls == 1 else 's'}: {self.prompt_tokens:,} prompt tokens, {self.cached_tokens:,} cached "
            f"({self.hit_rate:.1%}), {self.completion_tokens:,} generated"
        )

    @classmethod
    def of(cls, records: Sequence[CallRecord]) -> CacheStats:
        return cls(
            len(records), sum(r.prompt_tokens for r in records),
            sum(r.cached_tokens for r in records), sum(r.completion_tokens for r in records),
        )


class _Serial:
    """Runs submitted callables one at a time, in order, on a background thread that lives while
    there is work. After a failure the rest are skipped; `wait` raises the failure."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._todo: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self.error: BaseException | None = None

    def submit(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._todo.append(fn)
            if not self._busy:
                self._busy = True
                threading.Thread(target=self._drain, name=self._name, daemon=True).start()

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._todo:
                    self._busy = False
                    self._cond.notify_all()
                    return
                fn = self._todo.popleft()
            if self.error is None:
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the state
                    self.error = exc

    def wait(self, raise_error: bool = True) -> None:
        with self._cond:
            while self._busy:
                self._cond.wait()
        if raise_error and self.error is not None:
            raise self.error


class Run:
    """What the states of one program run share: backend, defaults, the call log, and whether the
    program has finished (and how)."""

    def __init__(self, backend: Backend, default_sampling: dict[str, Any], stream: bool) -> None:
        self.backend = backend
        self.default_sampling = default_sampling
        self.stream = stream
        self.cond = threading.Condition()  # guards texts, pieces, the call log, done
        self.calls: list[CallRecord] = []
        self.states: list[ProgramState] = []
        self.done = False
        self.error: BaseException | None = None
        self.program_thread: int | None = None

    def record(self, kind: str, name: str | None, meta: dict[str, Any]) -> None:
        record = CallRecord(
            kind=kind, name=name, prompt_tokens=meta.get("prompt_tokens", 0),
            cached_tokens=meta.get("cached_tokens", 0), completion_tokens=meta.get("completion_tokens", 0),
        )
        with self.cond:
            self.calls.append(record)

    def wait_all(self, raise_error: bool = True) -> None:
        """Wait for every state's operations (forks included); raise the first failure."""
        for state in list(self.states):
            state._serial.wait(raise_error)

    def finish(self, error: BaseException | None = None) -> None:
        with self.cond:
            self.error = self.error or error
            self.done = True
            self.cond.notify_all()


class ProgramState:
    """The state `s` a program writes to. Created by `Program.run`, or by `fork`."""

    def __init__(self, run: Run, parent: ProgramState | None = None) -> None:
        self._run = run
        self._serial = _Serial(f"frontend_lang-state-{len(run.states)}")
        self._text = parent._text if parent else ""
        # the `fl.segment` texts' character ranges [start, end) in _text, in order
        self._segments: list[tuple[int, int]] = list(parent._segments) if parent else []
        self._vars: dict[str, Any] = dict(parent._vars) if parent else {}
        self._meta: dict[str, Any] = dict(parent._meta) if parent else {}
        self._messages: list[dict[str, str]] = [dict(m) for m in parent._messages] if parent else []
        self._role: tuple[str, int] | None = parent._role if parent else None  # open block, content start
        self._pieces: list[tuple[str | None, str]] = []  # what was appended, by variable (for text_iter)
        self._finished: set[str] = set()
        self.forks: list[ForkGroup] = []
        self.return_value: Any = None
        with run.cond:
            run.states.append(self)

    # ------------------------------------------------------------------ writing

    def __iadd__(self, item: Any) -> ProgramState:
        for op in flatten(item):
            self._submit(op)
        return self

    def __setitem__(self, name: str, value: Any) -> None:
        self._submit(SetVar(name, value))

    @contextmanager
    def _role_block(self, role: str) -> Iterator[ProgramState]:
        self._submit(RoleBegin(role))
        yield self
        self._submit(RoleEnd(role))

    def system(self) -> AbstractContextManager[ProgramState]:
        """`with s.system(): s += ...`: everything added inside is one system block."""
        return self._role_block("system")

    def user(self) -> AbstractContextManager[ProgramState]:
        """`with s.user(): s += ...`: everything added inside is one user block."""
        return self._role_block("user")

    def assistant(self) -> AbstractContextManager[ProgramState]:
        """`with s.assistant(): s += fl.gen(...)`: everything added inside is one assistant block."""
        return self._role_block("assistant")

    def fork(self, k: int) -> ForkGroup:
        """k branches starting from this state's text. Waits for this state, then (k > 1) sends
        its text once so the branches' first calls all find it cached. Branches run concurrently;
        `s.forks` keeps every group, so results stay readable from the parent."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"fork needs a positive number of branches, got {k!r}")
        self._serial.wait()
        if k > 1 and self._text:
            out = self._run.backend.generate({**self._prompt(), "sampling_params": {"max_new_tokens": 0}})
            self._run.record("fork", None, out["meta_info"])
        group = ForkGroup([ProgramState(self._run, parent=self) for _ in range(k)])
        self.forks.append(group)
        return group

    # ------------------------------------------------------------------ reading

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self._vars:
            known = ", ".join(map(repr, self._vars)) or "none yet"
            raise KeyError(f"no variable {name!r} in this state (it has: {known})")
        return self._vars[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._vars

    def get(self, name: str, default: Any = None) -> Any:
        self.sync()
        return self._vars.get(name, default)

    def text(self) -> str:
        """The whole prompt so far, role blocks rendered."""
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        """The role blocks so far as chat messages (`{"role", "content"}`)."""
        self.sync()
        return [dict(m) for m in self._messages]

    def meta_info(self, name: str) -> Any:
        """For a gen: the runtime's meta_info (a list for n > 1). For a select: `{"choice",
        "normalize", "scores"}`, with a `ChoiceScore` (sum, tokens, normalized) per choice."""
        self.sync()
        if name not in self._meta:
            raise KeyError(f"no gen or select named {name!r} in this state")
        return self._meta[name]

    def calls(self) -> list[CallRecord]:
        """Every call of this program run so far (forks included), in completion order."""
        self._wait_for_program()
        self._run.wait_all(raise_error=False)
        with self._run.cond:
            return list(self._run.calls)

    def cache_stats(self) -> CacheStats:
        """Prompt, cached and generated tokens over every call of this program run."""
        return CacheStats.of(self.calls())

    @property
    def error(self) -> BaseException | None:
        """Why the run failed (None while it runs or when it succeeded); reading a failed run's
        state raises it."""
        return self._run.error

    def sync(self) -> None:
        """Wait for this state's operations; raise their failure. Outside a program that was
        started with `stream=True`, wait for the whole program first."""
        self._wait_for_program()
        self._serial.wait()
        if self._run.error is not None:
            raise self._run.error

    def _wait_for_program(self) -> None:
        """Outside the program's own thread, a streamed program is read once it has finished."""
        run = self._run
        if run.stream and threading.get_ident() != run.program_thread:
            with run.cond:
                while not run.done:
                    run.cond.wait()

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """Text as it is appended: all of it, or (with `name`) the pieces of the gen stored under
        `name`, ending when that gen finishes. With `run(stream=True)` the pieces come as the
        runtime streams them."""
        run, pos = self._run, 0
        while True:
            with run.cond:
                while pos == len(self._pieces) and not self._iter_done(name):
                    run.cond.wait()
                new, pos = self._pieces[pos:], len(self._pieces)
                done = self._iter_done(name) and pos == len(self._pieces)
            for var, piece in new:
                if name is None or var == name:
                    yield piece
            if done:
                break
        if run.error is not None:
            raise run.error
        if name is not None and name not in self._finished:
            raise KeyError(f"the program finished without generating {name!r}")

    def _iter_done(self, name: str | None) -> bool:
        return self._run.done or self._run.error is not None or (name is not None and name in self._finished)

    def __repr__(self) -> str:
        with self._run.cond:
            text = self._text
        return f"ProgramState(vars={list(self._vars)}, text={text[-60:]!r})"

    # ------------------------------------------------------------------ executing

    def _submit(self, op: Op) -> None:
        self._serial.submit(lambda: self._execute(op))

    def _execute(self, op: Op) -> None:
        if isinstance(op, str):
            self._append(op)
        elif isinstance(op, Segment):
            start = len(self._text)
            self._append(op.text)
            self._segments.append((start, len(self._text)))
        elif isinstance(op, Gen):
            self._gen(op)
        elif isinstance(op, Select):
            self._select(op)
        elif isinstance(op, RoleBegin):
            self._begin_role(op.role)
        elif isinstance(op, RoleEnd):
            self._end_role(op.role)
        elif isinstance(op, SetVar):
            self._vars[op.name] = op.value
        else:  # pragma: no cover - flatten lets nothing else through
            raise TypeError(f"unknown operation {op!r}")

    def _append(self, text: str, var: str | None = None) -> None:
        with self._run.cond:
            self._text += text
            self._pieces.append((var, text))
            self._run.cond.notify_all()

    def _store(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        with self._run.cond:
            self._vars[name], self._meta[name] = value, meta
            self._finished.add(name)
            self._run.cond.notify_all()

    def _prompt(self) -> dict[str, Any]:
        """The prompt's fields of a /generate call: `text`, or with `fl.segment` texts in it,
        `segments` (the ordinary stretches and the segment texts in order) with `segment_reuse`
        marking the segment texts, the only pieces the runtime may reuse. The last piece is
        computed in context whatever it is (it is where the gen continues)."""
        if not self._segments:
            return {"text": self._text}
        pieces: list[str] = []
        reuse: list[bool] = []
        at = 0
        for start, end in self._segments:
            if start > at:
                pieces.append(self._text[at:start])
                reuse.append(False)
            pieces.append(self._text[start:end])
            reuse.append(True)
            at = end
        if at < len(self._text):
            pieces.append(self._text[at:])
            reuse.append(False)
        reuse[-1] = False
        return {"segments": pieces, "segment_reuse": reuse}

    def _gen(self, op: Gen) -> None:
        backend = self._run.backend
        request = {**self._prompt(), "sampling_params": {**self._run.default_sampling, **op.sampling}}
        if int(request["sampling_params"].get("n") or 1) > 1:
            if self._role is not None:
                raise ValueError(
                    f"gen({op.name!r}) with n > 1 inside the {self._role[0]} block would leave the "
                    "block empty; generate the samples outside it, or fork"
                )
            outs = backend.generate(request)
            for out in outs:
                self._run.record("gen", op.name, out["meta_info"])
            self._store(op.name, [o["text"] for o in outs], [o["meta_info"] for o in outs])
            return
        if self._run.stream:
            out = self._gen_streamed(op, request)
        else:
            out = backend.generate(request)
            self._append(out["text"], op.name)
        self._run.record("gen", op.name, out["meta_info"])
        self._store(op.name, out["text"], out["meta_info"])

    def _gen_streamed(self, op: Gen, request: dict[str, Any]) -> dict[str, Any]:
        """Append the text as it streams; returns the last (complete) result."""
        out: dict[str, Any] | None = None
        sent = ""
        for out in self._run.backend.generate_stream(request):
            text = out["text"]
            if text.startswith(sent) and len(text) > len(sent):
                self._append(text[len(sent) :], op.name)
                sent = text
        if out is None:
            raise RuntimeError(f"the stream of gen({op.name!r}) ended without a result")
        if out["text"] != sent:  # the runtime took back text it had streamed: keep its final word
            with self._run.cond:
                self._text = self._text[: len(self._text) - len(sent)]
            self._append(out["text"], op.name)
        return out

    def _select(self, op: Select) -> None:
        scores = self._run.backend.score(self._text, op.choices)
        for meta in scores.calls:
            self._run.record("select", op.name, meta)
        choice = op.choices[scores.best(op.normalize)]
        self._append(choice, op.name)
        self._store(op.name, choice, {"choice": choice, "normalize": op.normalize, "scores": scores.choices})

    def _begin_role(self, role: str) -> None:
        if self._role is not None:
            raise ValueError(f"a {role} block cannot start inside the open {self._role[0]} block")
        opening = self._run.backend.chat_template.begin(role, first_block=not self._messages)
        self._append(opening)
        self._role = (role, len(self._text))

    def _end_role(self, role: str) -> None:
        if self._role is None or self._role[0] != role:
            raise ValueError(f"the {role} block ends, but it is not the open block")
        content = self._text[self._role[1] :]
        self._append(self._run.backend.chat_template.end(role))
        self._messages.append({"role": role, "content": content})
        self._role = None


class ForkGroup(Sequence[ProgramState]):
    """The branches of one `fork`: a list of states, plus `forks += item` (add to every branch),
    `forks["name"]` (that variable of every branch) and `join()` (wait for them all)."""

    def __init__(self, states: list[ProgramState]) -> None:
        self._states = states

    def __len__(self) -> int:
        return len(self._states)

    @overload
    def __getitem__(self, key: int) -> ProgramState: ...
    @overload
    def __getitem__(self, key: str) -> list[Any]: ...
    @overload
    def __getitem__(self, key: slice) -> list[ProgramState]: ...

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return [s[key] for s in self._states]
        return self._states[key]

    def __iadd__(self, item: Any) -> ForkGroup:
        for state in self._states:
            state += item
        return self

    def join(self) -> ForkGroup:
        for state in self._states:
            state.sync()
        return self

    def text(self) -> list[str]:
        return [s.text() for s in self._states]
