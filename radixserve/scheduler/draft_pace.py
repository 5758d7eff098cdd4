"""How much a request drafts (speculative decoding): its next draft's length, and pauses while
its drafts keep failing.

Checking a draft costs its forward whether or not a token of it is accepted, so a request
whose drafts are rejected (an answer that does not copy its prompt) would pay for them on every
step. A check's extra rows are cheap next to the step itself (a decode step reads every weight
once, whatever its rows), so a draft pays for itself once a small share of its tokens is kept:
that share is the cost of a row relative to a step (docs/benchmarks.md, speculative decoding).
Its pace follows its own record:

- length: starts at `MIN_LENGTH`, doubles (to `--speculative-num-draft-tokens`) after a draft
  accepted whole, else becomes the accepted part + 1 but not under `MIN_LENGTH`; so a long draft
  is only checked once shorter ones passed, and a rejection (the end of one copied span) does
  not send a quoting answer back to single tokens: its next span is often copied too;
- pauses: when its acceptance rate over recent drafts (each draft's accepted fraction, in an
  average that halves an older draft's weight) falls below `MIN_ACCEPT_RATE`, it skips its next
  `backoff` decode steps' drafts, `backoff` doubling (to `MAX_BACKOFF`) each time a draft after
  a pause fails again and going back to none once a draft keeps the rate up. A request that
  never gains drafts at steps 0, 1, 2, 3, 5, 8, 13, 22, 39, ...: a few checks per answer, not
  one per token, and it still notices when its output starts to quote.
"""

from __future__ import annotations

MIN_ACCEPT_RATE = 0.1  # about break-even: a check row's cost as a share of a decode step's
MIN_LENGTH = 2  # a first draft, and the shortest after a rejection
MAX_BACKOFF = 64  # decode steps: a paused request still tries now and then


class DraftPace:
    """One sample's draft length and pauses."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.min_length = min(MIN_LENGTH, max_length)
        self.length = self.min_length  # the most tokens of its next draft: earned by accepted drafts
        self.rate = 1.0  # accepted fraction of recent drafts
        self._backoff = 0  # the last pause's length (0: none since the rate was last met)
        self._paused = 0  # decode steps left without a draft

    def allow(self) -> int:
        """The most tokens this decode step's draft may have: 0 while paused (the step counts)."""
        if self._paused:
            self._paused -= 1
            return 0
        return self.length

    def record(self, drafted: int, accepted: int) -> None:
        """A checked draft of `drafted` tokens, of which the first `accepted` were kept."""
        grown = 2 * self.length if accepted == drafted else accepted + 1
        self.length = max(self.min_length, min(self.max_length, grown))
        self.rate = (self.rate + accepted / drafted) / 2
        if self.rate < MIN_ACCEPT_RATE:
            self._backoff = min(2 * self._backoff, MAX_BACKOFF) or 1
            self._paused = self._backoff
        else:
            self._backoff = 0
