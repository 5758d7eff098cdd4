"""A Q4_K_M GGUF served over HTTP with its blocks kept quantized (the default
`--quantization gguf`): /server_info names the weight format, greedy output is the in-process
quantized model's token for token (first request and cache hit), n > 1 and a JSON schema run as
on dequantized weights, and pages balance."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from http_helpers import assert_pages_balanced
from paged_run import greedy

from bench.gguf_models import cached_model
from radixserve.kernels import cpu as cpu_kernels
from radixserve.models import load_model

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="the CPU kernels are off here")

NEW_TOKENS = 16
# a prompt prefilled in one chunk above WIDEN_ROWS (the weights widened), the same prompt
# extended by 132 tokens (its first 140 from the cache, 132 computed: widened again), and one
# of 7 (the quantized kernels throughout)
LONG = list(range(100, 240))
EXTENDED = LONG + list(range(300, 432))
SHORT = [7, 8, 9, 10, 11, 12, 13]


@pytest.fixture(scope="module")
def q4_k_m():
    return cached_model("tiny", "Q4_K_M")


@pytest.fixture(scope="module")
def server(start_server, q4_k_m):
    return start_server(q4_k_m, "--dtype", "float32", "--kv-pages", "256", "--page-size", "4", "--debug-checks")


def test_a_q4_k_m_file_is_served_quantized(server, q4_k_m):
    info = server.info()
    assert info["model"]["weight_format"] == "gguf Q4_K+Q6_K"  # llama.cpp's Q4_K_M mix
    model = load_model(q4_k_m, torch.float32).model
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    cases = [(LONG, [LONG], 0), (EXTENDED, [LONG, EXTENDED[len(LONG):]], len(LONG)), (SHORT, [SHORT], 0)]
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for prompt, chunks, cached in cases:
            r = client.post("/generate", json={"input_ids": prompt, "sampling_params": params})
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["cached_tokens"] == cached
            assert r.json()["output_ids"] == greedy(model, chunks, NEW_TOKENS, page_size=4, num_pages=128)
    assert_pages_balanced(server.wait_idle())


def test_n_samples_and_a_json_schema_on_quantized_weights(server, q4_k_m):
    """n > 1 and structured output run unchanged over the quantized layers: two greedy samples
    are the in-process greedy tokens, and a schema-constrained answer parses and validates."""
    model = load_model(q4_k_m, torch.float32).model
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "n": 2}
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"], "additionalProperties": False}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        r = client.post("/generate", json={"input_ids": SHORT, "sampling_params": params})
        assert r.status_code == 200, r.text
        want = greedy(model, [SHORT], NEW_TOKENS, page_size=4, num_pages=128)
        assert [sample["output_ids"] for sample in r.json()] == [want, want]
        constrained = {"temperature": 0.0, "max_new_tokens": 32, "json_schema": json.dumps(schema)}
        r = client.post("/generate", json={"input_ids": SHORT, "sampling_params": constrained})
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["text"])["n"] in (1, 2)
    assert_pages_balanced(server.wait_idle())
