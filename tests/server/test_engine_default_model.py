"""Exactness of the whole runtime on the default model (SmolLM2-135M-Instruct, fp32, its GGUF
dequantized: `quantization="none"`): greedy outputs through `Engine` equal transformers' greedy
`generate`, token for token, with chunked prefill, page sizes 1 and 16, and cache hits."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from radixserve.tokenizer import apply_chat_template, load_tokenizer

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a radix tree is in two sentences.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def chat_prompts(default_model_dir) -> list[list[int]]:
    tok = load_tokenizer(default_model_dir)
    return [apply_chat_template(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_outputs(hf_default_model, chat_prompts) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in chat_prompts:
            ids = torch.tensor([p])
            gen = hf_default_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
            )
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("page_size,chunk_size", [(16, 16), (1, 24)])
def test_greedy_equals_transformers_with_chunks_and_cache_hits(chat_prompts, hf_outputs, page_size, chunk_size):
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}
    with Engine(model="default", dtype="float32", quantization="none", page_size=page_size, chunk_size=chunk_size,
                kv_pages=8192 // page_size, debug_checks=True) as engine:
        first = engine.generate(input_ids=chat_prompts, sampling_params=params)
        assert [o["output_ids"] for o in first] == hf_outputs
        second = engine.generate(input_ids=chat_prompts, sampling_params=params)
        assert [o["output_ids"] for o in second] == hf_outputs
        assert [o["text"] for o in second] == [o["text"] for o in first]
        for p, o in zip(chat_prompts, second):
            assert o["meta_info"]["cached_tokens"] == (len(p) - 1) // page_size * page_size > 0
        stats = engine.get_stats()
        assert stats["free_pages"] + stats["cached_pages"] == stats["total_pages"]


def test_dtype_auto_is_bf16_here_and_stays_sane(chat_prompts, hf_outputs):
    """dtype auto picks bf16 from the avx2 ISA tier up (the faster choice there); its greedy
    answers must still agree with fp32 transformers on where they start. The weights are
    dequantized, as transformers' are: the quantized kernels' int8 activations answer the
    capital question as llama.cpp does, "L'Étoile, ..." (docs/models.md), which is not what
    this test is about."""
    from radixserve.worker.device import cpu_prefers_bf16

    with Engine(model="default", quantization="none", kv_pages=512) as engine:
        assert engine.ready.dtype == ("bfloat16" if cpu_prefers_bf16() else "float32")
        outs = engine.generate(input_ids=chat_prompts, sampling_params={"temperature": 0.0, "max_new_tokens": NEW_TOKENS})
    assert "Paris" in outs[0]["text"]
    agree = [o["output_ids"][:4] == ref[:4] for o, ref in zip(outs, hf_outputs)]
    assert sum(agree) >= 4, [o["text"] for o in outs]


def test_the_readme_engine_example_runs_as_a_script(tmp_path):
    """Saved to a file and run, the README's Engine example works as written: no
    `if __name__ == "__main__":` guard, since the spawned children do not re-run the script."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "from radixserve import Engine" in b)
    assert "__main__" not in example
    script = tmp_path / "example.py"
    script.write_text(example)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'completion_tokens': 16" in out.stdout, out.stdout
