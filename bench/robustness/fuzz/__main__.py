"""`python -m bench.robustness.fuzz`: start a server (or use --url), draw a plan, run it, print
and write the figures; exit code 1 if anything was found. With `--control`, the run's valid load
(what plain clients sent and the server served) then runs again alone on the same server, with
the probe beside it: the control the probe's gaps under hostile load are read against."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import add_model, add_out, add_server_arg, launch_server, new_parser
from bench.model_runner import machine
from bench.robustness.fuzz import __doc__ as overview
from bench.robustness.fuzz.plan import draw_plan
from bench.robustness.fuzz.request import Target
from bench.robustness.fuzz.run import Report, control_plan, print_report, run_plan


def main(argv: Sequence[str] | None = None) -> int:
    p = new_parser(overview, prog="python -m bench.robustness.fuzz")
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0, help="the plan's seed: the same seed, the same requests")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a request counts as a hang")
    p.add_argument("--max-new-tokens", type=int, default=4, help="the most tokens a valid request asks for")
    p.add_argument("--no-probe", action="store_true",
                   help="no plain stream probe (its gaps on the idle server, then during the run)")
    p.add_argument("--control", action="store_true",
                   help="then send the run's served requests alone, the probe beside them (its gaps without the hostile ones)")
    add_model(p, help="without --url: the model to serve; `tiny`: a 2-layer random model on the default tokenizer",
              dtype_help="without --url (auto: bf16 on CUDA and avx2+ CPUs, else fp32)")
    add_server_arg(p, help="more `serve` options without --url")
    add_out(p, "bench/results/fuzz.json")
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write(report: Report, partial: bool, control: Report | None = None) -> None:
        figures = {"date": datetime.date.today().isoformat(), "cpu": machine(), "url": args.url, "model": args.model,
                   "seed": args.seed, "partial": partial, **report.to_json()}
        if control is not None:
            figures["control"] = {k: v for k, v in control.to_json().items()
                                  if k in ("ok", "requests", "duration_s", "status_classes", "problems", "hangs", "probe")}
        args.out.write_text(json.dumps(figures, indent=1))

    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fuzz-")))
            model = str(tiny_model(work / "tiny")) if args.model == "tiny" else args.model
            log_path = args.out.with_suffix(".server.log")
            print(f"fuzz: starting `radixserve serve --model {args.model}` (log: {log_path})", file=sys.stderr)
            server = launch_server(model, "--dtype", args.dtype, *args.server_arg, log_path=log_path)
            url = stack.enter_context(server).url
        target = Target.from_server(url, max_new_tokens=args.max_new_tokens)
        started = time.monotonic()
        plan = draw_plan(target, args.requests, args.seed)
        print(f"fuzz: {len(plan)} requests drawn in {time.monotonic() - started:.0f} s; sending", file=sys.stderr)

        def progress(done: int, report: Report) -> None:
            print(f"fuzz: {done}/{len(plan)} sent, problems {dict(report.problems)}", file=sys.stderr, flush=True)
            write(report, partial=True)  # what a killed run found is not lost

        run = run_plan(url, plan, concurrency=args.concurrency, timeout=args.timeout, probe=not args.no_probe,
                       progress=progress)
        report = asyncio.run(run)
        control = None
        if args.control and not args.no_probe and not report.engine_dead:
            valid = control_plan(plan, report)
            print(f"fuzz: control: the {len(valid)} served requests alone, the probe beside them", file=sys.stderr)
            control = asyncio.run(run_plan(url, valid, concurrency=args.concurrency, timeout=args.timeout))
    write(report, partial=False, control=control)
    print_report(report)
    if control is not None:
        during, alone = report.probe["during"], control.probe["during"]
        print(f"  control ({control.requests} served requests alone, ok {control.ok}): probe worst gap "
              f"{alone['worst_gap_ms']} ms, p99 {alone['p99_gap_ms']} ms, median {alone['median_gap_ms']} ms; "
              f"with the hostile requests {during['worst_gap_ms']} / {during['p99_gap_ms']} / {during['median_gap_ms']} ms")
    print(f"fuzz: figures written to {args.out}", file=sys.stderr)
    return 0 if report.ok and (control is None or control.ok) else 1


def tiny_model(path: Path) -> Path:
    """A 2-layer random Llama on the default model's tokenizer (and chat template): the whole
    HTTP path at a fraction of the default model's cost."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from radixserve.models.resolve import resolve_model

    default = resolve_model("default", weights=False)  # its tokenizer
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
             "chat_template.jinja")
    for name in names:
        if (default / name).exists():
            shutil.copy(default / name, path / name)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
