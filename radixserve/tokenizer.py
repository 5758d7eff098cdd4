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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Message keys besides role/content that OpenAI clients send and chat templates may read.
_PASSTHROUGH_KEYS = ("name", "tool_calls", "tool_call_id")


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
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template; send plain text to /generate or "
            "/v1/completions instead"
        )
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


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style messages and flatten list-of-parts content into one string.

    Text parts are joined with newlines (as vLLM does); other parts (images, audio) are refused.
    An assistant message carrying ``tool_calls`` may have null content.
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
        normalized = {"role": role, "content": _content_text(content, f"messages[{i}].content")}
        normalized.update({k: message[k] for k in _PASSTHROUGH_KEYS if message.get(k) is not None})
        chat.append(normalized)
    return chat


def _content_text(content: Any, where: str) -> str:
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
        texts.append(text)
    return "\n".join(texts)
