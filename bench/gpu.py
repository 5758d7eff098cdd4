"""GPU numbers for the CUDA path in one run: one GPU, no network, one table.

    python -m bench.gpu --out gpu_results                  # Llama-3-8B shape, random bf16 weights
    python -m bench.gpu --preset tiny --device cpu --smoke # the same code path, small, on a CPU

The model is built from sizes alone (random weights, nothing downloaded; outputs are
meaningless, speed is real). radixserve runs its real scheduler and worker in this process (no
sockets), so every number includes scheduling, page-table deltas, planning and sampling:

- prefill tokens/s: one batch of --prefill-batch prompts of --prefill-len tokens;
- decode tokens/s at batch 1, 64 and 256: prompts of --decode-context tokens, --decode-len
  output tokens each (ignore_eos), counted over pure decode steps only, with CUDA graphs and
  without (--disable-cuda-graph);
- the radix cache on a shared-prefix workload (--docs documents of --doc-len tokens, each with
  --questions questions) against --disable-radix-cache, same worker;
- transformers on the same device: a forward over the prefill batch, and `generate` (greedy,
  fixed length) at the same decode batches, with its own random weights of the same shapes;
- decode step time / memory-bandwidth floor: (weight bytes + KV bytes read per step) over the
  copy bandwidth measured at the start.

Stages run in priority order under --budget-s; results are rewritten to --out (results.json,
results.md) after every stage, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import StepClock, add_dtype, add_page_size, new_parser, resolved_dtype

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}
SMOKE = dict(  # small sizes for --smoke (CPU): the code path, not the numbers
    prefill_batch=2, prefill_len=64, decode_batches=[1, 4], decode_context=32, decode_len=6,
    docs=2, doc_len=64, questions=3, question_len=8, answer_len=4, kv_memory_gb=0.25,
)


def hf_config(preset: str) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", **PRESETS[preset]}


# ---------------------------------------------------------------------- models


def build_ours(cfg: dict[str, Any], dtype: torch.dtype, device: torch.device, name: str):
    """Our Llama with random weights, built on the meta device and materialised once on `device`."""
    from radixserve.models.config import ModelConfig
    from radixserve.models.llama import LlamaForCausalLM
    from radixserve.models.loader import LoadedModel

    mc = ModelConfig.from_dict(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(mc)
    model = model.to(dtype).to_empty(device=device)
    _randomize(model)
    return LoadedModel(model.eval().requires_grad_(False), mc, Path(f"random-{name}"))


def build_hf(cfg: dict[str, Any], dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    sizes = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**sizes), dtype=dtype)
    _randomize(model)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02)


def weight_bytes_read_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: all of them, except the embedding table (only B
    rows of it), unless it doubles as the lm_head."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(cfg: dict[str, Any], dtype: torch.dtype) -> int:
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * item


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 2**30, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written (as GPU.md does)."""
    nbytes = nbytes if device.type == "cuda" else nbytes // 16
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------- radixserve in-process


@dataclass
class Drive:
    """What one batch of requests cost, step by step."""

    seconds: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    decode_step_seconds: list[float] = field(default_factory=list)  # steps at the full batch
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    ttft: list[float] = field(default_factory=list)


def drive(worker, config, prompts: list[list[int]], max_new_tokens: int) -> Drive:
    """Serve `prompts` (all arriving now) to completion with a fresh scheduler on `worker`."""
    from radixserve.protocol import SamplingParams, TokenBatchOut, TokenizedRequest
    from radixserve.scheduler.core import Scheduler

    sched = Scheduler(config, worker.ready_message(), lambda req: None)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        rejected = sched.add_request(TokenizedRequest(i, p, sampling))
        if rejected is not None:
            raise RuntimeError(f"request rejected: {rejected.message}")
    d = Drive(prompt_tokens=sum(map(len, prompts)))
    first: dict[int, float] = {}
    start = time.perf_counter()
    while True:
        step_start = time.perf_counter()
        batch = sched.build_batch()
        if batch is None:
            break
        sched.process_result(worker.step(batch))
        now = time.perf_counter()
        took = now - step_start
        sizes = [len(c.token_ids) for c in batch.chunks]
        if all(n == 1 for n in sizes) and all(c.prefix_len > 0 for c in batch.chunks):
            d.decode_seconds += took
            d.decode_tokens += len(sizes)
            if len(sizes) == len(prompts):
                d.decode_step_seconds.append(took)
        else:
            d.prefill_seconds += took
            d.prefill_tokens += sum(n for n in sizes if n > 1)
        for out in (o for m in sched.take_messages() if isinstance(m, TokenBatchOut) for o in m.outputs):
            d.output_tokens += len(out.new_token_ids)
            if out.new_token_ids and out.rid not in first:
                first[out.rid] = now - start
                d.cached_tokens += out.cached_tokens
    d.seconds = time.perf_counter() - start
    d.ttft = sorted(first.values())
    return d


def make_worker(args, loaded, **options):
    from radixserve.config import ServerConfig
    from radixserve.worker.worker import Worker

    config = ServerConfig(
        model=str(loaded.path), dtype=args.dtype, device=args.device, page_size=args.page_size,
        kv_memory_gb=args.kv_memory_gb, max_running_requests=max(args.decode_batches + [args.docs * args.questions]),
        chunk_size=args.prefill_batch * args.prefill_len, context_len=args.context_len, **options,
    )
    start = time.perf_counter()
    worker = Worker(config, loaded=loaded)
    startup = time.perf_counter() - start
    # warm-up: prefill and decode kernels (FlashInfer JIT-compiles each on first use)
    drive(worker, config, random_prompts(2, 32, loaded.config.vocab_size, seed=99), 4)
    return worker, config, time.perf_counter() - start, startup


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def shared_prefix_prompts(args, vocab: int) -> list[list[int]]:
    docs = random_prompts(args.docs, args.doc_len, vocab, seed=7)
    questions = random_prompts(args.docs * args.questions, args.question_len, vocab, seed=8)
    return [docs[i // args.questions] + q for i, q in enumerate(questions)]


# ---------------------------------------------------------------------- transformers


@torch.inference_mode()
def hf_prefill(model, prompts: list[list[int]], device: torch.device) -> float:
    ids = torch.tensor(prompts, device=device)
    model(ids[:, :16], use_cache=False, logits_to_keep=1)  # warm-up
    best = float("inf")
    for _ in range(2):
        _sync(device)
        start = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def hf_decode(model, prompts: list[list[int]], steps: int, device: torch.device) -> float:
    """Seconds per decode step of greedy `generate` (its prefill not counted)."""
    from transformers import LogitsProcessorList

    ids = torch.tensor(prompts, device=device)
    clock = StepClock(device)
    model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
        do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
    )
    return (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1)


# ---------------------------------------------------------------------- the run


class Report:
    def __init__(self, args, out: Path) -> None:
        self.out = out
        self.env: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.skipped: list[str] = []
        self.args = vars(args)

    def add(self, workload: str, system: str, tok_s: float | None, **extra: Any) -> None:
        self.rows.append({"workload": workload, "system": system, "tok_s": tok_s, **extra})
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        data = {"env": self.env, "args": self.args, "rows": self.rows, "skipped": self.skipped}
        (self.out / "results.json").write_text(json.dumps(data, indent=2))
        (self.out / "results.md").write_text(self.markdown())

    def markdown(self) -> str:
        lines = [f"- {k}: {v}" for k, v in self.env.items()]
        lines += ["", "| workload | system | tok/s | vs transformers | step ms | floor ms | step/floor | notes |",
                  "|---|---|---:|---:|---:|---:|---:|---|"]
        order = {w: i for i, w in reversed(list(enumerate(r["workload"] for r in self.rows)))}
        for r in sorted(self.rows, key=lambda r: order[r["workload"]]):
            lines.append(
                f"| {r['workload']} | {r['system']} | {_fmt(r['tok_s'], '.0f')} | {_fmt(r.get('vs_hf'), '.2f', 'x')} "
                f"| {_fmt(r.get('step_ms'), '.2f')} | {_fmt(r.get('floor_ms'), '.2f')} "
                f"| {_fmt(r.get('x_floor'), '.2f', 'x')} | {r.get('notes', '')} |"
            )
        if self.skipped:
            lines += ["", "Skipped (time budget or error): " + "; ".join(self.skipped)]
        return "\n".join(lines) + "\n"


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "" if v is None else f"{v:{spec}}{suffix}"


def run(args) -> Report:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    args.device = device.type
    args.dtype = resolved_dtype(args.dtype, device.type)
    dtype = getattr(torch, args.dtype)
    report = Report(args, Path(args.out))
    t0 = time.perf_counter()

    def time_left() -> bool:
        return time.perf_counter() - t0 < args.budget_s

    cfg = hf_config(args.preset)
    bw = copy_bandwidth(device)
    report.env.update(_environment(device), copy_bandwidth_GBps=round(bw / 1e9, 1), model=f"{args.preset} (random {args.dtype})")
    kv_per_token = kv_bytes_per_token(cfg, dtype)
    hf_decode_step: dict[int, float] = {}
    hf_prefill_tok_s: float | None = None

    def floor_ms(batch: int, weights: int) -> float:
        context = args.decode_context + args.decode_len / 2
        return 1e3 * (weights + batch * context * kv_per_token) / bw

    loaded = build_ours(cfg, dtype, device, args.preset)
    weights = weight_bytes_read_per_step(loaded.model)
    report.env["weights_GB"] = round(weights / 1e9, 2)
    vocab = cfg["vocab_size"]
    prefill_prompts = random_prompts(args.prefill_batch, args.prefill_len, vocab, seed=1)
    systems = [("radixserve, CUDA graphs", {}), ("radixserve, eager", {"disable_cuda_graph": True})]
    if device.type != "cuda":
        systems = [("radixserve", {})]
    if device.type == "cuda":  # reached only if both FlashInfer systems failed (see below)
        systems.append(("radixserve, torch_native", {"attention_backend": "torch_native", "disable_cuda_graph": True}))
    first = True
    for system, options in systems:
        if not time_left():
            report.skipped.append(f"{system}: all")
            continue
        if system.endswith("torch_native") and any(r["system"].startswith("radixserve") for r in report.rows):
            continue
        try:
            worker, config, ready_s, startup_s = make_worker(args, loaded, **options)
        except Exception as exc:  # noqa: BLE001 - e.g. a FlashInfer JIT build that fails: record, go on
            report.skipped.append(f"{system}: start-up failed: {type(exc).__name__}: {str(exc)[-2000:]}")
            report.write()
            _free(device)
            continue
        backend = type(worker.runner.backend).__name__
        graphs = worker.runner.graphs.sizes if worker.runner.graphs is not None else None
        report.env[f"{system} startup"] = f"{startup_s:.1f} s to build (JIT + graphs), {ready_s:.1f} s with warm-up; backend {backend}, graphs {graphs}"
        if first:  # prefill and the radix workload: once, with the first system that starts
            first = False
            d = drive(worker, config, prefill_prompts, 1)
            report.add(f"prefill {args.prefill_batch} x {args.prefill_len}", system, d.prefill_tokens / d.prefill_seconds,
                       notes=f"{d.prefill_seconds * 1e3:.0f} ms")
            for label, off in (("cache on", False), ("cache off", True)):
                if not time_left():
                    report.skipped.append(f"shared prefix, {label}")
                    continue
                cfg_run = dataclasses.replace(config, disable_radix_cache=off, chunk_size=args.shared_chunk)
                d = drive(worker, cfg_run, shared_prefix_prompts(args, vocab), args.answer_len)
                mean_ttft = sum(d.ttft) / len(d.ttft)
                report.add(
                    f"shared prefix {args.docs} docs x {args.questions} q", f"{system}, {label}",
                    (d.prompt_tokens + d.output_tokens) / d.seconds,
                    notes=f"{d.seconds:.2f} s; cached {d.cached_tokens}/{d.prompt_tokens} prompt tokens; mean TTFT {mean_ttft * 1e3:.0f} ms",
                )
        for batch in args.decode_batches:
            if not time_left():
                report.skipped.append(f"{system}: decode {batch}")
                continue
            prompts = random_prompts(batch, args.decode_context, vocab, seed=100 + batch)
            d = drive(worker, config, prompts, args.decode_len)
            steps = sorted(d.decode_step_seconds)
            if not steps:
                report.skipped.append(f"{system}: decode {batch} had no full-batch decode step")
                continue
            step = steps[len(steps) // 2]
            fl = floor_ms(batch, weights)
            report.add(
                f"decode batch {batch}", system, batch / step, step_ms=1e3 * step, floor_ms=fl, x_floor=1e3 * step / fl,
                notes=f"median of {len(steps)} full-batch steps; all decode steps: {d.decode_tokens / d.decode_seconds:.0f} tok/s",
            )
        del worker
        _free(device)

    del loaded
    _free(device)
    if args.skip_hf or not time_left():
        report.skipped.append("transformers")
    else:
        hf = build_hf(cfg, dtype, device)
        hf_prefill_tok_s = args.prefill_batch * args.prefill_len / hf_prefill(hf, prefill_prompts, device)
        report.add(f"prefill {args.prefill_batch} x {args.prefill_len}", "transformers", hf_prefill_tok_s, notes="one forward, logits_to_keep=1")
        hf_weights = weight_bytes_read_per_step(hf)
        for batch in args.decode_batches:
            if not time_left():
                report.skipped.append(f"transformers: decode {batch}")
                continue
            step = hf_decode(hf, random_prompts(batch, args.decode_context, vocab, seed=100 + batch), args.decode_len, device)
            hf_decode_step[batch] = step
            fl = floor_ms(batch, hf_weights)
            report.add(f"decode batch {batch}", "transformers", batch / step, step_ms=1e3 * step, floor_ms=fl,
                       x_floor=1e3 * step / fl, notes="generate, greedy, DynamicCache")
        del hf
        _free(device)
    for r in report.rows:  # ratios against transformers on the same workload
        hf_row = next((h for h in report.rows if h["system"] == "transformers" and h["workload"] == r["workload"]), None)
        if hf_row is not None and r["system"] != "transformers" and r["tok_s"] and hf_row["tok_s"]:
            r["vs_hf"] = r["tok_s"] / hf_row["tok_s"]
    report.env["total_s"] = round(time.perf_counter() - t0, 1)
    report.write()
    return report


def _environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "device": str(device),
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import flashinfer

        env["flashinfer"] = getattr(flashinfer, "__version__", "?")
    except Exception as exc:  # noqa: BLE001 - report whatever stops it
        env["flashinfer"] = f"not available ({type(exc).__name__})"
    return env


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = new_parser(__doc__, prog="python -m bench.gpu")
    p.add_argument("--out", default="gpu_results", help="folder for results.json and results.md")
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b", help="model shape")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    add_dtype(p)
    add_page_size(p)
    p.add_argument("--kv-memory-gb", type=float, default=48.0, help="KV pool of each radixserve worker")
    p.add_argument("--context-len", type=int, default=4096)
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--decode-context", type=int, default=512, help="prompt tokens of each decode request")
    p.add_argument("--decode-len", type=int, default=128, help="output tokens of each decode request")
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--doc-len", type=int, default=2048)
    p.add_argument("--questions", type=int, default=16, help="questions per document")
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--shared-chunk", type=int, default=8192, help="prefill token budget per step, shared-prefix workload")
    p.add_argument("--skip-hf", action="store_true", help="do not measure transformers")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no new stage after this many seconds")
    p.add_argument("--smoke", action="store_true", help="tiny sizes everywhere (a CPU check of the code path)")
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> None:
    report = run(parse_args(argv))
    print(report.markdown())
    print(f"written to {report.out}/results.json and results.md")


if __name__ == "__main__":
    main()
