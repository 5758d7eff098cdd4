"""How long a GGUF's first load takes, and what it leaves in the cache: a quantized load
(`quantization="gguf"`, the default on the CPU: its cache entry gets the config and tokenizer,
and every tensor is read from the file) against a dequantized one (`quantization="none"`: the
entry gets every weight dequantized to fp32 as well, models/resolve.py), in the same run.

    python -m bench.gguf_first_load                          # the default model's file
    python -m bench.gguf_first_load --model path/to/model.gguf --repeats 3

Each load runs in a new process on an empty model cache (the compiled kernels are shared, so
no load compiles them), the two kinds alternating; it times `load_model(model, bfloat16,
quantization=...)` from the process's first import and sizes the cache entry it wrote.
Medians are reported.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import add_model, new_parser
from bench.model_runner import machine
from radixserve.kernels import cpu as cpu_kernels
from radixserve.models.resolve import gguf_file
from radixserve.paths import cache_dir

KINDS = ("gguf", "none")
_LOAD = """import sys, time
start = time.perf_counter()
import torch
from radixserve.models import load_model
loaded = load_model(sys.argv[1], torch.bfloat16, quantization=sys.argv[2])
print(time.perf_counter() - start, loaded.weight_format)
"""


def _bytes_under(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def first_load(model: str, quantization: str) -> tuple[float, int, str]:
    """Seconds of one cold load in a new process, the bytes of the cache entry it wrote, and the
    weight format it reported."""
    root = Path(tempfile.mkdtemp(prefix="radixserve-first-load-"))
    try:
        (root / "kernels").symlink_to(cache_dir() / "kernels")
        env = {**os.environ, "RADIXSERVE_CACHE": str(root)}
        done = subprocess.run([sys.executable, "-c", _LOAD, model, quantization], env=env, check=True,
                              capture_output=True, text=True)
        seconds, weight_format = done.stdout.strip().splitlines()[-1].split(maxsplit=1)
        return float(seconds), _bytes_under(root / "models"), weight_format
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(model: str, repeats: int) -> dict[str, object]:
    path = gguf_file(model)
    if path is None:
        raise SystemExit(f"{model} is not a GGUF file")
    if cpu_kernels.load_library() is None:
        raise SystemExit("the CPU kernels are off here: a quantized load needs them")
    seconds: dict[str, list[float]] = {k: [] for k in KINDS}
    entry: dict[str, int] = {}
    formats: dict[str, str] = {}
    for r in range(repeats):
        for kind in KINDS if r % 2 == 0 else reversed(KINDS):
            s, size, formats[kind] = first_load(model, kind)
            seconds[kind].append(s)
            entry[kind] = size
            print(f"  round {r + 1}: --quantization {kind}: {s:.1f} s, cache entry {size / 1e6:.1f} MB", flush=True)
    gguf, none = statistics.median(seconds["gguf"]), statistics.median(seconds["none"])
    return {
        "machine": machine(), "date": time.strftime("%Y-%m-%d"), "file": path.name,
        "file_mb": round(path.stat().st_size / 1e6, 1), "repeats": repeats,
        "first_load_s": {k: round(statistics.median(v), 2) for k, v in seconds.items()},
        "each_load_s": {k: [round(s, 2) for s in v] for k, v in seconds.items()},
        "cache_entry_mb": {k: round(v / 1e6, 1) for k, v in entry.items()},
        "weight_format": formats, "gguf_over_none": round(gguf / none, 2),
    }


def _print(result: dict) -> None:
    print(f"{result['file']} ({result['file_mb']} MB), {result['machine']}")
    for kind in KINDS:
        print(f"first load, --quantization {kind} ({result['weight_format'][kind]}): {result['first_load_s'][kind]:.1f} s, "
              f"cache entry {result['cache_entry_mb'][kind]:.1f} MB")
    print(f"quantized / dequantized: {result['gguf_over_none']}x the time")


def main() -> None:
    parser = new_parser(__doc__)
    add_model(parser, help="a GGUF file, or `default`", dtype=False)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the two kinds of load, alternating")
    parser.add_argument("--out", help="write the results (JSON) here")
    args = parser.parse_args()
    result = run(args.model, args.repeats)
    _print(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
