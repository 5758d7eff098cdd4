"""Quantized GGUF weights: radixserve's quantized kernels against llama.cpp and against its own
dequantized bf16 path, on the same GGUF file, 2 threads each, same run.

    python -m bench.quantized_weights [--preset 1b] [--types Q8_0 Q4_K_M] [--repeats 3]

For each file type (a random-weight Llama of the preset's shape with the default tokenizer,
written by bench/gguf_models.py into the cache):
- radixserve `--quantization gguf` and `--quantization none` (dequantized to bf16), in process
  (the model runner, paged KV, greedy sampling, as bench/model_runner.py drives it): decode
  tok/s at batch 1 and 16 over a 512-token context, prefill tok/s of one 1,024-token prompt;
- llama.cpp's `llama-batched-bench` on the same file (`-t 2 -fa on`, the same batch sizes and
  lengths): its text-generation and prompt-processing speeds. llama.cpp is built once, outside
  the repo (bench/llama_cpp.py says where it is looked for); without a build those rows are
  skipped, saying so.

Each radixserve number is the best of `--repeats` runs, the quantized and dequantized systems
alternating; llama.cpp's is the best of as many runs of its own.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench import llama_cpp
from bench.common import new_parser
from bench.gguf_models import PRESETS, cached_model
from bench.llama_cpp import BatchedBench
from bench.model_runner import Ours, machine
from radixserve.models.gguf_index import GGUFIndex

CONTEXT = 512
PREFILL_LEN = 1024
BATCHES = (1, 16)
RESULTS = Path(__file__).parent / "results" / "quantized_weights.json"


class Runner(Ours):
    """One model loaded from `path` with `quantization`, in bf16, driven step by step in process."""

    def __init__(self, path: Path, quantization: str) -> None:
        super().__init__(torch.bfloat16, model=path, quantization=quantization, max_len=max(PREFILL_LEN, CONTEXT) + 128)

    def resident_bytes(self) -> int:
        """Bytes of the model's parameters and buffers (the quantized blocks are buffers)."""
        seen, total = set(), 0
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab - 100, (batch, length), generator=gen).tolist()


def measure(path: Path, file_type: str, steps: int, repeats: int, llama: BatchedBench | None) -> list[dict[str, object]]:
    quantized, dequantized = Runner(path, "gguf"), Runner(path, "none")
    # the dequantized model's weights are partly in oneDNN's packed tensors, which no module
    # lists: its size is the file's values at 2 bytes each
    values = sum(t.n_elements for t in GGUFIndex(path).tensors.values())
    memory = {"gguf": quantized.resident_bytes(), "none": 2 * values, "file": path.stat().st_size}
    rows: list[dict[str, object]] = []
    prompt = _prompts(1, PREFILL_LEN, quantized.vocab)[0]
    for system in (quantized, dequantized):
        system.prefill(prompt[:64])  # warm-up
    best: dict[str, dict[str, float]] = {"gguf": {}, "none": {}}
    for _ in range(repeats):
        for name, system in (("gguf", quantized), ("none", dequantized)):
            tok_s = PREFILL_LEN / system.prefill(prompt)
            best[name]["prefill"] = max(best[name].get("prefill", 0.0), tok_s)
            for batch in BATCHES:
                prompts = _prompts(batch, CONTEXT, quantized.vocab)
                tok_s = batch * steps / system.decode(prompts, steps)
                best[name][f"decode {batch}"] = max(best[name].get(f"decode {batch}", 0.0), tok_s)
    llama_best: dict[str, float] = {}
    if llama is not None:
        for _ in range(repeats):
            for r in llama.run(path, CONTEXT, steps, BATCHES):
                key = f"decode {int(r['pl'])}"
                llama_best[key] = max(llama_best.get(key, 0.0), float(r["speed_tg"]))
            for r in llama.run(path, PREFILL_LEN, 1, (1,)):
                llama_best["prefill"] = max(llama_best.get("prefill", 0.0), float(r["speed_pp"]))
    for what in ("prefill", *(f"decode {b}" for b in BATCHES)):
        ours, deq, ref = best["gguf"][what], best["none"][what], llama_best.get(what)
        rows.append({"type": file_type, "workload": what, "weights": quantized.weight_format,
                     "radixserve_tok_s": ours, "dequantized_bf16_tok_s": deq, "llama_cpp_tok_s": ref,
                     "vs_dequantized": ours / deq, "vs_llama_cpp": ours / ref if ref else None})
    rows.append({"type": file_type, "workload": "memory", "resident_bytes": memory})
    return rows


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q4_K_M"])
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    folder = llama_cpp.bin_dir()
    llama = llama_cpp.BatchedBench(folder) if folder else None
    print(machine())
    if llama is None:
        print(llama_cpp.skip_line())
    rows = []
    print("| type | workload | radixserve tok/s | dequantized bf16 | llama.cpp | vs dequantized | vs llama.cpp |")
    print("|---|---|---:|---:|---:|---:|---:|", flush=True)
    for file_type in args.types:
        path = cached_model(args.preset, file_type)
        for r in measure(path, file_type, args.decode_steps, args.repeats, llama):
            rows.append(r)
            if r["workload"] == "memory":
                m = r["resident_bytes"]
                print(f"| {file_type} | memory MiB | {m['gguf'] / 2**20:.0f} | {m['none'] / 2**20:.0f} | file {m['file'] / 2**20:.0f} | | |")
                continue
            ref = f"{r['llama_cpp_tok_s']:.1f}" if r["llama_cpp_tok_s"] else "skipped"
            vs = f"{r['vs_llama_cpp']:.2f}x" if r["vs_llama_cpp"] else ""
            print(f"| {file_type} | {r['workload']} | {r['radixserve_tok_s']:.1f} | {r['dequantized_bf16_tok_s']:.1f} | "
                  f"{ref} | {r['vs_dequantized']:.2f}x | {vs} |", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine(), "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "preset": args.preset, "context": CONTEXT, "prefill_len": PREFILL_LEN, "decode_steps": args.decode_steps,
        "llama_cpp": str(folder) if folder else None, "rows": rows,
    }, indent=2))


if __name__ == "__main__":
    main()
