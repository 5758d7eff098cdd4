"""Turning logits into next tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

Greedy rows take an exact argmax of the raw logits (after penalties), so greedy outputs match
Hugging Face's greedy `generate`. Reported logprobs are always those of the model's own
distribution (log-softmax of the raw logits), whatever the sampling settings, which is what
scoring (`select`) and OpenAI-style `logprobs` expect.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.protocol import SamplingParams


@dataclass
class SamplingState:
    """A request's sampling inputs that live on the worker for its whole life."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)  # sampled so far (a resumed sample's too)
    top_logprobs_num: int = 0
    return_logprob: bool = True  # False: skip the log-softmax over the vocabulary for this row
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    def generator(self) -> torch.Generator | None:
        """The request's generator for its next token, or None (no seed: the shared one).

        A seeded sample's draws depend only on (seed, step), step being the number of tokens
        it sampled before: a sample resumed on a fresh engine after a crash, with its tokens so
        far, continues the very sequence it would have sampled without the crash.
        """
        if self.params.seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator()
        return self._generator.manual_seed(step_seed(self.params.seed, len(self.output_ids)))


def step_seed(seed: int, step: int) -> int:
    """A 64-bit seed for draw `step` of a sample seeded `seed` (splitmix64 of the pair), so
    neighbouring seeds and steps give unrelated streams."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of chosen tokens, with the top alternatives when asked."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per token: (token id, logprob), best first; [] if not asked


@dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: list[int]) -> TokenLogprobs:
    """Logprobs of `token_ids` under `logits` ([N, V] raw), with `top_n[i]` alternatives for row i."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, token_ids.view(-1, 1)).squeeze(1).tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in range(logits.shape[0])]
    k = max(top_n, default=0)
    if k > 0:
        values, indices = logp.topk(k, dim=-1)
        values, indices = values.tolist(), indices.tolist()
        for i, n in enumerate(top_n):
            top[i] = list(zip(indices[i][:n], values[i][:n]))
    return TokenLogprobs(chosen, top)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmasks(logits: torch.Tensor, bitmasks: list[bytes]) -> torch.Tensor:
    """Set to -inf, in place, the logits of tokens a row's bitmask leaves out (bit `t % 32` of
    little-endian int32 word `t // 32` set = token t allowed; xgrammar's layout). Rows with an
    empty bitmask are left alone; token ids past the bitmask's end are never allowed."""
    rows = [i for i, b in enumerate(bitmasks) if b]
    if not rows:
        return logits
    device = logits.device
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = torch.stack([torch.frombuffer(bytearray(bitmasks[i]), dtype=torch.int32) for i in rows]).to(device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [rows, words * 32]
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(rows, device=device)
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab], float("-inf"))
    return logits


class Sampler:
    """Samples one token per row of logits, each row with its own request's settings."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._shared_generator = torch.Generator()

    def seed(self, seed: int) -> None:
        """Seed the generator used by requests that bring no seed of their own."""
        self._shared_generator.manual_seed(seed)

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, states: list[SamplingState], bitmasks: list[bytes] | None = None,
    ) -> SampleOutput:
        """logits: [B, V] for B requests in `states`' order. Returns one token id per request.

        `bitmasks[i]`, when not empty, allows only the tokens whose bit is set in row i (a
        grammar's next tokens, from the scheduler): the rest get -inf after penalties and bias,
        before greedy or sampled choice. Logprobs stay those of the model's distribution.
        """
        raw = logits.float()
        logits = self._apply_penalties(raw, states)
        if bitmasks is not None and any(bitmasks):
            logits = apply_token_bitmasks(logits if logits is not raw else raw.clone(), bitmasks)
        greedy = [s.params.is_greedy for s in states]
        # max().indices: the same first-maximum index as argmax, about twice as fast on the CPU
        next_ids = logits.max(dim=-1).indices  # [B]
        sampled_rows = [i for i, g in enumerate(greedy) if not g]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            picked = self._sample_rows(logits[rows], [states[i] for i in sampled_rows])
            next_ids[rows] = picked
        return SampleOutput(next_ids.tolist(), self._logprobs(raw, next_ids, states))

    @staticmethod
    def _logprobs(raw: torch.Tensor, next_ids: torch.Tensor, states: list[SamplingState]) -> TokenLogprobs:
        """Logprobs of the sampled tokens for the rows that asked; 0.0 and no alternatives for the
        rest (a log-softmax over the vocabulary per row is a real cost at decode batch sizes)."""
        rows = [i for i, s in enumerate(states) if s.return_logprob]
        if len(rows) == len(states):
            return token_logprobs(raw, next_ids, [s.top_logprobs_num for s in states])
        logprobs, top = [0.0] * len(states), [[] for _ in states]
        if rows:
            index = torch.tensor(rows, device=raw.device)
            lp = token_logprobs(raw[index], next_ids[index], [states[i].top_logprobs_num for i in rows])
            for k, i in enumerate(rows):
                logprobs[i], top[i] = lp.logprobs[k], lp.top[k]
        return TokenLogprobs(logprobs, top)

    def _apply_penalties(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        rows = [i for i, s in enumerate(states) if s.params.uses_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        device = logits.device
        for i in rows:
            p = states[i].params
            out = torch.tensor(states[i].output_ids, dtype=torch.int64, device=device)
            if p.repetition_penalty != 1.0:
                seen = torch.cat([torch.tensor(states[i].prompt_ids, dtype=torch.int64, device=device), out]).unique()
                vals = logits[i, seen]
                logits[i, seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
            if out.numel() and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
                counts = torch.bincount(out, minlength=self.vocab_size).to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=device)
        return logits

    def _sample_rows(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Temperature, then top-k, top-p and min-p on the sorted distribution, then one draw per row."""
        device = logits.device
        temps = torch.tensor([s.params.temperature for s in states], dtype=logits.dtype, device=device)
        probs_sorted, order = torch.sort(torch.softmax(logits / temps[:, None], dim=-1), dim=-1, descending=True)
        keep = torch.ones_like(probs_sorted, dtype=torch.bool)
        rank = torch.arange(probs_sorted.shape[1], device=device)
        for i, s in enumerate(states):
            p = s.params
            if p.top_k > 0:
                keep[i] &= rank < p.top_k
            if p.top_p < 1.0:
                # keep the smallest head whose mass reaches top_p (the first token always stays)
                before = probs_sorted[i].cumsum(0) - probs_sorted[i]
                keep[i] &= before < p.top_p
            if p.min_p > 0.0:
                keep[i] &= probs_sorted[i] >= p.min_p * probs_sorted[i, 0]
        keep[:, 0] = True
        probs_sorted = probs_sorted * keep
        picked = torch.empty(len(states), dtype=torch.int64, device=device)
        for i, s in enumerate(states):
            gen = s.generator() or self._shared_generator
            # exponential race: argmax(p / E) with E ~ Exp(1) draws index j with probability p_j.
            # The noise comes from the request's CPU generator on every device, so a seed gives
            # the same draws on CPU and CUDA (a device-side sampler would be faster on CUDA).
            noise = torch.empty(probs_sorted.shape[1], dtype=probs_sorted.dtype).exponential_(generator=gen)
            noise = noise.to(device)
            picked[i] = order[i, torch.argmax(probs_sorted[i] / noise)]
        return picked
