"""Speculative decoding by prompt lookup (`speculative_algorithm="ngram"`): the same outputs as
without it, token for token, with drafts really accepted.

A random tiny model (real tokenizer) falls into loops, so its own output soon repeats and the
drafter has spans to propose; prompts that quote themselves add more. Greedy output, seeded
sampling (a draw depends only on seed and step, so it is the same draw with or without a
draft), stop strings, logprobs, n > 1, chunked prefill and retraction under a tiny pool, at
page sizes 1 and 16. Unseeded sampling is checked by its distribution: an 8-token model's
samples with speculation against those without, by a chi-square statistic.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_helpers import make_tiny_chat_model
from transformers import AutoModelForCausalLM

from radixserve import Engine
from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import isa

DOC = "The river flows north to the sea, past the mill and the old stone bridge. " * 6
PROMPTS = [DOC + "Quote the text:", "Hello there, how are you today?", DOC[:120] + " and then", "1 2 3 4 5 6 7 8"]
# every sequence of these batches may draft (the default stops at 8 decoding)
SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4, "speculative_max_batch_size": 64}
SMALL_VOCAB = 8  # the distribution test's model: its bigrams are 64 cells


@pytest.fixture(scope="module")
def echo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model that mostly repeats itself: its layers are nearly silent, so the tied LM head
    scores the embedding of the last token highest. Its loops give the drafter spans to propose
    that are accepted, partly or whole."""
    path = make_tiny_chat_model(tmp_path_factory.mktemp("spec_echo") / "model", seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(0.05)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 8-token model whose next token repeats the last one with probability 0.4-0.6 and is
    spread over the others otherwise (small embeddings, nearly silent layers): its samples
    run in repeats that the drafter proposes and that are often accepted, and its
    distributions are wide enough that a bias in what is accepted shows. One attention head
    of 64 (a head size the CPU prefill kernel serves: checking drafts is fast)."""
    path = make_tiny_chat_model(tmp_path_factory.mktemp("spec_small") / "model", vocab_size=SMALL_VOCAB,
                                num_attention_heads=1, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.04 if "embed" in name else 0.03))
    model.save_pretrained(path)
    return path


def _outputs(tiny_dir: Path, options: dict, params: list[dict], **kwargs) -> list[dict]:
    with Engine(model=str(tiny_dir), dtype="float32", **options) as engine:
        return engine.generate([p for p in PROMPTS for _ in params], [q for _ in PROMPTS for q in params], **kwargs)


def _same(plain: list[dict], spec: list[dict], logprobs: bool = False) -> int:
    """Assert equal outputs; return how many draft tokens were accepted in all."""
    assert len(plain) == len(spec)
    for a, b in zip(plain, spec, strict=True):
        assert b["output_ids"] == a["output_ids"] and b["text"] == a["text"]
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
        assert "spec_accepted_tokens" not in a["meta_info"]
        if logprobs:
            got = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
            want = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(want, abs=1e-4)
    return sum(b["meta_info"]["spec_accepted_tokens"] for b in spec)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_seeded_stop_strings_and_n_are_unchanged(tiny_dir, echo_dir, page_size):
    params = [
        {"max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True},
        {"max_new_tokens": 60, "temperature": 0.9, "top_p": 0.95, "seed": 7, "ignore_eos": True},
        {"max_new_tokens": 60, "temperature": 0.0, "stop": ["the", "ing"], "ignore_eos": True},
        {"max_new_tokens": 40, "temperature": 0.7, "seed": 3, "n": 2, "ignore_eos": True},
    ]
    options = {"page_size": page_size, "kv_pages": 8192 // page_size}
    # the random model drafts little (its rejections are the echo model's too): one page size
    for model in (tiny_dir, echo_dir) if page_size == 1 else (echo_dir,):
        plain = _outputs(model, options, params)
        spec = _outputs(model, {**options, **SPEC}, params)
        accepted = _same(plain, spec)
    assert accepted > 200  # the echo model's drafts were really accepted


def test_logprobs_chunked_prefill_and_retraction_are_unchanged(echo_dir):
    params = [{"max_new_tokens": 50, "temperature": 0.0, "ignore_eos": True}]
    # a pool of 96 pages of 4 tokens for 4 requests of up to ~190 tokens: retractions happen
    options = {"page_size": 4, "kv_pages": 96, "chunk_size": 16, "max_running_requests": 4}
    kwargs = {"return_logprob": True, "top_logprobs_num": 2}
    plain = _outputs(echo_dir, options, params, **kwargs)
    spec = _outputs(echo_dir, {**options, **SPEC}, params, **kwargs)
    assert _same(plain, spec, logprobs=True) > 20


def _bigram_counts(prompt: list[int], outputs: list[list[int]]) -> torch.Tensor:
    """[samples, V * V]: how often each pair of consecutive tokens occurs in each sample's
    output (its first token paired with the prompt's last)."""
    counts = torch.zeros(len(outputs), SMALL_VOCAB * SMALL_VOCAB, dtype=torch.float64)
    for i, out in enumerate(outputs):
        seq = [prompt[-1], *out]
        for a, b in zip(seq, seq[1:]):
            counts[i, a * SMALL_VOCAB + b] += 1
    return counts


def _chi_square(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pearson's statistic of the 2 x C contingency table of pooled counts `a`, `b` ([..., C]),
    over the columns either one has."""
    table = torch.stack([a, b], dim=-2)  # [..., 2, C]
    expected = table.sum(-1, keepdim=True) * table.sum(-2, keepdim=True) / table.sum((-2, -1), keepdim=True)
    seen = expected > 0
    return torch.where(seen, (table - expected) ** 2 / expected.where(seen, 1.0), 0.0).sum((-2, -1))


def _permutation_p_value(x: torch.Tensor, y: torch.Tensor, permutations: int, seed: int) -> float:
    """p-value of the chi-square statistic of `x`'s and `y`'s pooled per-sample counts, its null
    distribution from random relabellings of the samples. The bigrams of one sample are not
    independent (a repeat makes the next one likelier), so the chi-square distribution itself
    would understate the statistic's spread; the samples are, so relabelling them is exact."""
    observed = _chi_square(x.sum(0), y.sum(0))
    both = torch.cat([x, y])
    gen = torch.Generator().manual_seed(seed)
    in_x = (torch.rand(permutations, len(both), generator=gen).argsort(dim=1) < len(x)).to(both.dtype)
    null = _chi_square(in_x @ both, (1 - in_x) @ both)
    return (int((null >= observed).sum()) + 1) / (permutations + 1)


def test_unseeded_sampling_is_distributed_as_without_speculation(small_vocab_dir):
    """Without a seed a draft is checked with draws from the shared generator, so the tokens
    differ from plain sampling's: their distribution must not. 1,024 samples each way, 24
    tokens at temperature 1 with top-k and top-p, compared by the chi-square statistic of
    their bigram counts; at these sizes it tells exact checking from one that accepts a
    rejected draft token one time in five (tried by hand). The engines' and the relabelling's
    generators are seeded, so a run repeats itself closely; it passes at p > 0.001."""
    prompt = [3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7, 3, 3]
    params = {"max_new_tokens": 24, "temperature": 1.0, "top_k": 6, "top_p": 0.95, "ignore_eos": True}
    counts, accepted = [], 0
    for options in ({}, SPEC):
        # one thread: a tiny model's many small ops only wait for each other on a busy machine
        with Engine(model=str(small_vocab_dir), dtype="float32", seed=0, num_threads=1, **options) as engine:
            # 64 at a time: a batch that fits in the running set drafts once it has prefilled
            outs = [o for _ in range(16) for o in engine.generate(input_ids=[prompt] * 64, sampling_params=params)]
        assert all(len(o["output_ids"]) == 24 for o in outs)
        counts.append(_bigram_counts(prompt, [o["output_ids"] for o in outs]))
        accepted = sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in outs)
    assert accepted > 1000  # of 24,576 tokens: verification really chose between draft and draw
    assert _permutation_p_value(*counts, permutations=4000, seed=0) > 1e-3


def test_the_option_validates_and_takes_sglang_spelling():
    from radixserve.config import ServerConfig

    assert ServerConfig(speculative_algorithm="NGRAM").speculative_algorithm == "ngram"
    with pytest.raises(ValueError, match="ngram"):
        ServerConfig(speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="max_match_window"):
        ServerConfig(speculative_ngram_min_match_window_size=5, speculative_ngram_max_match_window_size=3)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_the_default_model_quoting_its_document_is_unchanged_and_drafts_are_accepted(page_size):
    """fp32 on any tier (bf16: the test below)."""
    from pydoc_data.topics import topics

    doc = topics["for"][:900]
    prompts = [doc + "\n\nRepeat the text above word for word:\n", "Write a short poem about autumn leaves."]
    params = {"max_new_tokens": 48, "temperature": 0.0}
    outs = []
    for extra in ({}, SPEC):
        with Engine(model="default", dtype="float32", page_size=page_size, chunk_size=256, **extra) as engine:
            outs.append(engine.generate(prompts, [params] * len(prompts)))
    assert _same(*outs) > 10
    assert outs[1][0]["meta_info"]["spec_accepted_tokens"] > 10  # the quote is drafted from the document


@pytest.mark.slow
def test_bf16_on_the_cpu_is_unchanged_too():
    """bf16 where the CPU's check computes what a decode step does (its rows attended as decode
    rows, the panel linears summing each row alone: docs/models.md). Three of the serving
    benchmark's quote requests, which came out different from plain decoding on a Zen 3 (avx2)
    while checks of 3 tokens and more went through the prefill kernel, rounded otherwise. Where
    torch's bf16 matmuls serve (amx) a many-token forward rounds as another batch would, and a
    near-tie can flip."""
    from bench.serving import load_tokenizer
    from bench.workloads import build

    if not cpu_kernels.linear_serves(torch.bfloat16, 576):
        pytest.skip(f"the panel linears do not serve bf16 at the {isa.selected_tier()} tier")
    roots = build("quote", load_tokenizer("default"), seed=0).roots
    prompts = [roots[i].text for i in (2, 12, 13)]
    params = {"max_new_tokens": 24, "temperature": 0.0}
    outs = []
    for extra in ({}, SPEC):
        with Engine(model="default", dtype="bfloat16", **extra) as engine:
            outs.append(engine.generate(prompts, [params] * len(prompts)))
    assert _same(*outs) > 0  # and drafts were kept
