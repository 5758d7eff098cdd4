"""One sample's result as the caller sees it, built from the scheduler's outputs as they arrive.

The front decides nothing here: the scheduler decided when and why the sample ended, and where
a stop string begins in the output text (`FinishReason.stop_position`). This text is the
scheduler's text character for character (`detokenizer.output_detokenizer`, fed the same token
groups), so the front cuts at that position and never searches for the string itself: a search
would find an earlier occurrence that `min_new_tokens` let through.

While streaming, a tail of the text that could be the start of a stop string is held back, so
the cumulative text a caller sees only ever grows: a match that completes later begins at or
after what was shown (the part of it already decoded is exactly such a tail).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.detokenizer import output_detokenizer
from radixserve.protocol import RequestOutput, SamplingParams


@dataclass
class PromptLogprobs:
    """The prompt's logprobs: a fact of the request, not of a sample. Sample 0's first output
    brings them (the scheduler computes them once), and every sample's result shows them."""

    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class SampleOutput:
    """Output of one of a request's n samples, accumulated as `RequestOutput`s arrive."""

    def __init__(self, tokenizer: Any, sampling: SamplingParams, prompt_ids: Sequence[int], prompt: PromptLogprobs) -> None:
        self.sampling = sampling
        self.prompt = prompt  # shared by the request's samples
        self._detok = output_detokenizer(tokenizer, sampling, prompt_ids)
        self.output_ids: list[int] = []
        self.text = ""  # all text so far; `visible_text` is what a caller may be shown
        self.finish: dict[str, Any] | None = None
        self.cached_tokens = 0
        self.segment_tokens = 0  # of the cached tokens, those reused from the segment cache
        self.recomputed_tokens = 0  # of those, recomputed in context
        self.prompt_tokens = 0
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.first_token_time: float | None = None
        self.spec_accepted_tokens: int | None = None  # with speculative decoding on
        self.done = False

    def apply(self, out: RequestOutput) -> None:
        """Take one output of this sample (they arrive in order; the last has `finish`)."""
        if out.new_token_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_ids.extend(out.new_token_ids)
        self.text += self._detok.add(out.new_token_ids)  # one add per output, as the scheduler's
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.segment_tokens, self.recomputed_tokens = out.segment_tokens, out.recomputed_tokens
        if out.spec_accepted_tokens is not None:
            self.spec_accepted_tokens = out.spec_accepted_tokens
        self.output_logprobs.extend(out.output_logprobs)
        self.output_top_logprobs.extend(out.output_top_logprobs)
        if out.input_logprobs:
            self.prompt.logprobs, self.prompt.top_logprobs = out.input_logprobs, out.input_top_logprobs
        if out.finish is not None:
            self.text += self._detok.finish()
            finish = out.finish
            if finish.stop_position is not None and not self.sampling.no_stop_trim:
                self.text = self.text[: finish.stop_position]
            self.finish = {"type": finish.type, "matched": finish.matched}
            if finish.message:
                self.finish["message"] = finish.message
            self.done = True

    @property
    def visible_text(self) -> str:
        """The text, less (while streaming) a tail that may be the start of a stop string."""
        p = self.sampling
        if self.done or not p.stop or p.no_stop_trim:
            return self.text
        hold = 0
        for stop in p.stop:
            for k in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:k]):
                    hold = k
                    break
        return self.text[: len(self.text) - hold]
