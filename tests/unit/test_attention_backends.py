"""The CUDA path's CPU-checkable parts: backend registry, paged index math, graph buckets/padding,
and FlashInferBackend + decode graphs driven through a CPU stand-in for flashinfer.

What this file cannot show: that FlashInfer's real kernels agree (tests/unit/test_gpu.py does that
on a GPU).
"""

from __future__ import annotations

import importlib.util
import logging
import random
import sys

import fake_flashinfer
import pytest
import torch

import radixserve.attention as attention
from radixserve.attention import create_backend, flashinfer_problem, resolve_backend_name
from radixserve.attention.base import AttentionBatch, AttentionShape
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.paged_indices import build_paged_indices
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.config import ServerConfig
from radixserve.models.loader import load_model
from radixserve.worker.cuda_graph import (
    DecodeGraphRunner,
    graph_batch_sizes,
    pad_decode_batch,
    padded_size,
)
from radixserve.worker.model_runner import ModelRunner, SequenceChunk
from radixserve.worker.page_table import PageTable

CUDA = torch.device("cuda")  # a device object only: nothing here touches CUDA
SHAPE = AttentionShape(num_heads=8, num_kv_heads=2, head_dim=128, scale=128**-0.5)


def _pool(page_size: int = 4, num_pages: int = 8, dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(1, num_pages, page_size, SHAPE.num_kv_heads, SHAPE.head_dim, dtype)


@pytest.fixture
def no_flashinfer_import(monkeypatch):
    """Fail the test if anything looks for or imports flashinfer."""
    real_import, real_find = attention.importlib.import_module, importlib.util.find_spec

    def guard_import(name, *a, **k):
        assert not name.startswith("flashinfer"), "flashinfer was imported"
        return real_import(name, *a, **k)

    def guard_find(name, *a, **k):
        assert not name.startswith("flashinfer"), "flashinfer was looked up"
        return real_find(name, *a, **k)

    monkeypatch.setattr(attention.importlib, "import_module", guard_import)
    monkeypatch.setattr(attention.importlib.util, "find_spec", guard_find)


@pytest.fixture
def fake_fi(monkeypatch):
    """`import flashinfer` yields the CPU stand-in."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    return fake_flashinfer


# ---------------------------------------------------------------------- registry


def test_cpu_worker_gets_torch_native_without_looking_for_flashinfer(no_flashinfer_import):
    for name in ("auto", "torch_native"):
        backend = create_backend(name, _pool(), SHAPE, "cpu")
        assert isinstance(backend, TorchNativeBackend)


def test_cpu_only_import_chain_never_imports_flashinfer():
    """A fresh interpreter that builds the worker's pieces on the CPU has no CUDA module loaded."""
    import subprocess

    code = (
        "import sys, torch\n"
        "from radixserve.worker import worker, cuda_graph, model_runner\n"
        "from radixserve.attention import create_backend\n"
        "from radixserve.attention.base import AttentionShape\n"
        "from radixserve.attention.kv_pool import KVPool\n"
        "b = create_backend('auto', KVPool(1, 4, 4, 2, 64, torch.float32), AttentionShape(4, 2, 64, 0.125), 'cpu')\n"
        "bad = [m for m in sys.modules if m.startswith('flashinfer') or 'flashinfer_backend' in m]\n"
        "assert not bad, bad\n"
        "print(type(b).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "TorchNativeBackend"


def test_asking_flashinfer_on_cpu_says_what_is_missing(no_flashinfer_import):
    with pytest.raises(ValueError, match="'flashinfer' needs a CUDA device, and this worker runs on cpu.*torch_native"):
        create_backend("flashinfer", _pool(), SHAPE, "cpu")


def test_asking_flashinfer_without_the_package_names_the_install(monkeypatch):
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"not installed; install it with `pip install radixserve\[cuda\]`"):
        resolve_backend_name("flashinfer", CUDA, torch.bfloat16, 128)
    assert resolve_backend_name("auto", CUDA, torch.bfloat16, 128) == "torch_native"


def test_broken_flashinfer_install_is_reported(monkeypatch):
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: object())

    def broken(name):
        raise OSError("libcudart.so.13: cannot open shared object file")

    monkeypatch.setattr(attention.importlib, "import_module", broken)
    with pytest.raises(ValueError, match="could not import flashinfer .*libcudart"):
        resolve_backend_name("flashinfer", CUDA, torch.float16, 64)


@pytest.mark.parametrize(
    "dtype, head_dim, message",
    [(torch.float32, 128, "float16 and bfloat16 only, not float32"), (torch.bfloat16, 80, r"head sizes \[64, 128, 256\].* 80")],
)
def test_flashinfer_refuses_what_its_kernels_do_not_serve(dtype, head_dim, message, caplog):
    assert flashinfer_problem(CUDA, dtype, head_dim) is not None
    with pytest.raises(ValueError, match=message):
        resolve_backend_name("flashinfer", CUDA, dtype, head_dim)
    with caplog.at_level(logging.WARNING, logger="radixserve.worker"):
        assert resolve_backend_name("auto", CUDA, dtype, head_dim) == "torch_native"
    assert "torch_native, because flashinfer" in caplog.text


def test_auto_picks_flashinfer_on_cuda_when_it_imports(fake_fi, monkeypatch):
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: object())
    assert resolve_backend_name("auto", CUDA, torch.bfloat16, 128) == "flashinfer"
    assert resolve_backend_name("flashinfer", CUDA, torch.float16, 256) == "flashinfer"
    assert resolve_backend_name("torch_native", CUDA, torch.float16, 256) == "torch_native"


def test_unknown_backend_and_config_validation():
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend_name("triton", CUDA, torch.float16, 128)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ServerConfig(attention_backend="triton")
    with pytest.raises(ValueError, match="'flashinfer' needs CUDA"):
        ServerConfig(attention_backend="flashinfer", device="cpu")
    config = ServerConfig(attention_backend="flashinfer", device="auto", disable_cuda_graph=True)
    assert config.disable_cuda_graph and config.attention_backend == "flashinfer"


def test_cli_has_the_new_options():
    from radixserve.__main__ import build_parser, config_from_args

    parser = build_parser()
    args = parser.parse_args(["serve", "--attention-backend", "torch_native", "--disable-cuda-graph"])
    config = config_from_args(args, parser)
    assert config.attention_backend == "torch_native" and config.disable_cuda_graph
    defaults = config_from_args(parser.parse_args(["serve"]), parser)
    assert defaults.attention_backend == "auto" and not defaults.disable_cuda_graph


# ---------------------------------------------------------------------- index math


def _naive_indices(table: list[list[int]], prefix: list[int], extend: list[int], ps: int) -> dict:
    qo, kv, indices, last, slots = [0], [0], [], [], []
    for row, p, e in zip(table, prefix, extend):
        seq = p + e
        n = -(-seq // ps)
        qo.append(qo[-1] + e)
        kv.append(kv[-1] + n)
        indices += row[:n]
        last.append(seq - (n - 1) * ps)
        slots += [row[pos // ps] * ps + pos % ps for pos in range(p, seq)]
    return dict(qo_indptr=qo, kv_indptr=kv, kv_indices=indices, kv_last_page_len=last, out_slots=slots)


def _random_batch(rng: random.Random, ps: int, num_pages: int = 1000) -> AttentionBatch:
    """Mixed batch: decodes, fresh prefills, prefills over a cached prefix; shuffled page ids and
    stale page-table entries past each row's end."""
    batch = rng.randint(1, 7)
    prefix, extend = [], []
    for _ in range(batch):
        kind = rng.choice(["decode", "prefill", "cached"])
        prefix.append(0 if kind == "prefill" else rng.randint(1, 60))
        extend.append(1 if kind == "decode" else rng.randint(1, 40))
    width = max(-(-(p + e) // ps) for p, e in zip(prefix, extend)) + rng.randint(0, 3)
    pages = rng.sample(range(num_pages), width * batch)  # no page shared by two requests
    table = [pages[i * width : (i + 1) * width] for i in range(batch)]
    return AttentionBatch(ps, torch.tensor(table), prefix, extend)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_indices_equal_a_naive_computation(page_size):
    rng = random.Random(page_size)
    for _ in range(50):
        batch = _random_batch(rng, page_size)
        got = build_paged_indices(batch, "cpu")
        want = _naive_indices(batch.page_table.tolist(), batch.prefix_lens, batch.extend_lens, page_size)
        for name, expected in want.items():
            tensor = getattr(got, name)
            assert tensor.tolist() == expected, name
        for name in ("qo_indptr", "kv_indptr", "kv_last_page_len", "kv_indices"):
            assert getattr(got, name).dtype == torch.int32, name  # what FlashInfer requires
        assert got.out_slots.dtype == torch.int64


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["kernel", "sdpa"])
def test_paged_indices_match_the_slots_torch_native_writes(cpu_kernel):
    rng = random.Random(7)
    for ps in (1, 16):
        pool = KVPool(1, 1000, ps, 2, 8, torch.float32)
        backend = TorchNativeBackend(pool, AttentionShape(4, 2, 8, 0.3), cpu_kernel)
        for _ in range(10):
            batch = _random_batch(rng, ps)
            k, v = torch.randn(2, batch.num_tokens, 2, 8).unbind(0)
            backend.plan(batch)
            backend.forward(torch.randn(batch.num_tokens, 4, 8), k, v, layer_id=0)
            slots = build_paged_indices(batch, "cpu").out_slots
            assert torch.equal(pool.flat_k(0)[slots], k) and torch.equal(pool.flat_v(0)[slots], v)


def test_the_docstring_example():
    batch = AttentionBatch(4, torch.tensor([[7, 2], [3, 9]]), prefix_lens=[5, 4], extend_lens=[3, 1])
    idx = build_paged_indices(batch, "cpu")
    assert idx.qo_indptr.tolist() == [0, 3, 4]
    assert idx.kv_indptr.tolist() == [0, 2, 4]
    assert idx.kv_indices.tolist() == [7, 2, 3, 9]
    assert idx.kv_last_page_len.tolist() == [4, 1]
    assert idx.out_slots.tolist() == [9, 10, 11, 36]


def test_paged_indices_refuse_a_table_too_narrow():
    batch = AttentionBatch(4, torch.tensor([[1]]), prefix_lens=[4], extend_lens=[1])
    with pytest.raises(ValueError, match="needs 2 pages"):
        build_paged_indices(batch, "cpu")


def test_page_table_deltas_feed_the_indices():
    """The worker applies assign/append/release deltas; the gathered rows give the right CSR."""
    table = PageTable(4, 8)
    table.assign(2, [5, 6])
    table.assign(0, [1])
    table.append(2, [7])
    table.release(0)
    table.assign(0, [3, 4])  # a reused row keeps stale entries past its end until overwritten
    rows = table.gather([2, 0])
    idx = build_paged_indices(AttentionBatch(2, rows, prefix_lens=[5, 2], extend_lens=[1, 2]), "cpu")
    assert idx.kv_indices.tolist() == [5, 6, 7, 3, 4]
    assert idx.kv_last_page_len.tolist() == [2, 2]
    assert idx.out_slots.tolist() == [7 * 2 + 1, 4 * 2 + 0, 4 * 2 + 1]


# ---------------------------------------------------------------------- graph buckets


def test_graph_batch_sizes():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert graph_batch_sizes(1000) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == [1]
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_padded_size():
    sizes = [1, 2, 4, 8, 100]
    assert [padded_size(b, sizes) for b in (1, 2, 3, 5, 8, 9, 100)] == [1, 2, 4, 8, 8, 100, 100]
    assert padded_size(101, sizes) is None


def test_pad_decode_batch_adds_one_token_requests_on_the_pad_page():
    batch = AttentionBatch(16, torch.tensor([[3, 4], [5, 0]]), prefix_lens=[20, 7], extend_lens=[1, 1])
    padded = pad_decode_batch(batch, 4, pad_page=99)
    assert padded.page_table.tolist() == [[3, 4], [5, 0], [99, 99], [99, 99]]
    assert padded.prefix_lens == [20, 7, 0, 0] and padded.extend_lens == [1, 1, 1, 1]
    idx = build_paged_indices(padded, "cpu")
    assert idx.out_slots.tolist() == [4 * 16 + 4, 5 * 16 + 7, 99 * 16, 99 * 16]
    assert pad_decode_batch(batch, 2, 99) is batch
    with pytest.raises(ValueError):
        pad_decode_batch(batch, 1, 99)


def test_pool_has_a_pad_page_past_the_scheduler_pages():
    pool = KVPool(2, 5, 4, 2, 8, torch.float32)
    assert pool.num_pages == 5 and pool.pad_page == 5
    assert pool.k[0].shape == (6, 4, 2, 8) and pool.flat_v(1).shape == (24, 2, 8)


# ---------------------------------------------------------------------- FlashInferBackend on the stand-in


class Harness:
    """A model runner over a shuffled pool, with either backend; the same pages for both."""

    def __init__(self, model_dir, page_size: int, backend: str, num_pages: int = 256, **fi_options) -> None:
        from radixserve.attention.flashinfer_backend import FlashInferBackend

        loaded = load_model(str(model_dir), dtype=torch.float32)
        self.model = loaded.model
        shape = self.model.attention_shape()
        self.pool = KVPool(loaded.config.num_layers, num_pages, page_size, shape.num_kv_heads, shape.head_dim, torch.float32)
        self.table = PageTable(16, num_pages)
        if backend == "flashinfer":
            self.backend = FlashInferBackend(self.pool, shape, workspace_bytes=1024, **fi_options)
        else:
            self.backend = TorchNativeBackend(self.pool, shape)
        self.runner = ModelRunner(self.model, self.table, self.backend)
        self.free = list(range(num_pages))
        random.Random(0).shuffle(self.free)
        self.page_size = page_size

    def give_pages(self, row: int, num_tokens: int) -> None:
        need = -(-num_tokens // self.page_size) - self.table.num_pages(row)
        self.table.append(row, [self.free.pop() for _ in range(max(0, need))])

    def step(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        for c in chunks:
            self.give_pages(c.row, c.prefix_len + len(c.token_ids))
        return self.runner.forward(chunks).last_logits


def _script(vocab: int) -> list[list[tuple[int, int, list[int]]]]:
    """Steps of (row, prefix_len, new tokens): prefills, a mixed step, decodes, a cached prefix."""
    g = torch.Generator().manual_seed(3)

    def toks(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    return [
        [(0, 0, toks(21)), (1, 0, toks(5))],
        [(0, 21, toks(1)), (1, 5, toks(1)), (2, 0, toks(33))],  # mixed: decodes + a prefill
        [(0, 22, toks(1)), (1, 6, toks(1)), (2, 33, toks(1))],  # pure decode
        [(1, 7, toks(1)), (2, 34, toks(1))],
        [(2, 35, toks(12)), (0, 23, toks(1))],  # a chunk over a cached prefix, plus a decode
    ]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_flashinfer_backend_on_the_stand_in_equals_torch_native(tiny_model_dirs, fake_fi, page_size, tensor_cores):
    ref = Harness(tiny_model_dirs["llama_gqa_tied"], page_size, "torch_native")
    fib = Harness(tiny_model_dirs["llama_gqa_tied"], page_size, "flashinfer", decode_tensor_cores=tensor_cores)
    assert fib.backend._decode.use_tensor_cores is tensor_cores
    for step in _script(ref.model.config.vocab_size):
        chunks = [SequenceChunk(r, p, t) for r, p, t in step]
        prefill_plans, decode_plans = fib.backend._prefill.plan_calls, fib.backend._decode.plan_calls
        torch.testing.assert_close(fib.step(chunks), ref.step(chunks), atol=1e-4, rtol=1e-4)
        is_decode = all(len(t) == 1 for _, _, t in step)
        # plan once per forward, whatever the number of layers
        assert fib.backend._decode.plan_calls - decode_plans == int(is_decode)
        assert fib.backend._prefill.plan_calls - prefill_plans == int(not is_decode)
    assert fib.backend._prefill.backend == "fa2"
    torch.testing.assert_close(fib.pool.k[1], ref.pool.k[1])  # the same K/V in the same slots


class EagerGraph:
    """CPU stand-in for a CUDA graph: capture runs the function, replay runs it again into the
    captured output tensor (the way a replay rewrites the graph's static output)."""

    captures = 0

    def __init__(self, pool: object) -> None:
        self.fn = self.out = None

    def capture(self, fn):
        EagerGraph.captures += 1
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_graph_plumbing_on_the_stand_in(tiny_model_dirs, fake_fi, page_size):
    """Padded decode batches replayed through fixed buffers equal eager steps, and padding writes
    only the pad page."""
    eager = Harness(tiny_model_dirs["qwen3"], page_size, "flashinfer")
    graph = Harness(tiny_model_dirs["qwen3"], page_size, "flashinfer")
    EagerGraph.captures = 0
    graph.runner.capture_decode_graphs(graph_batch_sizes(6), graph_factory=EagerGraph, new_pool=lambda: None)
    assert sorted(graph.runner.graphs.graphs) == [1, 2, 4, 6] and EagerGraph.captures == 4
    vocab = eager.model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    lengths = [9, 17, 1, 30, 16, 4]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    for h in (eager, graph):
        h.step([SequenceChunk(r, 0, p) for r, p in enumerate(prompts)])  # prefill: eager in both
    graph_runs = 0
    for batch_rows in ([0, 1, 2, 3, 4], [5], [2, 0, 4], list(range(6)), [1, 3]):
        chunks = []
        for r in batch_rows:
            chunks.append(SequenceChunk(r, lengths[r], [int(torch.randint(0, vocab, (1,), generator=g))]))
            lengths[r] += 1
        before = graph.backend._graph_decode[padded_size(len(chunks), [1, 2, 4, 6])].plan_calls
        torch.testing.assert_close(graph.step(chunks), eager.step(chunks), atol=1e-4, rtol=1e-4)
        graph_runs += graph.backend._graph_decode[padded_size(len(chunks), [1, 2, 4, 6])].plan_calls - before
    assert graph_runs == 5  # every decode step went through a graph wrapper
    pad = graph.pool.pad_page
    for layer in range(graph.pool.num_layers):  # real pages identical; only the pad page differs
        torch.testing.assert_close(graph.pool.k[layer][:pad], eager.pool.k[layer][:pad], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graph.pool.v[layer][:pad], eager.pool.v[layer][:pad], atol=1e-5, rtol=1e-5)


def test_graphs_need_a_capturable_backend(tiny_model_dirs):
    h = Harness(tiny_model_dirs["llama"], 4, "torch_native")
    with pytest.raises(ValueError, match="cannot be captured"):
        DecodeGraphRunner(h.model, h.backend, [1], 4, graph_factory=EagerGraph, new_pool=lambda: None)
