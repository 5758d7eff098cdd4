"""The CUDA path on a GPU: FlashInfer against torch_native, against transformers, graphs against eager.

Every test is marked `gpu` and skipped where torch sees no CUDA device; the ones that need
FlashInfer fail (not skip) when it is missing and RADIXSERVE_REQUIRE_FLASHINFER=1, so a GPU
check cannot pass by skipping. All models here use head size 128 and a GQA group of 4, so one
FlashInfer JIT module per dtype serves prefill and decode (plus one CUDA-core decode module for
the group-1 case).

Tolerances, stated once:
- kernel outputs, random q/k/v: bf16 atol = rtol = 2e-2; fp16 atol = rtol = 3e-3 (8 and 11
  significant bits; the two implementations round P and the running softmax differently);
- logits of a random model in bf16: max |diff| <= 5% of the largest |logit| (a CPU dry run
  with a float32 reference attention in place of FlashInfer measured up to 2.0% against
  transformers and torch_native in bf16; a wrong mask or page is off by O(100%));
- greedy: each token we pick must be within 5% of the largest |logit| of transformers' best
  logit at that step, teacher-forced on our sequence (near-ties may legitimately flip in bf16).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
LOGIT_REL = 5e-2  # of the largest |logit| (about 10 here); see the module docstring


@pytest.fixture(scope="module")
def flashinfer():
    if os.environ.get("RADIXSERVE_REQUIRE_FLASHINFER") == "1":
        import flashinfer

        return flashinfer
    return pytest.importorskip("flashinfer")


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory):
    from conftest import save_tiny_model
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=512, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=1024,
        rms_norm_eps=1e-5,
    )
    return save_tiny_model(config, tmp_path_factory.mktemp("gpu_model") / "llama_gqa4_d128", seed=11)


# ---------------------------------------------------------------------- kernels


def _random_pools(page_size, heads, kv_heads, dtype, num_pages=300, seed=0, kv_format=None):
    """Two pools holding the same random pages (of `kv_format`'s storage, the model dtype's by
    default)."""
    from radixserve.attention.kv_pool import KVPool

    a = KVPool(1, num_pages, page_size, kv_heads, 128, dtype, "cuda", kv_format)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for pages in (a.k[0], a.v[0]):
        pages.copy_(torch.randn(pages.shape, generator=g, device="cuda", dtype=dtype))  # cast to the storage
    b = KVPool(1, num_pages, page_size, kv_heads, 128, dtype, "cuda", kv_format)
    b.k[0].copy_(a.k[0])
    b.v[0].copy_(a.v[0])
    return a, b


def _batch(rng, page_size, kinds, num_pages):
    """kinds: decode (1 new token over a context), prefill (no prefix), cached (a chunk over a
    prefix). Every request gets its own shuffled pages, so no two write the same slot."""
    from radixserve.attention.base import AttentionBatch

    prefix, extend = [], []
    for kind in kinds:
        prefix.append(0 if kind == "prefill" else rng.randint(1, 700))
        extend.append(1 if kind == "decode" else rng.randint(2, 300))
    width = max(-(-(p + e) // page_size) for p, e in zip(prefix, extend))
    pages = rng.sample(range(num_pages), width * len(kinds))
    table = [pages[i * width : (i + 1) * width] for i in range(len(kinds))]
    return AttentionBatch(page_size, torch.tensor(table, device="cuda"), prefix, extend)


@pytest.mark.parametrize(
    "dtype, group", [(torch.bfloat16, 4), (torch.float16, 4), (torch.bfloat16, 1)], ids=["bf16-gqa4", "fp16-gqa4", "bf16-mha"]
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_matches_torch_native(flashinfer, dtype, group, page_size):
    from radixserve.attention import create_backend
    from radixserve.attention.base import AttentionShape

    kv_heads = 8 // group
    heads = kv_heads * group
    shape = AttentionShape(heads, kv_heads, 128, 128**-0.5)
    num_pages = 8000 if page_size == 1 else 500
    rng = random.Random(page_size)
    for kinds in (["cached", "prefill", "decode", "cached", "decode"], ["decode"] * 7, ["prefill"]):
        pool_fi, pool_ref = _random_pools(page_size, heads, kv_heads, dtype, num_pages)
        fi = create_backend("flashinfer", pool_fi, shape, "cuda")
        ref = create_backend("torch_native", pool_ref, shape, "cuda")
        batch = _batch(rng, page_size, kinds, num_pages)
        t = batch.num_tokens
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(t, heads, 128, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(t, kv_heads, 128, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(t, kv_heads, 128, device="cuda", dtype=dtype, generator=g)
        fi.plan(batch)
        ref.plan(batch)
        out_fi, out_ref = fi.forward(q, k, v, 0), ref.forward(q, k, v, 0)
        torch.testing.assert_close(out_fi, out_ref, atol=TOL[dtype], rtol=TOL[dtype], msg=lambda m, kinds=kinds: f"{kinds}: {m}")
        assert torch.equal(pool_fi.k[0], pool_ref.k[0]) and torch.equal(pool_fi.v[0], pool_ref.v[0])


# ---------------------------------------------------------------------- a model


class Runner:
    """Our model runner over a shuffled pool (on CUDA unless `device` says); rows are requests."""

    def __init__(self, model_dir, backend: str, page_size: int = 16, graphs: list[int] | None = None,
                 kv_cache_dtype: str = "auto", device: str = "cuda"):
        from radixserve.attention import create_backend
        from radixserve.attention.kv_pool import KVPool
        from radixserve.kernels.kv_quant import kv_format
        from radixserve.models.loader import load_model
        from radixserve.worker.model_runner import ModelRunner
        from radixserve.worker.page_table import PageTable

        loaded = load_model(str(model_dir), dtype=torch.bfloat16, device=device)
        self.model = loaded.model
        shape = self.model.attention_shape()
        self.pool = KVPool(loaded.config.num_layers, 512, page_size, shape.num_kv_heads, shape.head_dim, torch.bfloat16,
                           device, kv_format(kv_cache_dtype, torch.bfloat16))
        self.table = PageTable(16, 64, device)
        self.runner = ModelRunner(self.model, self.table, create_backend(backend, self.pool, shape, device))
        if graphs:
            self.runner.capture_decode_graphs(graphs)
        self.free = list(range(512))
        random.Random(0).shuffle(self.free)
        self.page_size = page_size
        self.lengths: dict[int, int] = {}

    def step(self, rows_tokens: list[tuple[int, list[int]]]) -> torch.Tensor:
        from radixserve.worker.model_runner import SequenceChunk

        chunks = []
        for row, tokens in rows_tokens:
            done = self.lengths.get(row, 0)
            need = -(-(done + len(tokens)) // self.page_size) - self.table.num_pages(row)
            self.table.append(row, [self.free.pop() for _ in range(max(0, need))])
            chunks.append(SequenceChunk(row, done, tokens))
            self.lengths[row] = done + len(tokens)
        return self.runner.forward(chunks).last_logits

    def greedy(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        out = [[] for _ in prompts]
        logits = self.step(list(enumerate(prompts)))
        for _ in range(steps):
            nxt = logits.argmax(-1).tolist()
            for i, t in enumerate(nxt):
                out[i].append(t)
            logits = self.step([(i, [t]) for i, t in enumerate(nxt)])
        return out


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(5, 200))] for _ in range(n)]


def _hf_logits(model_dir, seq: list[int]) -> torch.Tensor:
    """transformers' bf16 logits [L, V] of every position of `seq`, on the GPU."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        return hf(torch.tensor([seq], device="cuda")).logits[0].float()


def _assert_greedy_close(model_dir, prompt: list[int], generated: list[int]) -> None:
    """Each generated token is transformers' argmax, or within LOGIT_REL * scale of it."""
    logits = _hf_logits(model_dir, prompt + generated)
    scale = float(logits.abs().max())
    for j, token in enumerate(generated):
        step = logits[len(prompt) - 1 + j]
        gap = float(step.max() - step[token])
        assert gap <= LOGIT_REL * scale, f"step {j}: our token is {gap:.3f} below transformers' best (scale {scale:.1f})"


def test_greedy_matches_transformers(flashinfer, gqa_model_dir):
    prompts = _prompts(4, 512)
    generated = Runner(gqa_model_dir, "flashinfer").greedy(prompts, steps=16)
    fi_logits = Runner(gqa_model_dir, "flashinfer").step(list(enumerate(prompts)))
    native_logits = Runner(gqa_model_dir, "torch_native").step(list(enumerate(prompts)))
    for i, (prompt, gen) in enumerate(zip(prompts, generated)):
        hf_last = _hf_logits(gqa_model_dir, prompt)[-1]
        scale = float(hf_last.abs().max())
        assert float((fi_logits[i] - hf_last).abs().max()) <= LOGIT_REL * scale
        assert float((fi_logits[i] - native_logits[i]).abs().max()) <= LOGIT_REL * scale
        _assert_greedy_close(gqa_model_dir, prompt, gen)


def test_cuda_graph_decode_equals_eager(flashinfer, gqa_model_dir):
    eager = Runner(gqa_model_dir, "flashinfer")
    graphed = Runner(gqa_model_dir, "flashinfer", graphs=[1, 2, 4, 8])
    assert graphed.runner.graphs is not None
    prompts = _prompts(6, 512, seed=1)
    rng = random.Random(2)
    for r in (eager, graphed):
        r.step(list(enumerate(prompts)))
    for rows in ([0, 1, 2, 3, 4], [5], [2, 0, 4], list(range(6)), [1, 3], [0, 1, 2, 3, 4, 5]):
        tokens = [(row, [rng.randrange(512)]) for row in rows]
        e, g = eager.step(tokens), graphed.step(tokens)
        scale = float(e.abs().max())
        torch.testing.assert_close(g, e, atol=LOGIT_REL * scale, rtol=LOGIT_REL)
    pad = graphed.pool.pad_page
    for layer in range(graphed.pool.num_layers):  # padding wrote only the pad page
        for ours, ref in ((graphed.pool.k[layer], eager.pool.k[layer]), (graphed.pool.v[layer], eager.pool.v[layer])):
            scale = float(ref[:pad].abs().max())
            torch.testing.assert_close(ours[:pad], ref[:pad], atol=LOGIT_REL * scale, rtol=LOGIT_REL)


def test_worker_on_cuda_picks_flashinfer_and_graphs(flashinfer, gqa_model_dir):
    from radixserve.config import ServerConfig
    from radixserve.protocol import Chunk, ForwardBatch, NewRequest, SamplingParams
    from radixserve.worker.worker import Worker

    config = ServerConfig(model=str(gqa_model_dir), device="auto", dtype="bfloat16", kv_pages=256, max_running_requests=8)
    worker = Worker(config)
    assert type(worker.runner.backend).__name__ == "FlashInferBackend"
    assert sorted(worker.runner.graphs.sizes) == [1, 2, 4, 8]
    prompt = _prompts(1, 512, seed=3)[0]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    pages = list(range(-(-(len(prompt) + 8) // 16)))
    out = worker.step(ForwardBatch(
        chunks=[Chunk("a", 0, 0, prompt, sample=True)],
        new_requests=[NewRequest("a", sampling)],
        assigned=[(0, pages)],
    ))
    tokens = [out.results[0].next_token_id]
    for _ in range(6):  # decode steps of batch 1: replayed from the size-1 graph
        out = worker.step(ForwardBatch(chunks=[Chunk("a", 0, len(prompt) + len(tokens) - 1, [tokens[-1]], sample=True)]))
        tokens.append(out.results[0].next_token_id)
    _assert_greedy_close(gqa_model_dir, prompt, tokens)


def test_sampler_on_cuda_matches_cpu():
    """Temperature, top-k/p, min-p, penalties and seeds on CUDA logits: the same draws as on CPU
    (the noise comes from the request's CPU generator on both)."""
    from radixserve.protocol import SamplingParams
    from radixserve.worker.sampler import Sampler, SamplingState

    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.2, top_k=50, min_p=0.05, seed=2, frequency_penalty=0.5),
        SamplingParams(temperature=0.7, presence_penalty=0.4, seed=3),
    ]
    results = []
    for device in ("cpu", "cuda"):
        states = [SamplingState(p, prompt_ids=[1, 2, 3], output_ids=[5, 5, 9]) for p in params]
        results.append(Sampler(1000).sample(logits.to(device), states).token_ids)
    assert results[0] == results[1]


# ---------------------------------------------------------------------- quantized KV (--kv-cache-dtype)


@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_reads_fp8_kv_like_torch_native(flashinfer, page_size):
    """fp8_e4m3 pages: FlashInfer reads them in place (bf16 queries, a scale of 1), torch_native
    dequantizes them, so both attend over the same values; the pool quantizes new K/V once,
    the same way for both."""
    from radixserve.attention import create_backend
    from radixserve.attention.base import AttentionShape
    from radixserve.kernels.kv_quant import kv_format

    fmt = kv_format("fp8_e4m3", torch.bfloat16)
    shape = AttentionShape(8, 2, 128, 128**-0.5)
    num_pages = 8000 if page_size == 1 else 500
    rng = random.Random(50 + page_size)
    for kinds in (["cached", "prefill", "decode", "cached", "decode"], ["decode"] * 7):
        pool_fi, pool_ref = _random_pools(page_size, 8, 2, torch.bfloat16, num_pages, kv_format=fmt)
        assert pool_fi.k[0].dtype == torch.float8_e4m3fn
        fi = create_backend("auto", pool_fi, shape, "cuda")
        assert type(fi).__name__ == "FlashInferBackend"
        ref = create_backend("torch_native", pool_ref, shape, "cuda")
        batch = _batch(rng, page_size, kinds, num_pages)
        g = torch.Generator(device="cuda").manual_seed(2)
        q, k, v = (torch.randn(batch.num_tokens, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                   for h in (8, 2, 2))
        fi.plan(batch)
        ref.plan(batch)
        out_fi, out_ref = fi.forward(q, k, v, 0), ref.forward(q, k, v, 0)
        tol = TOL[torch.bfloat16]
        torch.testing.assert_close(out_fi, out_ref, atol=tol, rtol=tol, msg=lambda m, kinds=kinds: f"{kinds}: {m}")
        assert torch.equal(pool_fi.k[0].view(torch.uint8), pool_ref.k[0].view(torch.uint8))


def test_quantized_kv_models_on_cuda(flashinfer, gqa_model_dir):
    """A model over fp8_e4m3 pages: FlashInfer (eager and from CUDA graphs) against torch_native;
    over int8 pages (torch_native, which `auto` picks since FlashInfer reads no scaled int8):
    against the CPU worker's kernels over int8 pages. Logits within LOGIT_REL of their scale
    at the prompt and each step. (Against an unquantized pool this random model's logits move
    by 9-38% of their scale: it is the quantization, not the backends, so no such pair.)"""
    prompts = _prompts(4, 512, seed=5)
    runners = {
        "fp8 flashinfer": Runner(gqa_model_dir, "flashinfer", kv_cache_dtype="fp8_e4m3"),
        "fp8 graphs": Runner(gqa_model_dir, "flashinfer", graphs=[1, 2, 4], kv_cache_dtype="fp8_e4m3"),
        "fp8 torch_native": Runner(gqa_model_dir, "torch_native", kv_cache_dtype="fp8_e4m3"),
        "int8 auto": Runner(gqa_model_dir, "auto", kv_cache_dtype="int8"),
        "int8 cpu": Runner(gqa_model_dir, "torch_native", kv_cache_dtype="int8", device="cpu"),
    }
    assert type(runners["int8 auto"].runner.backend).__name__ == "TorchNativeBackend"
    logits = {name: r.step(list(enumerate(prompts))) for name, r in runners.items()}
    rng = random.Random(6)
    for step in range(5):  # the prompt, then four decode steps of the whole batch
        if step:
            tokens = [(row, [rng.randrange(512)]) for row in range(len(prompts))]
            logits = {name: r.step(tokens) for name, r in runners.items()}
        for pair in (("fp8 flashinfer", "fp8 torch_native"), ("fp8 graphs", "fp8 torch_native"),
                     ("int8 auto", "int8 cpu")):
            ours, ref = logits[pair[0]].cpu(), logits[pair[1]].cpu()
            scale = float(ref.abs().max())
            assert float((ours - ref).abs().max()) <= LOGIT_REL * scale, f"step {step}: {pair}"
