"""What a prefill chunk costs of a step's budget (`--chunk-size`), counting its attention.

A step's prompt work is bounded so that the requests decoding beside it are not held up for
long: every running stream waits for the whole step. Counting a chunk by its tokens alone
assumes each token costs the same, but a token's attention grows with the context before it:
on SmolLM2-135M, attending to about 3,000 tokens costs as much as all of a token's linear
layers, so a 512-token chunk at the end of an 8k prompt does several times the work of the
prompt's first chunk, and every concurrent stream sees that step as one long gap.

So a computed token at context c (the tokens it attends to, itself included) costs
`1 + a * c` units of work, `a` being the model's `WorkerInfo.context_token_cost`, and a chunk is
held to what a prompt's first chunk of `--chunk-size` tokens costs. A chunk whose mean context is
no deeper than that first chunk's costs its tokens, as it always did: attention only ever
shortens chunks, deep in long contexts, and never lengthens one.
"""

from __future__ import annotations

import math
from collections.abc import Callable


class StepCost:
    """Chunk lengths and costs, in tokens of a step's budget, for one model and chunk size."""

    def __init__(self, chunk_size: int, context_token_cost: float) -> None:
        self._context_token_cost = context_token_cost
        # the work of a prompt's first full chunk, per token: the unit a budget token stands for
        self._unit = self._work_per_token(0, chunk_size)

    def _work_per_token(self, start: int, n: int) -> float:
        """Mean work of the tokens at positions [start, start + n): 1 + a * their mean context."""
        return 1.0 + self._context_token_cost * (start + (n + 1) / 2)

    def _factor(self, start: int, n: int) -> float:
        """How much more than its token count a chunk of n tokens at `start` costs (at least 1)."""
        return max(1.0, self._work_per_token(start, n) / self._unit)

    def cost(self, start: int, n: int, tokens: float | None = None) -> int:
        """Budget tokens spent by computing positions [start, start + n); `tokens` is their cost
        before attention when some cost less than a whole token (a blend's copies), else n."""
        return math.ceil((n if tokens is None else tokens) * self._factor(start, n))

    def prefill_len(self, start: int, left: int, budget: int) -> int:
        """The longest plain chunk from `start`, of at most `left` tokens, within `budget`; at
        least one token while any budget is left, so that no prompt stalls however deep."""
        n = min(left, budget)
        if n <= 0 or self.cost(start, n) <= budget:
            return max(0, n)
        # n tokens at start cost n * (1 + a * (start + (n + 1) / 2)): the largest n within
        # budget * unit is a quadratic's root, then rounded down past float error
        a = self._context_token_cost
        b = 1.0 + a * (start + 0.5)
        n = min(n, int((-b + math.sqrt(b * b + 2.0 * a * budget * self._unit)) / a))
        while n > 1 and self.cost(start, n) > budget:
            n -= 1
        return max(1, n)

    def blend_end(self, start: int, budget: int, reach: Callable[[float], int]) -> int:
        """A blend's chunk end from `start`: `reach(budget)` finds the furthest end whose cost
        before attention is within a budget. The span it reaches on the whole budget bounds the
        chunk's mean context from above, so the budget shrunk by that span's factor gives a
        chunk that fits. When not even its first recompute group fits that, the chunk is the one
        the whole budget reaches, as without attention: a blend never stalls."""
        span = reach(float(budget)) - start
        factor = self._factor(start, span)
        end = reach(budget / factor) if factor > 1.0 else start + span
        return end if end > start else start + span
