"""The sampler: exact greedy, filters that really filter, seeds that really reproduce."""

from __future__ import annotations

import math

import torch

from radixserve.protocol import SamplingParams
from radixserve.worker.sampler import Sampler, SamplingState, token_logprobs

V = 50


def _logits(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _state(**kw) -> SamplingState:
    return SamplingState(SamplingParams(**kw), prompt_ids=[])


def test_greedy_is_exact_argmax_and_logprob_is_model_distribution():
    logits = _logits(0, rows=3)
    out = Sampler(V).sample(logits, [_state(temperature=0.0) for _ in range(3)])
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values.tolist()
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(out.logprobs.logprobs, expected))


def test_logprobs_only_for_rows_that_ask():
    logits = _logits(7, rows=4)
    states = [_state(temperature=0.0) for _ in range(4)]
    states[0].return_logprob = states[2].return_logprob = False
    states[3].top_logprobs_num = 2
    out = Sampler(V).sample(logits, states)
    full = torch.log_softmax(logits, -1)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs.logprobs[0] == out.logprobs.logprobs[2] == 0.0
    for i in (1, 3):
        assert math.isclose(out.logprobs.logprobs[i], float(full[i].max()), rel_tol=1e-6)
    assert [t for t, _ in out.logprobs.top[3]] == full[3].topk(2).indices.tolist()
    assert out.logprobs.top[0] == out.logprobs.top[1] == []


def test_top_k_1_is_greedy_even_at_high_temperature():
    logits = _logits(1)
    out = Sampler(V).sample(logits, [_state(temperature=5.0, top_k=1)])
    assert out.token_ids[0] == int(logits.argmax())


def test_top_k_restricts_to_k_best():
    logits = _logits(2)
    best3 = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(V)
    seen = {sampler.sample(logits, [_state(temperature=10.0, top_k=3, seed=s)]).token_ids[0] for s in range(200)}
    assert seen <= best3 and len(seen) == 3


def test_top_p_keeps_smallest_head_reaching_p():
    logits = torch.full((1, V), -20.0)
    logits[0, 7], logits[0, 9], logits[0, 11] = 5.0, 4.0, 0.0  # probs ~0.73, 0.27, ~0.005
    sampler = Sampler(V)
    seen = {sampler.sample(logits, [_state(temperature=1.0, top_p=0.8, seed=s)]).token_ids[0] for s in range(300)}
    assert seen == {7, 9}


def test_min_p_drops_unlikely_tokens():
    logits = torch.full((1, V), -20.0)
    logits[0, 3], logits[0, 4], logits[0, 5] = 5.0, 4.5, 1.0
    sampler = Sampler(V)
    seen = {sampler.sample(logits, [_state(temperature=1.0, min_p=0.1, seed=s)]).token_ids[0] for s in range(300)}
    assert seen == {3, 4}


def test_seed_reproduces_regardless_of_batch_neighbours():
    logits = _logits(3, rows=2)
    a = [Sampler(V).sample(logits[:1], [_state(temperature=1.0, seed=42)]).token_ids[0] for _ in range(3)]
    s1, s2 = _state(temperature=1.0, seed=42), _state(temperature=1.0)
    b = Sampler(V).sample(logits, [s1, s2]).token_ids[0]
    assert a == [a[0]] * 3 and b == a[0]
    # successive draws of one seeded request follow its own generator
    draws = _draws(_state(temperature=1.0, seed=7), logits[:1], 20)
    assert draws == _draws(_state(temperature=1.0, seed=7), logits[:1], 20)
    assert len(set(draws)) > 1


def _draws(state: SamplingState, logits: torch.Tensor, steps: int) -> list[int]:
    """`steps` tokens of one sample, each appended to its outputs as the worker does."""
    sampler = Sampler(V)
    for _ in range(steps):
        state.output_ids.append(sampler.sample(logits, [state]).token_ids[0])
    return state.output_ids


def test_a_seeded_sample_resumed_with_its_tokens_continues_the_same_sequence():
    """After an engine restart the worker gets a sample's tokens so far (NewRequest.output_ids):
    its next draws are those it would have made without the restart."""
    logits = _logits(5)
    whole = _draws(_state(temperature=1.0, seed=11), logits, 30)
    resumed = SamplingState(SamplingParams(temperature=1.0, seed=11), prompt_ids=[], output_ids=whole[:12])
    assert _draws(resumed, logits, 18) == whole
    other = _draws(_state(temperature=1.0, seed=12), logits, 30)
    assert other != whole


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.zeros(1, V)
    logits[0, 1], logits[0, 2] = 2.0, 1.5
    state = SamplingState(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt_ids=[1])
    assert Sampler(V).sample(logits, [state]).token_ids == [2]  # 2.0 / 2 = 1.0 < 1.5


def test_frequency_and_presence_penalties_count_output_tokens():
    logits = torch.zeros(1, V)
    logits[0, 1], logits[0, 2] = 2.0, 1.0
    state = SamplingState(SamplingParams(temperature=0.0, frequency_penalty=0.4), prompt_ids=[], output_ids=[1, 1, 1])
    assert Sampler(V).sample(logits, [state]).token_ids == [2]  # 2.0 - 1.2 < 1.0
    state = SamplingState(SamplingParams(temperature=0.0, presence_penalty=1.5), prompt_ids=[1], output_ids=[])
    assert Sampler(V).sample(logits, [state]).token_ids == [1]  # prompt tokens are not penalised
    state.output_ids.append(1)
    assert Sampler(V).sample(logits, [state]).token_ids == [2]


def test_logit_bias_moves_greedy_and_sampling_but_not_reported_logprobs():
    logits = _logits(5, rows=3)
    worst = int(logits[0].argmin())
    best = int(logits[1].argmax())
    states = [
        _state(temperature=0.0, logit_bias={worst: 100.0}),  # the least likely token becomes the choice
        _state(temperature=0.0, logit_bias={best: -100.0}),  # the best one is banned
        _state(temperature=0.0),  # an unbiased neighbour stays exact
    ]
    out = Sampler(V).sample(logits, states)
    assert out.token_ids[0] == worst
    assert out.token_ids[1] == int(logits[1].topk(2).indices[1])
    assert out.token_ids[2] == int(logits[2].argmax())
    expected = torch.log_softmax(logits[0], -1)[worst].item()
    assert math.isclose(out.logprobs.logprobs[0], expected, rel_tol=1e-6)  # the model's own distribution
    sampled = Sampler(V).sample(logits[:1], [_state(temperature=1.0, seed=3, logit_bias={worst: 100.0})])
    assert sampled.token_ids == [worst]


def test_token_logprobs_with_top_alternatives():
    logits = _logits(4, rows=2)
    lp = token_logprobs(logits, torch.tensor([0, 5]), [3, 0])
    ref = torch.log_softmax(logits, -1)
    assert math.isclose(lp.logprobs[0], ref[0, 0].item(), rel_tol=1e-6)
    assert [t for t, _ in lp.top[0]] == ref[0].topk(3).indices.tolist()
    assert lp.top[1] == []


def test_greedy_ties_pick_the_first_maximum_like_argmax():
    logits = torch.zeros(2, V)
    logits[0, [7, 3, 30]] = 5.0
    logits[1, [40, 41]] = 2.0
    out = Sampler(V).sample(logits, [_state(temperature=0.0), _state(temperature=0.0)])
    assert out.token_ids == [3, 40] == logits.argmax(-1).tolist()
