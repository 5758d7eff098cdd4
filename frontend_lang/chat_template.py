"""Role blocks as text: what a chat template writes before and after each role's content.

A program's text only grows, so `fl.user(...)` cannot re-render the whole conversation each
turn; it needs each role's *prefix* and *suffix*. `ChatTemplate.from_tokenizer` derives them
from the model's own Jinja template by rendering small conversations with marker contents and
cutting the text around the markers:

    render([system S])                  = first["system"] + S + suffix["system"]
    render([system S, user U])          = render([system S]) + prefix["user"] + U + suffix["user"]
    render([..., assistant A])          = render([..., user U]) + prefix["assistant"] + A + ...

`first` is the prefix of a conversation's first block: templates put a BOS token or a default
system prompt there (SmolLM2 writes "You are a helpful AI assistant named SmolLM..." before a
first user turn). Templates that do not render incrementally (the text of a shorter
conversation is not the start of a longer one) are refused; pass a `ChatTemplate` built by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")
_MARK = "@@frontend_lang_{}@@"


@dataclass(frozen=True)
class ChatTemplate:
    """Per-role text around a block's content. `first` overrides `prefix` for the first block."""

    prefix: Mapping[str, str]
    suffix: Mapping[str, str]
    first: Mapping[str, str] = field(default_factory=dict)

    def begin(self, role: str, first_block: bool) -> str:
        """The text that opens a `role` block (`first_block`: no role block came before)."""
        table = self.first if first_block and role in self.first else self.prefix
        if role not in table:
            raise ValueError(f"this chat template has no {role!r} role")
        return table[role]

    def end(self, role: str) -> str:
        if role not in self.suffix:
            raise ValueError(f"this chat template has no {role!r} role")
        return self.suffix[role]

    @classmethod
    def chatml(cls, default_system: str | None = None) -> ChatTemplate:
        """ChatML (`<|im_start|>role\\n ... <|im_end|>\\n`), optionally with a default system prompt."""
        prefix = {r: f"<|im_start|>{r}\n" for r in ROLES}
        first = {}
        if default_system is not None:
            head = f"<|im_start|>system\n{default_system}<|im_end|>\n"
            first = {"user": head + prefix["user"], "assistant": head + prefix["assistant"]}
        return cls(prefix=prefix, suffix={r: "<|im_end|>\n" for r in ROLES}, first=first)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatTemplate:
        """Derive the role texts from a Hugging Face tokenizer's chat template (see the module doc)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; pass a ChatTemplate explicitly")

        def render(messages: list[tuple[str, str]]) -> str:
            chat = [{"role": r, "content": c} for r, c in messages]
            return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)

        marks = [_MARK.format(i) for i in range(4)]
        history, texts = _render_history(render, marks)
        role0, mark0 = history[0]
        first: dict[str, str] = {}
        suffix: dict[str, str] = {}
        first[role0], _, suffix[role0] = texts[0].partition(mark0)
        prefix: dict[str, str] = {}
        for i in range(1, len(history)):
            if not texts[i].startswith(texts[i - 1]):
                raise ValueError(
                    "this chat template does not render incrementally (a conversation's text is "
                    "not the start of the next turn's); pass a ChatTemplate explicitly"
                )
            role, mark = history[i]
            before, _, after = texts[i][len(texts[i - 1]) :].partition(mark)
            if prefix.setdefault(role, before) != before or suffix.setdefault(role, after) != after:
                raise ValueError(f"this chat template renders {role!r} turns differently each time")
        if role0 == "system":
            prefix["system"] = _later_system_prefix(render, marks) or first["system"]
        for role in ("user", "assistant"):
            try:
                text = render([(role, marks[0])])
            except Exception:  # noqa: BLE001 - a template may refuse to start with this role
                continue
            first[role] = text[: text.index(marks[0])]
        first = {r: t for r, t in _strip_bos(tokenizer, first).items() if t != prefix.get(r)}
        return cls(prefix=prefix, suffix=suffix, first=first)


def _render_history(render: Any, marks: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Render a growing conversation, with a system turn first if the template allows one."""
    with_system = [("system", marks[0]), ("user", marks[1]), ("assistant", marks[2]), ("user", marks[3])]
    failure: Exception | None = None
    for history in (with_system, with_system[1:]):
        try:
            return history, [render(history[: i + 1]) for i in range(len(history))]
        except Exception as exc:  # noqa: BLE001 - e.g. "System role not supported"
            failure = exc
    raise ValueError(f"the chat template cannot render a simple conversation: {failure}")


def _later_system_prefix(render: Any, marks: list[str]) -> str | None:
    """A system block after other turns, when the template allows one."""
    try:
        before = render([("user", marks[1])])
        text = render([("user", marks[1]), ("system", marks[0])])
    except Exception:  # noqa: BLE001 - many templates allow a system turn only first
        return None
    if not text.startswith(before) or marks[0] not in text[len(before) :]:
        return None
    return text[len(before) :].partition(marks[0])[0]


def _strip_bos(tokenizer: Any, first: dict[str, str]) -> dict[str, str]:
    """Drop a BOS the template writes when encoding the text adds one anyway (no double BOS)."""
    bos = getattr(tokenizer, "bos_token", None)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return first
    ids = tokenizer("x").input_ids
    if not ids or ids[0] != bos_id:
        return first
    return {r: t[len(bos) :] if t.startswith(bos) else t for r, t in first.items()}
