"""Linear layers over GGUF-quantized blocks (`kernels.quant_linear`) against bf16 and fp32 packed
linears, in process.

    python -m bench.quant_linear [--threads 2] [--repeats 7] [--isa avx2] [--out bench/results/quant_linear.json]

Shapes (in x out) 2048 x 2048 and 2048 x 8192 at M = 1, 16 and 512 rows, bf16 activations for
the quantized and bf16 layers (fp32 for fp32), on --threads threads. The baselines are
`models.packed_linear.packed_linear` of the bf16 and of the fp32 weight (the serving path's
linear layers). Each layer gets enough distinct weights that one cycle through them reads about
--cycle-mib MiB (cold, as the layers of a decode step are); a repeat times one cycle, and the
figure is the median per call. At M = 1 the table gives the weight bytes streamed per second;
"vs bf16" is bf16's time over the layer's.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from bench.common import add_isa, add_out, apply_isa, new_parser
from bench.model_runner import machine
from radixserve.kernels.quant_linear import (
    QUANT_TYPES,
    QuantType,
    pack_quantized,
    quant_linear,
    quant_linear_serves,
)
from radixserve.models.packed_linear import packed_linear

SHAPES = [(2048, 2048), (2048, 8192)]
ROWS = [1, 16, 512]


def _blocks(qtype: QuantType, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Weights of `qtype`: gguf's quantizer for the 32-blocks; random bytes with small fp16
    scales for the K-quants (gguf cannot quantize those; the kernel's work is the same)."""
    if qtype.block_size == 32:
        w = rng.standard_normal((n, k), dtype=np.float32) * 0.02
        return torch.from_numpy(np.ascontiguousarray(gguf_quantize(w, GGMLQuantizationType(qtype.ggml_type)))).view(n, -1)
    blocks = rng.integers(0, 256, size=(n, k // 256, qtype.block_bytes), dtype=np.uint8)
    scales = np.full((n, k // 256, 2), 1e-3, dtype=np.float16).view(np.uint8)
    if qtype.name == "Q4_K":
        blocks[..., 0:4] = scales.reshape(n, k // 256, 4)
    else:
        blocks[..., 208:210] = scales[..., :2]
    return torch.from_numpy(blocks.reshape(n, -1).copy())


def _layers(layer_bytes: int, cycle_mib: int) -> int:
    return max(1, min(64, -(-cycle_mib * 2**20 // layer_bytes)))


def _time(calls: list[Callable[[], object]], repeats: int) -> float:
    """Median seconds per call over `repeats` cycles through `calls` (after one warm-up cycle)."""
    for call in calls:
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call()
        times.append((time.perf_counter() - start) / len(calls))
    return statistics.median(times)


def run(k: int, n: int, rows: int, repeats: int, cycle_mib: int, rng: np.random.Generator) -> dict[str, tuple[float, int]]:
    """(seconds per call, weight bytes) for each layer kind at this shape."""
    results: dict[str, tuple[float, int]] = {}
    x32 = torch.randn(rows, k)
    x16 = x32.to(torch.bfloat16)
    for dtype, x in ((torch.bfloat16, x16), (torch.float32, x32)):
        elem = 2 if dtype == torch.bfloat16 else 4
        count = _layers(n * k * elem, cycle_mib)
        layers = [packed_linear((torch.randn(n, k) * 0.02).to(dtype), None) for _ in range(count)]
        if layers[0] is None:
            continue
        results[str(dtype).removeprefix("torch.")] = (_time([lambda lin=lin, x=x: lin(x) for lin in layers], repeats), n * k * elem)
    for name, qtype in QUANT_TYPES.items():
        if not quant_linear_serves(qtype, k):
            continue
        one = pack_quantized(_blocks(qtype, n, k, rng), qtype)
        count = _layers(one.numel(), cycle_mib)
        packs = [one] + [one.clone() for _ in range(count - 1)]
        calls = [lambda p=p, q=qtype: quant_linear(x16, p, q, k, n) for p in packs]
        results[name] = (_time(calls, repeats), one.numel())
    return results


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cycle-mib", type=int, default=256, help="weight bytes one cycle through a layer's copies reads")
    add_isa(parser)
    add_out(parser, "bench/results/quant_linear.json")
    args = parser.parse_args()
    apply_isa(args)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows_out = []
    print(machine())
    print("| shape (in x out) | M | layer | ms / call | weight GB/s (M=1) | vs bf16 |")
    print("|---|---:|---|---:|---:|---:|")
    for k, n in SHAPES:
        for m in ROWS:
            results = run(k, n, m, args.repeats, args.cycle_mib, rng)
            bf16 = results.get("bfloat16", (float("nan"), 0))[0]
            for name, (seconds, nbytes) in results.items():
                rate = nbytes / seconds / 1e9 if m == 1 else None
                rows_out.append({"in": k, "out": n, "rows": m, "layer": name, "ms": seconds * 1e3,
                                 "weight_bytes": nbytes, "weight_gb_s": rate, "vs_bf16": bf16 / seconds})
                print(f"| {k} x {n} | {m} | {name} | {seconds * 1e3:.3f} | "
                      f"{'' if rate is None else f'{rate:.1f}'} | {bf16 / seconds:.2f}x |", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "date": datetime.date.today().isoformat(),
                                    "threads": args.threads, "results": rows_out}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
