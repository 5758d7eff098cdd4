"""Prompt-lookup drafting for speculative decoding (`--speculative-algorithm ngram`).

A RAG answer that quotes its document, or an agent that repeats a key of a tool's JSON, writes
spans that already stand in its prompt or output. The drafter finds the latest earlier place
where the sequence's current suffix (its last n tokens, n from the longest window down) also
occurs, and proposes the tokens that followed it there; the worker then checks them all in one
forward (`Chunk.draft_len`). Where those followers run up to the sequence's end, the draft reads
on into itself: the suffix matched `period` tokens back, so the text is a loop of that period
(an output repeating a line, a list, a JSON pattern) and the draft goes round it, instead of
stopping at the end of one round and taking a step per round.

The index maps every n-gram of the sequence (for each window size n) to the position right
after its latest occurrence. It is updated as tokens arrive, one entry per window size per
token, never rebuilt:

    tokens:  a b c d a b [c]        suffix "a b" (n = 2) occurred at 0..1, followed by "c d a"
    index:   ("a","b") -> 2, ("b","c") -> 3, ... (only n-grams that end before the last token)
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramDrafter:
    """Drafts for one sequence (prompt + output), from its own tokens only."""

    def __init__(self, min_window: int, max_window: int) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"need 1 <= min window <= max window, got {min_window}, {max_window}")
        self.min_window, self.max_window = min_window, max_window
        self._tokens: list[int] = []  # prompt + output so far, extended by the new outputs only
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions < this are in the index

    def propose(self, prompt: Sequence[int], output: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        of prompt + output found (none: []). The prompt stays the same between calls and the
        output only grows: each call costs the new tokens, not the whole sequence."""
        if k <= 0:
            return []
        if not self._tokens:
            self._tokens = list(prompt)
        self._tokens.extend(output[len(self._tokens) - len(prompt) :])
        tokens = self._tokens
        self._catch_up(tokens)
        end = len(tokens)
        for n in range(min(self.max_window, end - 1), self.min_window - 1, -1):
            after = self._index.get(tuple(tokens[end - n :]))
            if after is not None:
                return _followers(tokens, after, k)
        return []

    def _catch_up(self, tokens: Sequence[int]) -> None:
        """Index the n-grams ending before the last token (the suffix itself must not match)."""
        for stop in range(max(self._indexed, 1), len(tokens)):
            for n in range(self.min_window, min(self.max_window, stop) + 1):
                self._index[tuple(tokens[stop - n : stop])] = stop
        self._indexed = max(self._indexed, len(tokens))


def _followers(tokens: Sequence[int], after: int, k: int) -> list[int]:
    """The k tokens from position `after` on, read on into the draft itself past the end."""
    period = len(tokens) - after
    if k <= period:
        return list(tokens[after : after + k])
    return [tokens[after + j % period] for j in range(k)]
