"""radixserve's CPU kernels vs the torch ops they replace, on the default model's shapes.

    python -m bench.cpu_kernels [--repeats 7] [--isa avx2]

Each row times 30 layers' worth of one op (the default model has 30), both sides in the same
run, alternating, best of the repeats:

- prefill attention: one 1,536-token prompt, `prefill_attention` vs torch's causal SDPA;
- decode attention: batch 32 x 512 tokens of context on scattered pages, a separate pool per
  layer (cold, as in a real step), `paged_decode` vs gather + SDPA;
- linears: the four matmuls of a layer at 32 rows (30 layers of distinct weights, cold) and at
  1,536 rows (one layer's, repeated), `PanelLinear` vs `F.linear` (fp32) and vs oneDNN's packed
  `OneDNNLinear` (bf16; `F.linear` below the avx512 tier, where oneDNN does not pack bf16).

`--isa TIER` runs at that CPU ISA tier (the kernels built for it, torch capped to it; see
radixserve/kernels/isa.py). A kernel the tier's build does not serve is left out; which of them
the model uses is `kernels.cpu.prefill_attention_serves` and `linear_serves`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import add_isa, apply_isa, new_parser
from bench.model_runner import machine
from radixserve.kernels import cpu as cpu_kernels
from radixserve.models.packed_linear import OneDNNLinear, PanelLinear, onednn_packs

LAYERS = 30
HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
LINEAR_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down


def _best(repeats: int, ours: Callable[[], object], theirs: Callable[[], object]) -> tuple[float, float]:
    ours(), theirs()  # warm-up
    t_ours, t_theirs = [], []
    for _ in range(repeats):
        for f, times in ((ours, t_ours), (theirs, t_theirs)):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
    return min(t_ours), min(t_theirs)


def prefill_attention(dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    tokens = 1536
    gen = torch.Generator().manual_seed(0)
    pages = torch.randperm(tokens // PAGE, generator=gen)
    k_pool = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_pool = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    pos = torch.arange(tokens)
    slots = pages[pos // PAGE] * PAGE + pos % PAGE
    k, v = k_pool[slots].transpose(0, 1)[None], v_pool[slots].transpose(0, 1)[None]
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5

    def ours() -> None:
        for _ in range(LAYERS):
            cpu_kernels.prefill_attention(q, k_pool, v_pool, pages, PAGE, 0, scale, out)

    def sdpa() -> None:
        for _ in range(LAYERS):
            F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True, scale=scale, enable_gqa=True)

    return _best(repeats, ours, sdpa)


def decode_attention(dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    batch, context = 32, 512
    per_row = context // PAGE
    gen = torch.Generator().manual_seed(0)
    pools = [(torch.randn(batch * per_row * PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
              torch.randn(batch * per_row * PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)) for _ in range(LAYERS)]
    table = torch.randperm(batch * per_row, generator=gen).view(batch, per_row)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    pos = torch.arange(context)
    slots = (table[:, pos // PAGE] * PAGE + pos % PAGE).flatten()
    scale = HEAD_DIM**-0.5

    def ours() -> None:
        for k_pool, v_pool in pools:
            cpu_kernels.paged_decode(q, k_pool, v_pool, table, lens, PAGE, scale)

    def gather_sdpa() -> None:
        for k_pool, v_pool in pools:
            k = k_pool.index_select(0, slots).view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
            v = v_pool.index_select(0, slots).view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
            F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)

    return _best(repeats, ours, gather_sdpa)


def linears(dtype: torch.dtype, rows: int, repeats: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    distinct = LAYERS if rows <= 64 else 1  # decode: cold weights; prefill: compute-bound
    weights = [[(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for k, n in LINEAR_SHAPES] for _ in range(distinct)]
    xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k, _ in LINEAR_SHAPES}
    panels = [[PanelLinear(w, None) for w in layer] for layer in weights]
    onednn = dtype == torch.bfloat16 and onednn_packs()
    baseline = [[OneDNNLinear(w, None) for w in layer] for layer in weights] if onednn else None

    def run(layers) -> None:
        for i in range(LAYERS):
            for (k, _), layer in zip(LINEAR_SHAPES, layers[i % distinct]):
                layer(xs[k])

    def f_linear() -> None:
        for i in range(LAYERS):
            for (k, _), w in zip(LINEAR_SHAPES, weights[i % distinct]):
                F.linear(xs[k], w)

    return _best(repeats, lambda: run(panels), (lambda: run(baseline)) if baseline else f_linear)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    add_isa(parser)
    args = parser.parse_args()
    apply_isa(args)
    lib = cpu_kernels.load_library()
    if lib is None:
        raise SystemExit("the CPU kernels are off here (no C compiler, or RADIXSERVE_DISABLE_CPU_KERNELS=1)")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        if lib.prefill_attention_supported(HEAD_DIM, cpu_kernels.DTYPE_CODES[dtype]):
            rows.append((name, "prefill attention, 1536 tokens", "causal SDPA", *prefill_attention(dtype, args.repeats)))
        rows.append((name, "decode attention, batch 32 x 512", "gather + SDPA", *decode_attention(dtype, args.repeats)))
        if not lib.linear_serves(cpu_kernels.DTYPE_CODES[dtype]):
            continue
        baseline = "oneDNN packed" if dtype == torch.bfloat16 and onednn_packs() else "F.linear"
        for m in (32, 1536):
            rows.append((name, f"linears, {m} rows", baseline, *linears(dtype, m, args.repeats)))
    print(machine())
    print("| dtype | op (30 layers) | baseline | radixserve ms | baseline ms | speed-up |")
    print("|---|---|---|---:|---:|---:|")
    for name, op, base, ours, theirs in rows:
        print(f"| {name} | {op} | {base} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {theirs / ours:.2f}x |")


if __name__ == "__main__":
    main()
