"""Stop strings, evaluated in the scheduler on the step they occur.

The scheduler works on token ids; only for requests with stop strings does it decode their
output incrementally, and it searches only the newly decoded text (plus a look-back as long as
the longest stop string), so each step costs O(new text), not O(output).
"""

from __future__ import annotations

from typing import Any

from radixserve.detokenizer import IncrementalDetokenizer, find_stop


class StopChecker:
    def __init__(
        self, tokenizer: Any, stops: list[str], skip_special_tokens: bool, prompt_ids: list[int]
    ) -> None:
        self.stops = stops
        # same text as the client sees: decoded with the prompt as context
        self._detok = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=skip_special_tokens, context_ids=prompt_ids
        )
        self._text = ""

    def check(self, token_id: int) -> str | None:
        """Feed one output token; return the stop string if the output now contains one."""
        start = len(self._text)
        self._text += self._detok.add([token_id])
        match = find_stop(self._text, self.stops, start)
        return match.stop if match is not None else None
