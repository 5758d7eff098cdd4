"""Token ids -> text, one step at a time, plus the stop-string search that runs on that text.

A sample's output text is built twice, in two processes: by the scheduler, which searches it for
stop strings, and by the front, which returns it. Both make their detokenizer with
`output_detokenizer` and `add` the same token groups in the same order, so the two texts agree
character for character and a stop match's position in one is its position in the other.

Decoding each new token on its own is wrong in two ways, so `IncrementalDetokenizer` decodes a
small window of recent tokens and emits the difference (the prefix/read-offset technique of
vLLM and TGI):

- a character split over byte tokens (emoji, CJK, accents in a byte-level BPE, or SentencePiece's
  ``<0xE4>`` byte fallback) decodes to U+FFFD until its last byte arrives, so text ending in
  U+FFFD is held back;
- SentencePiece decoders drop the leading space of the first token they see, so a token decoded
  alone loses the space it has in context.

::

    window:  [ prefix tokens (already emitted) | held tokens (not yet emitted) ] <- add(ids)
              ^ 0                                ^ _read
    emitted: decode(window)[len(decode(window[:_read])):]   once it is complete text,
    then the window slides: the old held tokens become the new prefix.

The text never goes through ``clean_up_tokenization`` (a whole-string rewrite that could delete a
space already streamed); transformers 5 keeps it off by default and skips it for BPE anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.protocol import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context, so the first output token keeps its leading space.
CONTEXT_TOKENS = 5
# Tokens held while the text ends in U+FFFD before giving up on them: a UTF-8 character has at most
# 4 bytes, so that many tokens without a finished character are invalid output, not a slow one.
HOLD_LIMIT = 16
# Tokens still held after such a forced release, so a character that just started can finish.
KEEP_ON_FORCED_RELEASE = 4


class IncrementalDetokenizer:
    """Streams the text of a growing token sequence; each `add` costs O(window), not O(length).

    The window is the tokens of the last release plus those held since: a couple of tokens when
    they come one per step; at most the last two `add` calls plus twice `HOLD_LIMIT`.

    Invariant: ``"".join(add outputs) + finish() == tokenizer.decode(all ids, skip_special_tokens=...)``
    (with ``context_ids``: the text that follows ``decode(context_ids)`` in the decode of both).
    Two documented exceptions, both only for output that is not valid UTF-8: after `HOLD_LIMIT`
    held tokens none of which ended a character, all but the last few are released as they
    decode; and a SentencePiece byte-fallback decoder turns a whole run of byte tokens into U+FFFD
    when any of them is invalid, so characters of that run that were already complete (and
    streamed) differ from a whole decode.

    ``context_ids`` (the end of the prompt) only give the first output tokens their context; they
    are never emitted. They are dropped if they end inside a character.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only transformers' Python (SentencePiece) tokenizers read it; Rust-backed ones ignore it.
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self._window: list[int] = list(context_ids[-CONTEXT_TOKENS:]) if context_ids else []
        self._prefix_text = self._decode(self._window)
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            self._window, self._prefix_text = [], ""
        self._read = len(self._window)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (held-back tokens excluded)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (possibly "", possibly text of earlier tokens)."""
        if not token_ids:
            return ""
        self._window.extend(token_ids)
        full = self._decode(self._window)
        if self._completes(full):
            return self._release(len(self._window), full)
        if len(self._window) - self._read < HOLD_LIMIT:
            return ""
        # Held too long: release up to the last token that ended a character, or, if none did
        # (invalid UTF-8), all but the last few tokens as they decode.
        for cut in range(len(self._window) - 1, self._read, -1):
            decoded = self._decode(self._window[:cut])
            if self._completes(decoded):
                return self._release(cut, decoded)
        cut = len(self._window) - KEEP_ON_FORCED_RELEASE
        return self._release(cut, self._decode(self._window[:cut]))

    def finish(self) -> str:
        """Release whatever is held (an unfinished character becomes U+FFFD, as in a full decode)."""
        if self._read == len(self._window):
            return ""
        return self._release(len(self._window), self._decode(self._window))

    def _completes(self, decoded: str) -> bool:
        """Whether ``decoded`` (the decode of a longer window) adds finished text to the prefix."""
        prefix = self._prefix_text
        return (
            len(decoded) > len(prefix)
            and decoded.startswith(prefix)
            and not decoded.endswith(REPLACEMENT_CHAR)
        )

    def _release(self, cut: int, decoded: str) -> str:
        """Emit ``decoded`` (the decode of ``window[:cut]``) past the prefix; slide the window."""
        new = decoded[len(self._prefix_text) :]
        old_read = self._read
        self._window = self._window[old_read:]  # the tokens just emitted become the prefix
        self._read = cut - old_read
        self._prefix_text = self._decode(self._window[: self._read])
        if new:
            self._pieces.append(new)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            spaces_between_special_tokens=self._spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )


def output_detokenizer(
    tokenizer: PreTrainedTokenizerBase, sampling: SamplingParams, prompt_ids: Sequence[int]
) -> IncrementalDetokenizer:
    """The detokenizer of one sample's output text, as the front and the scheduler both make it.

    The text is ``"".join(add(group) for group in the sample's RequestOutput.new_token_ids)``, one
    `add` per output in order; `finish()` only appends to it. `add` is deterministic, and only the
    grouping of tokens could change its result (which tokens a forced release cuts at, for output
    that is not valid UTF-8), so the same settings, context and groups give the same text. The
    prompt is the context: SentencePiece decoders drop the leading space of a first token.
    """
    return IncrementalDetokenizer(
        tokenizer, skip_special_tokens=sampling.skip_special_tokens,
        spaces_between_special_tokens=sampling.spaces_between_special_tokens,
        context_ids=prompt_ids,
    )


@dataclass(frozen=True)
class StopMatch:
    """A stop string found in the text: it occupies ``text[position:position + len(stop)]``."""

    position: int
    stop: str

    @property
    def end(self) -> int:
        return self.position + len(self.stop)


def find_stop(text: str, stops: Sequence[str], start: int) -> StopMatch | None:
    """The earliest stop string in ``text`` that ends at or after index ``start``.

    Only text from ``start`` on is new, so each stop is searched from ``start - len(stop) + 1``:
    a match wholly before ``start`` was already checked on an earlier step. Of matches at the same
    position the shortest wins, since it is the one a token-by-token check meets first.
    """
    best: StopMatch | None = None
    for stop in stops:
        position = text.find(stop, max(0, start - len(stop) + 1))
        if position < 0:
            continue
        if best is None or (position, len(stop)) < (best.position, len(best.stop)):
            best = StopMatch(position, stop)
    return best
