"""Build FlashInfer's JIT kernels for one (dtype, GQA group) before tests and benchmarks need them.

    MAX_JOBS=6 python -m bench.flashinfer_jit bfloat16 4 &    # head size 128
    MAX_JOBS=6 python -m bench.flashinfer_jit float16 4 &
    MAX_JOBS=6 python -m bench.flashinfer_jit bfloat16 1 &
    MAX_JOBS=6 python -m bench.flashinfer_jit bfloat16 4 --kv-cache-dtype fp8_e4m3 &
    wait

Each run plans and runs one decode and one prefill batch through `FlashInferBackend`, which
compiles the modules (or loads them from FlashInfer's cache, ~/.cache/flashinfer or
$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer). A group of 4 or more decodes with tensor cores,
which reuses the prefill module; a group below 4 also builds the CUDA-core decode module, so
it is listed first. An fp8 KV cache (`--kv-cache-dtype`) is its own module. Several runs in
parallel use the GPU machine's cores better than one build after another; FlashInfer's file
locks keep them from building the same module twice.
"""

from __future__ import annotations

import time

import torch

from bench.common import new_parser
from radixserve.attention.base import AttentionBatch, AttentionShape
from radixserve.attention.flashinfer_backend import FlashInferBackend
from radixserve.attention.kv_pool import KVPool
from radixserve.kernels.kv_quant import kv_format


def build(dtype: torch.dtype, group: int, kv_cache_dtype: str = "auto", head_dim: int = 128) -> float:
    start = time.perf_counter()
    kv_heads = max(1, 8 // group)
    shape = AttentionShape(kv_heads * group, kv_heads, head_dim, head_dim**-0.5)
    pool = KVPool(1, 8, 16, kv_heads, head_dim, dtype, "cuda", kv_format(kv_cache_dtype, dtype))
    backend = FlashInferBackend(pool, shape, workspace_bytes=16 * 2**20)
    table = torch.tensor([[0, 1], [2, 3]], device="cuda")
    for prefix, extend in (([20, 5], [1, 1]), ([0, 10], [17, 3])):  # decode, then prefill
        batch = AttentionBatch(16, table, prefix, extend)
        backend.plan(batch)
        t = batch.num_tokens
        q = torch.randn(t, shape.num_heads, head_dim, dtype=dtype, device="cuda")
        kv = torch.randn(t, kv_heads, head_dim, dtype=dtype, device="cuda")
        backend.forward(q, kv, kv, 0)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("dtype", choices=["bfloat16", "float16"])
    parser.add_argument("group", type=int, help="num_heads / num_kv_heads")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    args = parser.parse_args()
    seconds = build(getattr(torch, args.dtype), args.group, args.kv_cache_dtype)
    print(f"flashinfer JIT {args.dtype} group {args.group} KV {args.kv_cache_dtype}: ready in {seconds:.1f} s")


if __name__ == "__main__":
    main()
