"""What a program adds to its state: text, `gen`, `select` and role blocks.

These are plain descriptions; `ProgramState` executes them in order (see state.py).

    s += fl.system("You are terse.")
    s += fl.user("Is water wet?")
    s += fl.assistant(fl.select("answer", choices=["yes", "no"]))
    s += "Because" + ...            # plain text is appended as is
    s += fl.segment(document)       # text whose KV the runtime may reuse wherever it sits
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# gen's keyword -> the runtime's sampling parameter
_SAMPLING_KEYS = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "n": "n",
    "seed": "seed",
}


def sampling_params(**kwargs: Any) -> dict[str, Any]:
    """gen-style keywords (`max_tokens=8`) as /generate's `sampling_params` (`max_new_tokens`).

    `None` means "not set". Other keys pass through unchanged, so the runtime names any it does
    not know in its error.
    """
    return {_SAMPLING_KEYS.get(k, k): v for k, v in kwargs.items() if v is not None}


@dataclass(frozen=True)
class Gen:
    """Generate from the text so far, append the output and store it under `name`."""

    name: str | None
    sampling: dict[str, Any]

    @property
    def n(self) -> int:
        return int(self.sampling.get("n") or 1)


@dataclass(frozen=True)
class Select:
    """Append the choice the model finds most likely after the text so far; store it under `name`."""

    name: str | None
    choices: tuple[str, ...]
    normalize: bool = True


@dataclass(frozen=True)
class Segment:
    """Text appended to the prompt as a reusable segment (a retrieved document): the runtime may
    reuse its KV wherever it sits in later prompts, computed once on its own (see
    docs/frontend_lang.md)."""

    text: str


@dataclass(frozen=True)
class RoleBegin:
    role: str


@dataclass(frozen=True)
class RoleEnd:
    role: str


@dataclass(frozen=True)
class SetVar:
    """`s["name"] = value`: store a value without touching the text."""

    name: str
    value: Any


@dataclass(frozen=True)
class Role:
    """A whole role block: its opening text, the parts, its closing text."""

    role: str
    parts: tuple[Any, ...]

    def expand(self) -> list[Any]:
        return [RoleBegin(self.role), *self.parts, RoleEnd(self.role)]


Op = str | Segment | Gen | Select | RoleBegin | RoleEnd | SetVar


def gen(
    name: str | None = None,
    *,
    max_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    n: int | None = None,
    regex: str | None = None,
    json_schema: str | Mapping[str, Any] | None = None,
    **sampling: Any,
) -> Gen:
    """Generate and append the output; `s[name]` reads it.

    Keywords are the runtime's sampling parameters with `max_tokens` for `max_new_tokens`
    (also `min_tokens`, `stop_token_ids`, `min_p`, `frequency_penalty`, `presence_penalty`,
    `repetition_penalty`, `ignore_eos`, `seed`, `ebnf`, `structural_tag`). Unset ones come from
    the program's `default_sampling`, then the runtime's defaults. With `n > 1`, `s[name]` is a
    list of `n` samples and nothing is appended to the text (fork to continue from each).

    `regex` or `json_schema` (a schema as a dict or as JSON text) constrain the output, as
    SGLang's `sgl.gen(regex=...)`: the runtime only samples tokens the grammar allows, so the
    output matches the regex, or parses as JSON valid under the schema (unless `max_tokens`
    cuts it short).
    """
    if isinstance(stop, str):
        stop = [stop]
    if json_schema is not None and not isinstance(json_schema, str):
        json_schema = json.dumps(json_schema)
    params = sampling_params(
        max_tokens=max_tokens, stop=list(stop) if stop is not None else None,
        temperature=temperature, top_p=top_p, top_k=top_k, n=n, regex=regex, json_schema=json_schema,
        **sampling,
    )
    return Gen(name=name, sampling=params)


def select(name: str | None = None, choices: Sequence[str] = (), *, normalize: bool = True) -> Select:
    """Append the most likely of `choices` and store it under `name`.

    Every choice is scored by the log probability of its tokens after the text so far, divided
    by its token count (`normalize=False`: the raw sum). `s.meta_info(name)["scores"]` keeps
    every choice's score, both ways.
    """
    if isinstance(choices, str) or not choices:
        raise ValueError("select needs a non-empty list of choices")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select's choices must be non-empty strings")
    return Select(name=name, choices=tuple(choices), normalize=normalize)


def segment(text: str) -> Segment:
    """Append `text` as a reusable segment: `s += fl.segment(document)`.

    It is part of the prompt like any text, but every call made after it sends the prompt as
    segments (the runtime's `segments` API), so the runtime can reuse this text's KV wherever it
    sits, whatever came before it: RAG documents retrieved in a different order each time still
    hit. Only segment texts are reused; the text around them is computed in context. Each
    segment is tokenized on its own, so write the separators (newlines) into the texts.
    """
    if not isinstance(text, str) or not text:
        raise ValueError("fl.segment needs a non-empty string")
    return Segment(text)


document = segment  # the same primitive, named for what it usually holds


def system(*parts: Any) -> Role:
    """A system block: `s += fl.system("You are terse.")`."""
    return Role("system", parts)


def user(*parts: Any) -> Role:
    """A user block: `s += fl.user("Hi")`."""
    return Role("user", parts)


def assistant(*parts: Any) -> Role:
    """An assistant block, often generated: `s += fl.assistant(fl.gen("reply"))`."""
    return Role("assistant", parts)


def system_begin() -> RoleBegin:
    """Open a system block by hand; `system_end()` closes it (`with s.system():` does both)."""
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    """Open a user block by hand; `user_end()` closes it."""
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    """Open an assistant block by hand, e.g. before forking: every branch inherits the open
    block, and the branch that continues closes it with `assistant_end()`."""
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def flatten(item: Any) -> list[Op]:
    """What `s += item` means as a list of operations; TypeError for anything else."""
    if isinstance(item, (str, Segment, Gen, Select, RoleBegin, RoleEnd, SetVar)):
        return [item]
    if isinstance(item, Role):
        return [op for part in item.expand() for op in flatten(part)]
    if isinstance(item, (list, tuple)):
        return [op for part in item for op in flatten(part)]
    raise TypeError(
        f"cannot add a {type(item).__name__} to a program state; add text, fl.segment, fl.gen, "
        "fl.select or a role block"
    )
