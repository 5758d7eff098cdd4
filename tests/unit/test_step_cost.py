"""The step budget counts a prefill chunk's attention (scheduler/step_cost.py): deep in a long
context a chunk gets shorter, so that no step's prompt work exceeds a prompt's first chunk."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixserve.models.config import ModelConfig
from radixserve.scheduler.step_cost import StepCost

SMOLLM2_135M = {  # the default model's shape (its config.json, less what does not matter here)
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True,
}


def work(a: float, start: int, n: int) -> float:
    """Each token's work summed: 1 for its linear layers, a per token of context it attends to."""
    return sum(1.0 + a * (p + 1) for p in range(start, start + n))


def test_the_default_models_attention_equals_its_linear_layers_at_3072_tokens_of_context():
    # q/k/v/o: 576 x (576 + 192 + 192 + 576), MLP 3 x 576 x 1536; QK^T and PV: 2 x 9 x 64
    assert ModelConfig.from_dict(SMOLLM2_135M).context_token_cost == pytest.approx(1 / 3072)


@given(start=st.integers(0, 20_000), left=st.integers(1, 5_000), budget=st.integers(1, 512))
def test_without_attention_cost_a_chunk_is_its_tokens(start, left, budget):
    cost = StepCost(512, 0.0)
    n = cost.prefill_len(start, left, budget)
    assert n == min(left, budget)
    assert cost.cost(start, n) == n


@given(start=st.integers(0, 40_000), left=st.integers(1, 5_000), chunk=st.sampled_from((16, 64, 512, 2048)),
       a=st.sampled_from((1 / 320, 1 / 3072, 1 / 24_576)))
def test_a_full_steps_chunk_is_the_longest_whose_work_is_within_a_first_chunks(start, left, chunk, a):
    cost = StepCost(chunk, a)
    n = cost.prefill_len(start, left, chunk)
    first = work(a, 0, chunk)
    assert 1 <= n <= min(left, chunk)
    assert n == 1 or work(a, start, n) <= first * (1 + 1e-9)
    if n < min(left, chunk):  # one more token would have been over
        assert work(a, start, n + 1) > first * (1 - 1e-9)
    assert cost.cost(start, n) <= chunk or n == 1


def test_chunks_shorten_deep_in_a_long_prompt_and_a_first_chunk_is_whole():
    cost = StepCost(512, 1 / 3072)
    assert cost.prefill_len(0, 10_000, 512) == 512  # a prompt's first chunk as before
    assert cost.prefill_len(0, 300, 512) == 300
    lengths = [cost.prefill_len(start, 10_000, 512) for start in (512, 2048, 4096, 7680)]
    assert lengths == sorted(lengths, reverse=True) and lengths[-1] < 512 / 3


@given(start=st.integers(0, 10_000_000), budget=st.integers(1, 512))
def test_a_prompt_never_stalls_however_deep_and_however_little_budget_is_left(start, budget):
    assert StepCost(512, 1 / 320).prefill_len(start, 100, budget) >= 1


@given(start=st.integers(0, 30_000), budget=st.integers(1, 512), group=st.integers(1, 128),
       copy=st.sampled_from((1.0, 0.1)))
def test_a_blends_chunk_fits_the_budget_with_its_attention(start, budget, group, copy):
    """`reach` here: whole groups of `group` tokens, each costing group * copy before attention."""
    a = 1 / 3072
    cost = StepCost(512, a)

    def reach(b: float) -> int:
        return start + group * int(b // (group * copy))

    end = cost.blend_end(start, budget, reach)
    n, span = end - start, reach(float(budget)) - start
    if span == 0:
        assert n == 0  # not even a group fits the budget without attention: as before
    elif cost.cost(start, n, n * copy) > budget:
        # the no-stall fallback, only when no group fits the budget shrunk for the span's depth
        factor = max(1.0, work(a, start, span) / span / (work(a, 0, 512) / 512))
        assert n == span and reach(budget / factor) == start
