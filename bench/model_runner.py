"""Model-runner throughput vs Hugging Face transformers, same weights, same run.

    python -m bench.model_runner [--dtypes float32 bfloat16] [--decode-steps 16] [--isa avx2]

Measures prefill tokens/s on one 1,536-token prompt and decode tokens/s at batch 1 and 32 with
~512 tokens of context, for radixserve's runner (paged KV, torch-native attention) and for
transformers (a forward for prefill; batched `generate` for decode, timed from its first to its
last sampling step so its prefill is not counted). Prints a Markdown table with the ratios.

`--isa TIER` runs both systems as on a CPU of that tier (radixserve's kernels built for it,
torch's own kernels capped to it: radixserve/kernels/isa.py); the default is the machine's.
`--dtypes auto` measures the dtype `--dtype auto` picks on that tier.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.common import StepClock, add_isa, apply_isa, new_parser
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.torch_native import TorchNativeBackend
from radixserve.kernels import isa
from radixserve.models.loader import load_model
from radixserve.models.resolve import resolve_model
from radixserve.protocol import SamplingParams
from radixserve.worker.device import dtype_name, resolve_dtype
from radixserve.worker.model_runner import ModelRunner, SequenceChunk
from radixserve.worker.page_table import PageTable
from radixserve.worker.sampler import Sampler, SamplingState

PREFILL_LEN = 1536
CONTEXT = 512


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab - 100, (batch, length), generator=gen).tolist()


class Ours:
    """Our model runner driven step by step in process. By default the default model with
    transformers' weights (dequantized: `quantization="none"`); `max_len`: tokens of a row."""

    def __init__(self, dtype: torch.dtype, page_size: int = 16, model: str | Path = "default",
                 quantization: str = "none", max_len: int = PREFILL_LEN + 64) -> None:
        loaded = load_model(model, dtype=dtype, quantization=quantization)
        self.weight_format = loaded.weight_format
        self.model, cfg = loaded.model, loaded.config
        self.vocab = cfg.vocab_size
        shape = self.model.attention_shape()
        pages = 40 * max_len // page_size
        self.pool = KVPool(cfg.num_layers, pages, page_size, shape.num_kv_heads, shape.head_dim, dtype)
        self.table = PageTable(64, -(-max_len // page_size))
        self.runner = ModelRunner(self.model, self.table, TorchNativeBackend(self.pool, shape))
        self.sampler = Sampler(cfg.vocab_size)
        self.page_size = page_size

    def _assign(self, batch: int, tokens: int) -> None:
        per_row = -(-tokens // self.page_size)
        for row in range(batch):
            self.table.assign(row, list(range(row * per_row, (row + 1) * per_row)))

    def prefill(self, prompt: list[int]) -> float:
        self._assign(1, len(prompt) + 1)
        start = time.perf_counter()
        self.runner.forward([SequenceChunk(0, 0, prompt)])
        return time.perf_counter() - start

    def decode(self, prompts: list[list[int]], steps: int) -> float:
        """Seconds for `steps` batched decode steps (forward + greedy sampling) after a prefill."""
        self._assign(len(prompts), len(prompts[0]) + steps + 1)
        states = [SamplingState(SamplingParams(temperature=0.0), [], return_logprob=False) for _ in prompts]
        self.runner.forward([SequenceChunk(row, 0, p) for row, p in enumerate(prompts)])  # not timed
        last = [p[-1] for p in prompts]
        pos = len(prompts[0]) - 1
        start = time.perf_counter()
        for _ in range(steps):
            out = self.runner.forward([SequenceChunk(r, pos, [t]) for r, t in enumerate(last)])
            last = self.sampler.sample(out.last_logits, states).token_ids
            pos += 1
        return time.perf_counter() - start


class HF:
    def __init__(self, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        path = resolve_model("default")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self.model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], steps: int) -> float:
        """Seconds for `steps` decode steps of batched `generate` (its prefill not counted)."""
        from transformers import LogitsProcessorList

        ids = torch.tensor(prompts)
        clock = StepClock()
        self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1, min_new_tokens=steps + 1,
            do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
        )
        return clock.times[-1] - clock.times[0]


def measure(dtype_name: str, steps: int, repeats: int) -> Iterator[dict[str, object]]:
    """Each number is the best of `repeats` runs, the two systems alternating, so a busy
    moment on a shared machine penalises neither side more than the other."""
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    ours, hf = Ours(dtype), HF(dtype)
    prompt = _prompts(1, PREFILL_LEN, ours.vocab)[0]
    for system in (ours, hf):  # warm-up
        system.prefill(prompt[:64])
    t_ours, t_hf = _best(repeats, lambda: ours.prefill(prompt), lambda: hf.prefill(prompt))
    yield _row(dtype_name, f"prefill {PREFILL_LEN} tokens", PREFILL_LEN / t_ours, PREFILL_LEN / t_hf)
    for batch in (1, 32):
        prompts = _prompts(batch, CONTEXT, ours.vocab)
        t_ours, t_hf = _best(repeats, lambda p=prompts: ours.decode(p, steps), lambda p=prompts: hf.decode(p, steps))
        yield _row(dtype_name, f"decode batch {batch}, context {CONTEXT}", batch * steps / t_ours, batch * steps / t_hf)


def _best(repeats: int, a, b) -> tuple[float, float]:
    times_a, times_b = [], []
    for _ in range(repeats):
        times_a.append(a())
        times_b.append(b())
    return min(times_a), min(times_b)


def _row(dtype: str, what: str, ours: float, hf: float) -> dict[str, object]:
    return {"dtype": dtype, "workload": what, "radixserve_tok_s": ours, "transformers_tok_s": hf, "ratio": ours / hf}


def machine() -> str:
    """The CPU the numbers were measured on: its model name, its ISA tier and the tier the run
    used (AMX moves every bf16 ratio: torch runs bf16 matmuls and attention on AMX tiles)."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:
        pass
    return (f"{model} (tier {isa.machine_tier()}), run at ISA tier {isa.selected_tier()}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        help="float32, bfloat16, or auto (what --dtype auto picks on the tier)")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    add_isa(parser)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    apply_isa(args)
    dtypes = [dtype_name(resolve_dtype(d, torch.device("cpu"))) for d in args.dtypes]
    print(machine())
    print("| dtype | workload | radixserve tok/s | transformers tok/s | ratio |")
    print("|---|---|---:|---:|---:|", flush=True)
    rows = []
    for d in dict.fromkeys(dtypes):
        for r in measure(d, args.decode_steps, args.repeats):
            print(f"| {r['dtype']} | {r['workload']} | {r['radixserve_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | {r['ratio']:.2f}x |",
                  flush=True)
            rows.append(r)
    if args.json:
        with open(args.json, "w") as f:
            measured = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            json.dump({"machine": machine(), "isa": str(isa.selected_tier()), "machine_isa": str(isa.machine_tier()),
                       "measured": measured, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
