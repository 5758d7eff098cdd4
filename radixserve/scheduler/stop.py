"""Stop strings, evaluated in the scheduler on the step they complete.

The scheduler works on token ids; only for requests with stop strings does it decode their
output incrementally, and it searches only the newly decoded text (plus a look-back as long as
the longest stop string), so each step costs O(new text), not O(output).

The scheduler owns the decision and its place: a match is reported with its position in the
sample's output text (`FinishReason.stop_position`), which is the front's text too
(`output_detokenizer`), so the front cuts there and never searches again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.detokenizer import StopMatch, find_stop, output_detokenizer
from radixserve.protocol import SamplingParams


class StopChecker:
    def __init__(self, tokenizer: Any, sampling: SamplingParams, prompt_ids: list[int]) -> None:
        self.stops = sampling.stop
        self._detok = output_detokenizer(tokenizer, sampling, prompt_ids)
        self._text = ""

    def replay(self, groups: Sequence[Sequence[int]]) -> None:
        """Feed a resumed sample's earlier outputs, one `add` each as they first came, without
        searching: none of them ended it. The text is then the front's again."""
        for group in groups:
            self._text += self._detok.add(group)

    def check(self, token_ids: Sequence[int]) -> StopMatch | None:
        """Feed one output's tokens (exactly one `RequestOutput.new_token_ids`, so the text stays
        the front's); return the earliest stop string that the new text completes, if any."""
        start = len(self._text)
        self._text += self._detok.add(token_ids)
        return find_stop(self._text, self.stops, start)
