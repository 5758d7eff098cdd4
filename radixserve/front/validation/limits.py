"""The caps on what one request may ask for, and how a server or `Engine` derives them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from radixserve.config import ServerConfig
from radixserve.protocol import WorkerInfo
from radixserve.tokenizer import prompt_char_limit


@dataclass(frozen=True)
class Limits:
    """Caps on what one request may ask for; the server's options set them."""

    max_new_tokens: int = 16384
    max_n: int = 16
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string
    max_top_logprobs: int = 20  # OpenAI's cap on top_logprobs
    max_stop_token_ids: int = 1024  # each sample carries its own copy to the worker
    max_logit_bias: int = 1024  # entries; OpenAI documents no cap, vLLM none either
    max_sequences: int = 1024  # prompts x n of one call; the server sets --max-queued-requests
    max_rid_chars: int = 256  # a rid is echoed in every streamed event
    max_cache_salt_chars: int = 256
    max_prompt_tokens: int | None = None  # None: only the model's context length limits it
    # characters of one prompt text, checked before it is tokenized; the server derives it from
    # the context length and the tokenizer (`tokenizer.prompt_char_limit`). None: no bound
    max_prompt_chars: int | None = None
    max_grammar_chars: int = 131072  # a json_schema, regex, ebnf or structural_tag's source

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"Limits.{f.name} must be a positive integer, got {value!r}")


def request_limits(config: ServerConfig, ready: WorkerInfo, tokenizer: Any) -> Limits:
    """The per-request caps of a server or `Engine`: prompts x n at most the queue's size, and
    no text longer than the context could possibly hold (`prompt_char_limit`)."""
    return Limits(
        max_sequences=config.max_queued_requests,
        max_prompt_chars=prompt_char_limit(tokenizer, ready.context_len),
    )
