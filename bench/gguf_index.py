"""How long a worker takes to read a GGUF's tensor index (radixserve/models/gguf_index.py), against
the gguf package's GGUFReader on the same file in the same run, and what a warm load of the
model costs with it. A worker reads the index on every start and every restart after a crash.

    python -m bench.gguf_index                       # the default model's file
    python -m bench.gguf_index --model path/to/model.gguf --repeats 9

Each repeat opens the file once with each reader, in alternating order; medians are reported.
The warm load is `load_model(model, bfloat16)` in this process after one load has filled the
caches (the converted folder, the kernel library, the page cache).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from gguf import GGUFReader

from bench.common import new_parser
from bench.model_runner import machine
from radixserve.models import load_model
from radixserve.models.gguf_index import GGUFIndex
from radixserve.models.resolve import gguf_file


def _seconds(read: type, path: Path) -> float:
    start = time.perf_counter()
    read(path)
    return time.perf_counter() - start


def run(model: str, repeats: int) -> dict[str, object]:
    path = gguf_file(model)
    if path is None:
        raise SystemExit(f"{model} is not a GGUF file")
    times: dict[str, list[float]] = {"GGUFIndex": [], "gguf.GGUFReader": []}
    for r in range(repeats):
        order = (GGUFIndex, GGUFReader) if r % 2 == 0 else (GGUFReader, GGUFIndex)
        for reader in order:
            times["GGUFIndex" if reader is GGUFIndex else "gguf.GGUFReader"].append(_seconds(reader, path))
    load_model(model, torch.bfloat16)  # fills the caches
    loads = []
    for _ in range(3):
        start = time.perf_counter()
        load_model(model, torch.bfloat16)
        loads.append(time.perf_counter() - start)
    index, reader = statistics.median(times["GGUFIndex"]), statistics.median(times["gguf.GGUFReader"])
    return {
        "machine": machine(), "date": time.strftime("%Y-%m-%d"), "file": path.name,
        "file_mb": round(path.stat().st_size / 1e6, 1), "repeats": repeats,
        "index_s": round(index, 4), "gguf_reader_s": round(reader, 3), "reader_over_index": round(reader / index, 1),
        "warm_load_s": round(statistics.median(loads), 2),
    }


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--model", default="default", help="a GGUF file, or `default`")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the results (JSON) here")
    args = parser.parse_args()
    result = run(args.model, args.repeats)
    print(f"{result['file']} ({result['file_mb']} MB), {result['machine']}")
    print(f"tensor index: GGUFIndex {result['index_s'] * 1e3:.1f} ms, gguf.GGUFReader {result['gguf_reader_s']:.2f} s "
          f"({result['reader_over_index']}x); warm load_model: {result['warm_load_s']:.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
