"""Scoring `select`'s choices with prompt log probabilities, using the runtime's tokenization.

A choice is scored by the tokens it adds *as they tokenize after the exact prompt text*. Those
are not always "the prompt's tokens, then the choice's": BPE can merge across the boundary.

    prompt "The answer is "   -> The | answer | is | " "
    prompt + "yes"            -> The | answer | is | " yes"     (the trailing space merged)

So each choice's tokens start where prompt+choice first differs from the prompt alone (here at
" yes", which carries the prompt's last character), and the score is the sum of their log
probabilities given everything before them.

Three calls, all `max_new_tokens: 0`:
1. the prompt alone: caches it, and tells its token count P;
2. one batch: the prompt and every prompt+choice, with logprobs from position P - W on. The
   prompt's tail gives its last W token ids to compare with; everything before P - W comes
   from the cache, so k choices cost about k * (W + choice) tokens of compute.
If the two differ before P - W (never seen in practice), W grows and step 2 repeats.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

WINDOW = 8  # prompt tokens re-scored before the boundary


@dataclass(frozen=True)
class ChoiceScore:
    """One choice's score: the log probabilities of the tokens it adds after the prompt."""

    choice: str
    token_ids: tuple[int, ...]
    token_logprobs: tuple[float, ...]

    @property
    def logprob_sum(self) -> float:
        return sum(self.token_logprobs)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def normalized(self) -> float:
        """The mean log probability per token: what `select` compares by default."""
        return self.logprob_sum / self.num_tokens


@dataclass(frozen=True)
class Scores:
    """Every choice's score, and the meta_info of the calls that measured them."""

    choices: list[ChoiceScore]
    calls: list[dict[str, Any]]

    def best(self, normalize: bool = True) -> int:
        """Index of the highest-scoring choice (the first on a tie)."""
        keys = [c.normalized if normalize else c.logprob_sum for c in self.choices]
        return keys.index(max(keys))


def score_choices(
    generate: Callable[[dict[str, Any]], Any], prompt: str, choices: Sequence[str], window: int = WINDOW,
) -> Scores:
    """Score `choices` after `prompt` through `generate` (a Backend's /generate call)."""
    if not prompt:
        raise ValueError("select needs some text before it to score the choices against")
    head = generate({"text": prompt, "sampling_params": {"max_new_tokens": 0}})
    calls = [head["meta_info"]]
    num_prompt = head["meta_info"]["prompt_tokens"]
    while True:
        start = max(0, num_prompt - window)
        outs = generate({
            "text": [prompt, *(prompt + c for c in choices)],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": start,
        })
        calls += [o["meta_info"] for o in outs]
        tail = [t for _, t, _ in outs[0]["meta_info"]["input_token_logprobs"]]
        scored = [_choice_score(c, tail, o["meta_info"]["input_token_logprobs"], start) for c, o in zip(choices, outs[1:])]
        if all(s is not None for s in scored):
            return Scores(choices=scored, calls=calls)  # type: ignore[arg-type]
        window *= 4


def _choice_score(choice: str, prompt_tail: list[int], entries: list[list[Any]], start: int) -> ChoiceScore | None:
    """The tokens of prompt+choice after its common prefix with the prompt; None when the two
    differ already at `start` (the window was too short to see where they part)."""
    ids = [t for _, t, _ in entries]
    same = 0
    while same < min(len(ids), len(prompt_tail)) and ids[same] == prompt_tail[same]:
        same += 1
    if same == 0 and start > 0:
        return None
    rest = entries[same:]
    if not rest:
        raise ValueError(f"choice {choice!r} adds no tokens after the prompt")
    if start + same == 0:  # the very first token has no logprob: nothing came before it
        raise ValueError("select needs some text before it to score the choices against")
    # JSON has no -inf: the server sends an impossible token's logprob as null
    logprobs = tuple(float("-inf") if lp is None else lp for lp, _, _ in rest)
    return ChoiceScore(choice=choice, token_ids=tuple(t for _, t, _ in rest), token_logprobs=logprobs)
