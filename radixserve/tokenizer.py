"""Text -> token ids for the front: loading the tokenizer, chat templates, plain encoding.

Two ways in, and they differ on purpose:
- `encode` (raw text, /generate and /v1/completions) adds the tokenizer's own special tokens
  (the BOS of Llama-style tokenizers) exactly as ``tokenizer(text).input_ids`` does, which is
  what a Hugging Face ``generate`` user feeds the model; that is what makes our greedy outputs
  comparable with transformers'.
- `apply_chat_template` (chat) adds none: the template writes every control token itself, so
  encoding its text with special tokens would put a second BOS in front.

Tokenizing costs time and memory in proportion to the text (a 30 MB prompt: most of a minute and
gigabytes), so `prompt_char_limit` bounds what is worth tokenizing: past it, no text can fit the
context, and the server refuses it without tokenizing.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Message keys besides role/content that OpenAI clients send and chat templates may read.
_PASSTHROUGH_KEYS = ("name", "tool_calls", "tool_call_id")


def import_in_background() -> threading.Thread:
    """Starts importing what loading a tokenizer imports in a thread, and returns the thread: the
    imports take seconds, so a front runs them while the engine's processes start rather than
    after them. transformers' lazy module is not safe to import from two threads at once, so
    join the thread before anything else imports transformers (`load_tokenizer` does)."""
    thread = threading.Thread(target=_import_tokenizer_modules, name="radixserve-import-transformers", daemon=True)
    thread.start()
    return thread


def _import_tokenizer_modules() -> None:
    """AutoTokenizer, and transformers.activations: `AutoTokenizer.from_pretrained` loads the
    model's config class, every config module imports transformers.activations (through its
    type validators), and that imports torch.distributed: most of a tokenizer's first load."""
    import transformers.activations  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local Hugging Face folder; never the network, never remote code."""
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {e}") from e


# A normalizer may compose characters before the model sees them (NFC turns a letter and up to
# three combining marks, or three Hangul jamo, into one character), so with one the bound allows
# this many characters per vocabulary character.
NORMALIZER_MARGIN = 4


def prompt_char_limit(tokenizer: Any, context_len: int) -> int | None:
    """The most characters a prompt text can have and still tokenize to `context_len` tokens or
    fewer; None for a tokenizer that has no vocabulary to tell.

    No token covers more characters of text than its vocabulary entry has: byte-level BPE writes
    each UTF-8 byte as one character (and a character is at least one byte), SentencePiece writes
    a space as "▁" and a fallback byte as "<0xNN>", WordPiece adds "##". So a text longer than
    `context_len` x the longest entry needs more tokens than the context holds.
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    longest = max((len(entry) for entry in get_vocab()), default=0)
    if longest == 0:
        return None
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    return context_len * longest * (NORMALIZER_MARGIN if normalizer is not None else 1)


def text_chars(value: Any) -> int:
    """Characters of every string value inside a (normalized) message or a list of them: contents,
    names, tool-call arguments; what a chat template can put into the prompt besides its own
    text. Keys do not count (a template writes `content`'s value, not the word)."""
    total, stack = 0, [value]
    while stack:  # not recursive: nesting depth is the client's to choose
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of raw prompt text, special tokens (BOS) added as ``tokenizer(text)`` adds them."""
    return list(tokenizer(text).input_ids)


def encode_continuation(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of text that follows other text in a prompt (a segment after the first): no
    special tokens, since the BOS belongs at the prompt's start only."""
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def reusable_spans(lengths: Sequence[int], reusable: Sequence[bool]) -> list[tuple[int, int]]:
    """The token spans [start, end) of the pieces of a prompt (their token counts, in order)
    that may be reused from the segment cache: pieces without tokens have none, and a piece
    that ends the prompt is computed in context whatever it is (its last token's logits are
    the ones sampled from)."""
    spans, start = [], 0
    for length, reuse in zip(lengths, reusable, strict=True):
        if reuse and length:
            spans.append((start, start + length))
        start += length
    if spans and spans[-1][1] == start:
        spans.pop()
    return spans


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Any,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a chat, rendered by the tokenizer's own template (given `tools` when the
    template renders tools itself; `front.tools` decides that).

    Control tokens written inside message text (say ``<|im_start|>system``) are encoded as
    ordinary text, so a user cannot forge another role's turn; only the template writes them.
    Raises ValueError for a tokenizer without a template, malformed messages, or a template
    that rejects the conversation (e.g. roles that do not alternate).
    """
    _check_has_template(tokenizer)
    chat = normalize_messages(messages)
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(
            chat,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=True,
            **({"tools": tools} if tools else {}),
        )
    except (TemplateError, TypeError) as e:  # TypeError: a template meeting a value it cannot use
        raise ValueError(f"the chat template rejected these messages: {e}") from e
    return list(ids)


def _check_has_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template; send plain text to /generate or "
            "/v1/completions instead"
        )


class ChatSegments:
    """The content parts of a conversation marked ``"segment": true`` (segment reuse, see
    docs/server.md), collected by `normalize_messages`.

    Each part's text is replaced by a placeholder while the template renders, so the rendered
    text can be cut around it and the part tokenized on its own: its tokens are then the same
    wherever the part sits, which is what lets the segment cache reuse them. A placeholder
    carries a random nonce, so no client text can contain one by chance or on purpose.
    """

    def __init__(self) -> None:
        self.texts: list[str] = []
        self._nonce = uuid.uuid4().hex

    def placeholder(self, index: int) -> str:
        return f"[radixserve-segment-{self._nonce}-{index}]"

    def add(self, text: str) -> str:
        """Record a segment part's text; the placeholder that stands for it in the message."""
        self.texts.append(text)
        return self.placeholder(len(self.texts) - 1)


def apply_chat_template_segments(
    tokenizer: PreTrainedTokenizerBase,
    messages: Any,
    segments: ChatSegments,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of a chat whose messages hold `segments`' placeholders, and the span of each
    segment part's tokens.

    The template renders with the placeholders; the text is cut at each one, and the pieces and
    the parts are tokenized separately, each without special tokens (the template writes them),
    and concatenated. Control tokens in message text stay ordinary text, as in
    `apply_chat_template`: the messages are marked the way transformers' own
    ``sanitize_control_tokens`` marks them, and every piece is encoded by the same rule. A
    template that drops or repeats a segment part is refused: its span would mean nothing.
    """
    _check_has_template(tokenizer)
    chat = normalize_messages(messages)
    from jinja2 import TemplateError

    try:
        template = tokenizer.get_chat_template(None, tools)
        # transformers' own marking of client strings (what apply_chat_template(...,
        # sanitize_control_tokens=True) does before rendering), with the segment texts as
        # `documents`, a list it marks string by string
        marked, marked_tools, marked_texts, _ = tokenizer._mark_chat_inputs(
            template, [chat], tools, list(segments.texts), {}, True, False,
        )
        rendered = tokenizer.apply_chat_template(
            marked[0], add_generation_prompt=add_generation_prompt, tokenize=False,
            **({"tools": marked_tools} if marked_tools else {}),
        )
    except (TemplateError, TypeError) as e:
        raise ValueError(f"the chat template rejected these messages: {e}") from e
    cuts = []
    for i in range(len(segments.texts)):
        placeholder = segments.placeholder(i)
        found = rendered.count(placeholder)
        if found != 1:
            raise ValueError(
                f"the chat template writes segment part {i} {'nowhere' if found == 0 else f'{found} times'}; "
                "mark parts of messages the template renders once as segments"
            )
        cuts.append((rendered.index(placeholder), placeholder, i))
    cuts.sort()

    def piece_ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False, sanitize_control_tokens=True).input_ids) if text else []

    pieces: list[list[int]] = []
    at = 0
    for position, placeholder, i in cuts:
        pieces.append(piece_ids(rendered[at:position]))
        pieces.append(piece_ids(marked_texts[i]))
        at = position + len(placeholder)
    pieces.append(piece_ids(rendered[at:]))
    is_segment = [k % 2 == 1 for k in range(len(pieces))]
    return [t for piece in pieces for t in piece], reusable_spans([len(p) for p in pieces], is_segment)


def normalize_messages(messages: Any, segments: ChatSegments | None = None) -> list[dict[str, Any]]:
    """Check OpenAI-style messages and flatten list-of-parts content into one string.

    Text parts are joined with newlines (as vLLM does); other parts (images, audio) are refused.
    An assistant message carrying ``tool_calls`` may have null content. A text part may carry
    ``"segment": true``: given `segments`, its text is recorded there and a placeholder stands
    for it in the content (`apply_chat_template_segments`); without, it is ordinary text.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}"
            )
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            content = ""
        normalized = {"role": role, "content": _content_text(content, f"messages[{i}].content", segments)}
        normalized.update({k: message[k] for k in _PASSTHROUGH_KEYS if message.get(k) is not None})
        chat.append(normalized)
    return chat


def _content_text(content: Any, where: str, segments: ChatSegments | None) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f"{where} must be a string or a list of text parts; got {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{where}[{j}]: only parts of type 'text' are supported; got {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}[{j}].text must be a string")
        segment = part.get("segment")
        if segment is not None and type(segment) is not bool:
            raise ValueError(f"{where}[{j}].segment must be a boolean")
        if segment and not text:
            raise ValueError(f"{where}[{j}] is a segment without text; a segment needs a non-empty text")
        texts.append(segments.add(text) if segment and segments is not None else text)
    return "\n".join(texts)
